"""Converting a GGUF file into an fp32 Hugging Face folder, without transformers.

transformers can do this (``from_pretrained(gguf_file=...)``), and ddspec falls back to it for any
file this module does not cover, but on a new user's first run it was the long pole: importing
transformers' modelling code, gguf-py turning the 49k-token vocabulary and 49k merges into Python
objects three times, and the tokenizer conversion took ~21 s of a ~40 s first command. This
writes the same folder from one pass over the file (``GGUFLayout``).

Architectures (``general.architecture``) and what their conversion does:

- ``llama`` (with either vocabulary below: SmolLM, Llama 2, Mistral, TinyLlama, ...): LlamaConfig; q
  and k rows put back in Hugging Face's order (llama.cpp's converter interleaves the two halves of
  each rotary head, see :func:`rotary_heads`);
- ``qwen2``: Qwen2Config; q, k and v biases as they are;
- ``qwen3``: Qwen3Config (head size from ``attention.key_length``), q and k norms;
- ``gemma``, ``gemma2``, ``gemma3`` (text; written as ``gemma3_text`` / Gemma3ForCausalLM): llama.cpp
  stores every RMSNorm weight as 1 + w (Gemma's norm scales by 1 + w), so w = value - 1 here;
  Gemma 2 and 3's four norms per layer under their own names; Gemma 2's soft-capping, the
  sliding window and the sliding / full layer pattern (llama.cpp's: every 2nd layer full for Gemma 2,
  every 6th for Gemma 3, unless the file gives ``attention.sliding_window_pattern``; a Gemma 3 file
  without a window: every layer), the local and
  global rotary bases (Gemma 3's global one with its linear scaling) and the query scale
  (``query_pre_attn_scalar``: the head size, or hidden / heads for the 27B models, as llama.cpp does);
- ``phi3``: Phi3Config; the fused qkv and gate|up weights as Phi-3's checkpoint has them, partial
  rotary dimensions, and LongRoPE (the ``rope_factors_long`` / ``_short`` tensors become
  ``rope_parameters``' long and short factors); llama.cpp runs Phi-3 without its sliding window,
  and so does the folder.

For all of them:

- ``config.json``: the settings under transformers' names (as its config class saves them);
- ``model.safetensors``: each tensor dequantised with gguf-py's formulas (``dequantize_tensor``),
  ``lm_head`` left out when the file has no ``output.weight`` (tied); the weights the native kernels
  read stay in the GGUF file (``gguf_blocks.MANIFEST``);
- ``tokenizer.json``, chosen by ``tokenizer.ggml.model``: byte-level BPE (``gpt2``) from the tokens and
  merges, split by GPT-2's regex or by Qwen2's (``tokenizer.ggml.pre``); or a SentencePiece
  vocabulary (``llama``: tokens, scores and types) as the BPE with byte fallback transformers builds
  from it (merges recovered from the scores; Gemma's and Phi-3's own spelling of spaces follow the
  architecture, as in transformers, since the file does not say). Control tokens (type 3) are added
  as special tokens and user-defined ones (type 4) as plain added tokens; BOS / EOS added as the
  file says;
- ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json`` (for the
  architectures above but llama and qwen2, its EOS list also holds the file's end-of-turn token).

tests/test_gguf_convert.py checks the result against transformers' conversion of the default
model and of small files of each architecture (every weight bit for bit, the config, the tokenizer
on text and chat templates) and, where transformers' loader misses a setting, against the model the
file was written from (its config and logits).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ddspec.models.gguf_blocks import (MANIFEST, NATIVE_SOURCES, GGUFError, GGUFLayout, dequantize, ggml_name, hf_name,
                                      layer_parts, manifest_tensors, native_blocks, rotary_order)


class NotCovered(Exception):
    """This GGUF needs transformers' converter (another architecture, tokenizer or tensor type)."""


# pre-tokenizer names whose split is GPT-2's ByteLevel regex (others need transformers' table)
_PLAIN_PRE = {None, "default", "gpt2", "smollm"}
# pre-tokenizer names whose split is Qwen2's regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, the names
# transformers' GGUF tokenizer table gives Qwen2's PRETOKENIZE_REGEX)
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"}
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# architectures covered -> whether llama.cpp's converter interleaved the rotary halves of q and k
# (LlamaModel.permute: llama; the others' models write them as Hugging Face has them, and
# transformers' GGUF loader un-permutes only llama's, LlamaTensorProcessor)
_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False, "gemma": False, "gemma2": False, "gemma3": False,
             "phi3": False}
# Gemma's RMSNorm scales by 1 + w; llama.cpp's Gemma converters store 1 + w (GemmaModel.modify_tensors,
# Gemma3Model.norm_shift), transformers' loader subtracts the 1 again (Gemma2TensorProcessor)
_NORM_SHIFTED = {"gemma", "gemma2", "gemma3"}
# tensors that are settings, not weights: Phi-3's LongRoPE factors (rope_parameters' long / short factors)
_SETTING_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}


def rotary_heads(arch: str, gguf_name: str, cfg: dict) -> int:
    """The number of heads whose rows (weight or bias) of ``gguf_name`` llama.cpp interleaved per
    rotary head, to be put back with :func:`unpermute_rotary`; 0 for a tensor left as it is."""
    if not _PERMUTED.get(arch):
        return 0
    if ".attn_q." in gguf_name:
        return int(cfg["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return int(cfg["num_key_value_heads"])
    return 0


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    """The name a Hugging Face checkpoint of ``arch`` gives a GGUF tensor."""
    short = hf_name(name, arch)
    if short is None:
        raise NotCovered(f"tensor {name!r} has no {'llama' if arch == 'qwen2' else arch} counterpart")
    return short if short == "lm_head.weight" else f"model.{short}"


def dequantize_tensor(ttype: int, dims: list[int], raw: np.ndarray) -> np.ndarray:
    """fp32 array [rows..., dims[0]] by gguf-py's formulas: F32, F16 and BF16 as they are, the block
    types the native kernels read (Q4_0, Q4_1, Q5_0, Q8_0 and the K types) through the same blocks, every other type
    (the K types, Q5_1, ...) through gguf-py's own dequantisation."""
    shape = tuple(reversed(dims))
    if ttype == 0:
        return np.frombuffer(raw, dtype=np.float32).reshape(shape)
    if ttype == 1:
        return np.frombuffer(raw, dtype=np.float16).astype(np.float32).reshape(shape)
    if ttype == 30:
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    if ttype == 2:  # Q4_0: (q - 8) * d, gguf-py's form (its level 8 under a negative scale is -0.0)
        b = raw.reshape(rows, -1, 18)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        qs = b[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - np.int8(8)
        return (d * q.astype(np.float32)).reshape(shape)
    if ttype in NATIVE_SOURCES:  # Q4_1: d * q + m; Q5_0 and Q8_0: q * d
        return dequantize(*native_blocks(ttype, raw, rows)).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = GGMLQuantizationType(ttype)
        return np.asarray(gguf_dequantize(np.asarray(raw).reshape(rows, -1), qtype), dtype=np.float32).reshape(shape)
    except (ValueError, NotImplementedError) as e:
        raise NotCovered(f"GGML tensor type {ggml_name(ttype)} ({e})") from None


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows: within each head it stores the rotary pairs
    interleaved; Hugging Face keeps the two halves apart (gguf_blocks.rotary_order)."""
    return w[rotary_order(w.shape[0], heads)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE spells tokens in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def _config(meta: dict, tensors: dict, vocab: int) -> dict:
    """config.json as transformers writes it for the file (LlamaConfig or Qwen2Config)."""
    arch = meta.get("general.architecture")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    scaling = {k.removeprefix(f"{arch}.rope.scaling.") for k in meta if k.startswith(f"{arch}.rope.scaling")}
    if scaling - _ROPE_SCALING.get(arch, set()) or get("expert_count"):
        raise NotCovered("rope scaling or experts")
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    special = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in
               (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id"))}
    if arch == "qwen2":
        return _qwen2_config(meta, tensors, vocab, get, special)
    if arch == "qwen3":
        return _qwen3_config(meta, tensors, vocab, get, special)
    if arch in _NORM_SHIFTED:
        return _gemma_config(arch, meta, tensors, vocab, get, special)
    if arch == "phi3":
        return _phi3_config(meta, tensors, vocab, get, special)
    cfg = {
        "_model_name_or_path": meta.get("general.name"),
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special["bos_token_id"],
        "dtype": "float32",
        "eos_token_id": special["eos_token_id"],
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length", 2048)),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": int(get("block_count")),
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "pad_token_id": special["pad_token_id"],
        "pretraining_tp": 1,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in tensors,
        "unk_token_id": special["unk_token_id"],
        "use_cache": True,
        "vocab_size": int(get("vocab_size", vocab)),
    }
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: the per-frequency divisors llama.cpp computed from "llama3"
        ttype, dims, raw = tensors["rope_freqs.weight"]
        factors = [float(f) for f in dequantize_tensor(ttype, dims, raw).reshape(-1)]
        # transformers' "longrope" divides each inverse frequency by its factor, as llama.cpp does with
        # these (the same factors at every position, no attention scaling)
        cfg["rope_parameters"] = {"rope_theta": cfg["rope_parameters"]["rope_theta"], "rope_type": "longrope",
                                  "short_factor": factors, "long_factor": factors, "attention_factor": 1.0,
                                  "original_max_position_embeddings": cfg["max_position_embeddings"]}
    return {k: v for k, v in cfg.items() if v is not None or k.endswith("_token_id")}


def _qwen2_config(meta: dict, tensors: dict, vocab: int, get, special: dict) -> dict:
    """Qwen2Config's fields in the order and form transformers saves them: its GGUF loader maps the
    ``qwen2.*`` keys as llama's but for the rotary dimension (Qwen2Config has no ``head_dim``: it is
    always hidden / heads, so a file saying otherwise is left to transformers), sets no sliding
    window (llama.cpp runs qwen2 with full attention in every layer), and writes ``unk_token_id``
    only when the file has one."""
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = get("rope.dimension_count", get("attention.key_length", hidden // heads))
    if int(head_dim) != hidden // heads or heads * (hidden // heads) != hidden:
        raise NotCovered(f"a qwen2 head size ({head_dim}) other than hidden / heads")
    return _finish(_qwen_fields("qwen2", meta, tensors, vocab, get, special),
                   ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window"))


def _qwen_fields(model_type: str, meta: dict, tensors: dict, vocab: int, get, special: dict) -> dict:
    """The fields Qwen2Config and Qwen3Config share, as transformers saves them (no sliding window:
    llama.cpp runs every layer with full attention)."""
    heads, layers = int(get("attention.head_count")), int(get("block_count"))
    return {
        "_model_name_or_path": meta.get("general.name"),
        "architectures": [f"{model_type.capitalize()}ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": special["bos_token_id"],
        "dtype": "float32",
        "eos_token_id": special["eos_token_id"],
        "hidden_act": "silu",
        "hidden_size": int(get("embedding_length")),
        "initializer_range": 0.02,
        "intermediate_size": int(get("feed_forward_length")),
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": int(get("context_length", 32768)),
        "max_window_layers": 28,
        "model_type": model_type,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "pad_token_id": special["pad_token_id"],
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "unk_token_id": special["unk_token_id"],
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(get("vocab_size", vocab)),
    }


# the rope.scaling keys an architecture's config can express (others: NotCovered): Gemma 3's linear
# scaling of its global layers, Phi-3's LongRoPE context and attention factor
_ROPE_SCALING = {"gemma3": {"type", "factor"}, "phi3": {"original_context_length", "attn_factor"}}


def _finish(cfg: dict, keep_none: tuple[str, ...]) -> dict:
    """``cfg`` without the None values transformers leaves out (the ones in ``keep_none`` it saves as null)."""
    return {k: v for k, v in cfg.items() if v is not None or k in keep_none}


def _head_dim(get, hidden: int, heads: int, arch: str) -> int:
    """The head size (``attention.key_length``, else hidden / heads), which must also be the value
    size and the rotary dimension (the configs below have no setting for either to differ)."""
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim or int(get("rope.dimension_count", head_dim)) != head_dim:
        raise NotCovered(f"a {arch} file whose value or rotary size differs from its head size {head_dim}")
    return head_dim


def _qwen3_config(meta: dict, tensors: dict, vocab: int, get, special: dict) -> dict:
    """Qwen3Config as transformers saves it: Qwen2's settings plus ``head_dim`` (llama.cpp writes it as
    ``attention.key_length``; transformers' GGUF loader reads none and keeps 128, which only the real
    Qwen3 models have) and ``attention_bias`` (no file of llama.cpp's has one)."""
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    cfg = _qwen_fields("qwen3", meta, tensors, vocab, get, special)
    cfg.update(attention_bias=False, head_dim=_head_dim(get, hidden, heads, "qwen3"))
    return _finish(cfg, ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window"))


def _sliding_layers(get, layers: int, every: int) -> list[bool]:
    """Which layers attend through the sliding window, as llama.cpp decides (load_swa_pattern): the
    file's ``attention.sliding_window_pattern`` (one flag per layer, or n: the last of every n layers
    full), else every ``every``-th layer full."""
    pattern = get("attention.sliding_window_pattern", every)
    if isinstance(pattern, (list, np.ndarray)):
        if len(pattern) != layers:
            raise NotCovered(f"a sliding-window pattern of {len(pattern)} layers for {layers}")
        return [bool(x) for x in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _gemma_config(arch: str, meta: dict, tensors: dict, vocab: int, get, special: dict) -> dict:
    """GemmaConfig, Gemma2Config or Gemma3TextConfig as transformers saves them, with the settings as
    llama.cpp runs the file (src/models/gemma*.cpp): Gemma 2's attention and final soft-capping (50
    and 30 when the file has none), its window (4096 when none) on every other layer and one rotary
    base; Gemma 3's final soft-capping (none when 0), its window (none: every layer full) on five
    layers of six, the global base (``rope.freq_base``, linearly scaled by ``rope.scaling.factor``)
    and the local one (``rope.freq_base_swa``, else 10000). The query scale is 1 / sqrt(head size),
    but 1 / sqrt(hidden / heads) for the 27B models (46 layers of Gemma 2, 62 of Gemma 3), as
    llama.cpp sets it (transformers' GGUF loader keeps 256 for both, and reads neither soft-capping
    nor Gemma 3's scaling). Special ids the file lacks take the config class's defaults."""
    heads, hidden, layers = int(get("attention.head_count")), int(get("embedding_length")), int(get("block_count"))
    head_dim = _head_dim(get, hidden, heads, arch)
    ids = {k: special[k] if special[k] is not None else default
           for k, default in (("bos_token_id", 2), ("eos_token_id", 1), ("pad_token_id", 0))}
    base = float(get("rope.freq_base", 10000.0))
    cfg = {
        "_model_name_or_path": meta.get("general.name"),
        "architectures": [{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]],
        "attention_bias": False,
        "attention_dropout": 0.0,
        **ids,
        "dtype": "float32",
        "head_dim": head_dim,
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length", 8192)),
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_theta": base, "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in tensors,
        "unk_token_id": special["unk_token_id"],
        "use_bidirectional_attention": None,
        "use_cache": True,
        "vocab_size": int(get("vocab_size", vocab)),
    }
    if arch == "gemma":
        cfg["hidden_act"] = "gelu_pytorch_tanh"
        return _finish(cfg, ("use_bidirectional_attention",))
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = hidden // heads if layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim
    if arch == "gemma2":
        if float(get("rope.freq_base_swa", base)) != base:
            raise NotCovered("a gemma2 file with a local rotary base of its own")
        sliding = _sliding_layers(get, layers, 2)
        cfg.update(attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
                   final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
                   sliding_window=int(get("attention.sliding_window", 4096)))
    else:
        window = int(get("attention.sliding_window", 0))
        sliding = _sliding_layers(get, layers, 6) if window > 0 else [False] * layers
        kind, factor = get("rope.scaling.type"), float(get("rope.scaling.factor", 0.0))
        if kind not in (None, "none", "linear"):
            raise NotCovered(f"gemma3 rope scaling {kind!r}")
        full = {"factor": factor, "rope_theta": base, "rope_type": "linear"} if factor not in (0.0, 1.0) else \
            {"rope_theta": base, "rope_type": "default"}
        local = {"rope_theta": float(get("rope.freq_base_swa", 10000.0)), "rope_type": "default"}
        softcap = float(get("final_logit_softcapping", 0.0))
        # without a window every layer is full, and the window (the class's 4096) is never used, but
        # Gemma3's model builds a sliding mask whatever the layer types
        cfg.update(_sliding_window_pattern=6, attn_logit_softcapping=None, final_logit_softcapping=softcap or None,
                   rope_parameters={"full_attention": full, "sliding_attention": local},
                   sliding_window=window or 4096, use_bidirectional_attention=False)
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return _finish(cfg, ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"))


def _phi3_config(meta: dict, tensors: dict, vocab: int, get, special: dict) -> dict:
    """Phi3Config as transformers saves it. The rotary dimension (``rope.dimension_count``) gives
    ``partial_rotary_factor``; ``rope.scaling.original_context_length`` the original context; the
    ``rope_factors_long`` / ``_short`` tensors (Phi-3's 128k models) LongRoPE's factors, with the
    file's attention factor where it differs from the one transformers derives (transformers' GGUF
    loader reads none of these). Phi3Config's default special ids (1, 32000, 32000) stand in for the
    ones the file lacks, where inside the vocabulary."""
    heads, hidden, layers = int(get("attention.head_count")), int(get("embedding_length")), int(get("block_count"))
    head_dim, context = hidden // heads, int(get("context_length", 4096))
    rotary = int(get("rope.dimension_count", head_dim))
    if heads * head_dim != hidden or rotary % 2 or not 0 < rotary <= head_dim:
        raise NotCovered(f"a phi3 head size {hidden}/{heads} with {rotary} rotary dimensions")
    original = int(get("rope.scaling.original_context_length", context))
    rope = {"partial_rotary_factor": rotary / head_dim, "rope_theta": float(get("rope.freq_base", 10000.0)),
            "rope_type": "default"}
    factors = [tensors.get(name) for name in sorted(_SETTING_TENSORS)]  # long, short
    if any(f is not None for f in factors):
        if any(f is None or f[0] != 0 or f[1] != [rotary // 2] for f in factors):
            raise NotCovered("phi3 rope factors that are not two F32 vectors of rotary / 2")
        long, short = (np.frombuffer(f[2], dtype=np.float32).tolist() for f in factors)
        rope = dict(long_factor=long, original_max_position_embeddings=original, **rope, short_factor=short)
        rope["rope_type"] = "longrope"
        scale = context / original
        derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        attention = float(get("rope.scaling.attn_factor", derived))
        if abs(attention - derived) > 1e-6 * derived:
            rope = dict(attention_factor=attention, **rope)
    vocab_size = int(get("vocab_size", vocab))
    ids = {k: special[k] if special[k] is not None else (default if default < vocab_size else None)
           for k, default in (("bos_token_id", 1), ("eos_token_id", 32000), ("pad_token_id", 32000))}
    cfg = {
        "_model_name_or_path": meta.get("general.name"),
        "architectures": ["Phi3ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos_token_id"],
        "dtype": "float32",
        "embd_pdrop": 0.0,
        "eos_token_id": ids["eos_token_id"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": context,
        "model_type": "phi3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "original_max_position_embeddings": original,
        "pad_token_id": ids["pad_token_id"],
        "resid_pdrop": 0.0,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope,
        "sliding_window": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "unk_token_id": special["unk_token_id"],
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    return _finish(cfg, ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window"))


def _bpe_tokenizer(meta: dict) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) of a byte-level BPE vocabulary.

    The split is GPT-2's (ByteLevel's own regex) or, for Qwen2's pre-tokenizer names, Qwen2's: as
    Qwen2's tokenizer.json has it, NFC first, then the regex (each match isolated), then ByteLevel
    without its regex. transformers' GGUF tokenizer writes the same split without the NFC
    normalizer, but the Qwen2Tokenizer that then loads its folder puts NFC back, so text encodes as
    it does with the model's own tokenizer and with ddspec's transformers fallback."""
    tokens, merges = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type")
    if merges is None:
        raise NotCovered("no merges in the file")
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))] = i
    added = []
    for i, t in enumerate(tokens):
        kind = int(types[i]) if types is not None else 1
        if (kind == 3 and set(t) <= alphabet) or (kind == 4 and t in vocab):
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == 3})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    normalizer, pre_tokenizer = None, byte_level
    if meta.get("tokenizer.ggml.pre") in _QWEN2_PRE:
        normalizer = {"type": "NFC"}
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            dict(byte_level, trim_offsets=False, use_regex=False)]}
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _post_processor(meta, add_bos=False),
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [m.split(" ") for m in merges]},
    }
    return tok, _tokenizer_config(meta, tok)


def _post_processor(meta: dict, add_bos: bool) -> dict:
    """TemplateProcessing as transformers sets it (update_post_processor): the BOS token before and
    the EOS token after each sequence where the file says to add them (``add_bos``: when it does not say)."""
    tokens = meta["tokenizer.ggml.tokens"]

    def named(key: str, flag: str, default: bool) -> tuple[str, int] | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return (tokens[int(i)], int(i)) if i is not None and meta.get(f"tokenizer.ggml.{flag}", default) else None

    bos, eos = named("bos_token_id", "add_bos_token", add_bos), named("eos_token_id", "add_eos_token", False)

    def sequence(name: str, type_id: int) -> list[dict]:
        return ([{"SpecialToken": {"id": bos[0], "type_id": type_id}}] if bos else []) + \
            [{"Sequence": {"id": name, "type_id": type_id}}] + \
            ([{"SpecialToken": {"id": eos[0], "type_id": type_id}}] if eos else [])

    return {"type": "TemplateProcessing", "single": sequence("A", 0), "pair": sequence("A", 0) + sequence("B", 1),
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in filter(None, (bos, eos))}}


def _tokenizer_config(meta: dict, tok: dict) -> dict:
    """tokenizer_config.json: the special tokens by name, and whether BOS / EOS are added (where they are)."""
    tokens = meta["tokenizer.ggml.tokens"]
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(1e30)}
    for name, key in names.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None:
            tok_cfg[name] = tokens[int(i)]
    single = tok["post_processor"]["single"]
    if "SpecialToken" in single[0]:
        tok_cfg["add_bos_token"] = True
    if "SpecialToken" in single[-1]:
        tok_cfg["add_eos_token"] = True
    return tok_cfg


# the special tokens transformers' SentencePiece tokenizer classes bring of their own (LlamaTokenizer's,
# GemmaTokenizer's defaults): transformers would append any the vocabulary lacks, so those files are left to it
_SPM_OWN = {"llama": ("<unk>", "<s>", "</s>"), "gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")}
_METASPACE_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}


def _spm_tokenizer(meta: dict, arch: str) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) of a SentencePiece vocabulary (``tokenizer.ggml.model``
    "llama"), as transformers builds it (integrations/gguf/gguf_tokenizer_mapping.py and the
    LlamaTokenizer / GemmaTokenizer it hands the vocabulary to): BPE with byte fallback over the
    pieces, the merges the file gives or those its vocabulary implies (:func:`_spm_merges`), ranked by
    score. The flavour follows the architecture, as there: Gemma's files store whitespace pieces as
    spaces (spelled with ▁ here) and rank merges by position, and its spaces become ▁ before a split
    after each; Phi-3's normalizer puts ▁ before the text and for each space; the others split with
    Metaspace (▁ before the first word). Added tokens: the class's own special tokens, control
    tokens (type 3) as special, user-defined ones (type 4) as plain, then the file's BOS, EOS, UNK and
    PAD; BOS is added before each text unless the file says otherwise."""
    tokens, types = list(meta["tokenizer.ggml.tokens"]), meta.get("tokenizer.ggml.token_type")
    flavour = "gemma" if arch in _NORM_SHIFTED else "phi3" if arch == "phi3" else "llama"
    if flavour == "gemma":
        spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(spelled)}
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise NotCovered("a sentencepiece vocabulary without scores")
        spelled, ranks = tokens, dict(zip(tokens, np.asarray(scores, dtype=np.float64).tolist()))
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = meta.get("tokenizer.ggml.merges")
    merges = [m.split(" ") for m in merges] if merges is not None else _spm_merges(vocab, ranks)
    added: dict[int, tuple[str, bool]] = {}  # id -> (content, special); a later addition replaces an earlier one

    def add(token: str, special: bool) -> None:
        if token not in vocab:
            raise NotCovered(f"special token {token!r} outside the sentencepiece vocabulary")
        added[vocab[token]] = (token, special)

    for token in _SPM_OWN["gemma" if flavour == "gemma" else "llama"]:
        add(token, True)
    for kind, special in ((3, True), (4, False)):
        for i, token in enumerate(tokens):
            if types is not None and int(types[i]) == kind and (special or token in vocab):
                add(token, special)
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and tokens[int(i)] not in {content for content, _ in added.values()}:
            add(tokens[int(i)], True)
    space = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    normalizer, pre_tokenizer, decoder = {
        "gemma": (space, {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
                  _METASPACE_DECODER),
        "phi3": ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, space]}, None,
                 dict(_METASPACE_DECODER, decoders=_METASPACE_DECODER["decoders"] + strip)),
        "llama": (None, {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
                  dict(_METASPACE_DECODER, decoders=_METASPACE_DECODER["decoders"] + strip)),
    }[flavour]
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": special} for i, (content, special) in sorted(added.items())],
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": _post_processor(meta, add_bos=True),
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>" if flavour == "gemma" else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    return tok, _tokenizer_config(meta, tok)


def _spm_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[list[str]]:
    """The merges a SentencePiece vocabulary implies, as transformers' generate_merges orders them:
    every split of a piece into two pieces of the vocabulary, ranked by the whole piece's rank (highest
    first), then by the lengths of the two parts (longest first); ties keep the pieces' order, and
    within a piece the parts' ids order the splits."""
    merges = []
    for piece, rank in ranks.items():
        local = [(piece[:i], piece[i:], rank) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _tokenizer(meta: dict, arch: str) -> tuple[dict, dict]:
    """The tokenizer ``tokenizer.ggml.model`` names: byte-level BPE (gpt2) or SentencePiece (llama)."""
    return _bpe_tokenizer(meta) if meta.get("tokenizer.ggml.model") == "gpt2" else _spm_tokenizer(meta, arch)


def _check_biases(arch: str, tensors: dict) -> None:
    """Qwen2's attention has q, k and v biases (Qwen2ForCausalLM always has them), llama's none: a
    qwen2 file without them, or a file with any other bias, is left to transformers."""
    biases = {name for name in tensors if name.endswith(".bias")}
    if arch == "qwen2":
        layers = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
        wanted = {f"blk.{i}.{part}.bias" for i in layers for part in ("attn_q", "attn_k", "attn_v")}
        if wanted - biases:
            raise NotCovered(f"a qwen2 file without the bias {sorted(wanted - biases)[0]!r}")
        biases -= wanted
    if biases:
        raise NotCovered(f"tensor {sorted(biases)[0]!r} (a bias {arch} has no place for)")


def _check_layers(arch: str, meta: dict, tensors: dict) -> None:
    """Every layer of an architecture added after llama and qwen2 has each weight its Hugging Face
    model has (a file without one, e.g. a Phi-3 file with q, k and v apart, is left to transformers)."""
    if arch in ("llama", "qwen2"):
        return
    parts = layer_parts(arch)
    for i in range(int(meta.get(f"{arch}.block_count", 0))):
        for part in parts:
            if f"blk.{i}.{part}.weight" not in tensors:
                raise NotCovered(f"a {arch} file without tensor blk.{i}.{part}.weight")
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in tensors:
            raise NotCovered(f"a {arch} file without tensor {name}")


def convert(gguf: Path, out: Path) -> None:
    """Write the fp32 HF folder of ``gguf`` into ``out`` (an empty folder); raises NotCovered for
    a file this converter does not handle (the caller then uses transformers')."""
    from safetensors.numpy import save_file

    layout = GGUFLayout(gguf, strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    meta = layout.metadata
    arch = meta.get("general.architecture")
    if arch not in _PERMUTED:
        raise NotCovered(f"architecture {arch!r}")
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if not (model == "gpt2" and pre in _PLAIN_PRE | _QWEN2_PRE or model == "llama" and pre in (None, "default")):
        raise NotCovered(f"tokenizer {model!r}/{pre!r}")
    _check_biases(arch, layout.tensors)
    _check_layers(arch, meta, layout.tensors)
    unknown = layout.unknown_types()
    if unknown:
        name, ttype = next(iter(unknown.items()))
        raise GGUFError(f"{gguf}: tensor {name!r} has GGML type {ttype}, which neither ddspec nor gguf-py knows "
                        f"({len(unknown)} such tensor{'s' if len(unknown) > 1 else ''}): a newer or damaged file; "
                        "re-quantize it to a common type (e.g. llama-quantize ... Q8_0)")
    cfg = _config(meta, layout.tensors, len(meta["tokenizer.ggml.tokens"]))
    tok, tok_cfg = _tokenizer(meta, arch)
    # the weights the kernels read as blocks stay in the GGUF file (listed in MANIFEST), the rest in fp32
    held = manifest_tensors(layout, lambda name: rotary_heads(arch, name, cfg))
    in_blocks = {tensor for tensor, _ in held.values()}
    weights = {}
    for name, (ttype, dims, raw) in layout.tensors.items():
        if (arch == "phi3" and name in _SETTING_TENSORS) or (arch == "llama" and name == "rope_freqs.weight"):
            continue  # in config.json's rope_parameters
        hf = hf_tensor_name(name, arch)
        if name in in_blocks:
            continue
        w = dequantize_tensor(ttype, dims, raw)
        if heads := rotary_heads(arch, name, cfg):
            w = unpermute_rotary(w, heads)
        if arch in _NORM_SHIFTED and name.endswith("norm.weight"):  # 1-D, so never among the blocks
            w = w - np.float32(1)
        weights[hf] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    manifest = {"source": str(Path(gguf).resolve()), "tensors": held}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    if arch not in ("llama", "qwen2") and "eos_token_id" in gen:  # stop at the end of a turn too (Gemma's <end_of_turn>)
        ends = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        ends = list(dict.fromkeys([gen["eos_token_id"]] + [int(i) for i in ends if i is not None]))
        gen["eos_token_id"] = ends if len(ends) > 1 else ends[0]
    (out / "generation_config.json").write_text(json.dumps(dict(gen, use_cache=True), indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    template = meta.get("tokenizer.chat_template")
    if template:
        (out / "chat_template.jinja").write_text(template)
