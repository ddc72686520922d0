"""Converting a llama or qwen2 GGUF with a byte-level BPE vocabulary into an fp32 Hugging Face folder,
without transformers.

transformers can do this (``from_pretrained(gguf_file=...)``), and ddspec falls back to it for any
file this module does not cover, but on a new user's first run it was the long pole: importing
transformers' modelling code, gguf-py turning the 49k-token vocabulary and 49k merges into Python
objects three times, and the tokenizer conversion took ~21 s of a ~40 s first command. This
writes the same folder from one pass over the file (``GGUFLayout``):

- ``config.json``: the llama (or Qwen2) settings under transformers' names (as its GGUF loader
  maps them);
- ``model.safetensors``: each tensor dequantised with gguf-py's formulas (``dequantize_tensor``),
  for llama the q and k rows put back in Hugging Face's order (llama.cpp's converter interleaves the
  two halves of each rotary head; it leaves qwen2's as they are, see :func:`rotary_heads`), qwen2's
  q, k and v biases as they are, ``lm_head`` left out when the file has no ``output.weight`` (tied);
- ``tokenizer.json``: byte-level BPE from ``tokenizer.ggml.tokens`` and ``merges``, split by GPT-2's
  regex or by Qwen2's (``tokenizer.ggml.pre``), control tokens (type 3) added as special tokens and
  user-defined ones (type 4) as plain added tokens;
- ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``.

tests/test_gguf_convert.py checks the result against transformers' conversion of the default
model and of small llama and qwen2 files: every weight bit for bit, the config, and the tokenizer
on text and chat templates.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ddspec.models.gguf_blocks import (MANIFEST, NATIVE_SOURCES, GGUFError, GGUFLayout, dequantize, ggml_name, hf_name,
                                      manifest_tensors, native_blocks, rotary_order)


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
# (LlamaModel.permute: llama; Qwen2Model writes them as Hugging Face has them, and transformers'
# GGUF loader un-permutes only llama's, LlamaTensorProcessor)
_PERMUTED = {"llama": True, "qwen2": False}


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


def hf_tensor_name(name: str) -> str:
    """The name a Hugging Face llama (or Qwen2) checkpoint gives a GGUF tensor."""
    short = hf_name(name)
    if short is None:
        raise NotCovered(f"tensor {name!r} has no llama counterpart")
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

    if any(k.startswith(f"{arch}.rope.scaling") for k in meta) or get("expert_count"):
        raise NotCovered("rope scaling or experts")
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    special = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in
               (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id"))}
    if arch == "qwen2":
        return _qwen2_config(meta, tensors, vocab, get, special)
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
    return {k: v for k, v in cfg.items() if v is not None or k.endswith("_token_id")}


def _qwen2_config(meta: dict, tensors: dict, vocab: int, get, special: dict) -> dict:
    """Qwen2Config's fields in the order and form transformers saves them: its GGUF loader maps the
    ``qwen2.*`` keys as llama's but for the rotary dimension (Qwen2Config has no ``head_dim``: it is
    always hidden / heads, so a file saying otherwise is left to transformers), sets no sliding
    window (llama.cpp runs qwen2 with full attention in every layer), and writes ``unk_token_id``
    only when the file has one."""
    heads, hidden, layers = int(get("attention.head_count")), int(get("embedding_length")), int(get("block_count"))
    head_dim = get("rope.dimension_count", get("attention.key_length", hidden // heads))
    if int(head_dim) != hidden // heads or heads * (hidden // heads) != hidden:
        raise NotCovered(f"a qwen2 head size ({head_dim}) other than hidden / heads")
    cfg = {
        "_model_name_or_path": meta.get("general.name"),
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": special["bos_token_id"],
        "dtype": "float32",
        "eos_token_id": special["eos_token_id"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(get("feed_forward_length")),
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": int(get("context_length", 32768)),
        "max_window_layers": 28,
        "model_type": "qwen2",
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
    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window")
    return {k: v for k, v in cfg.items() if v is not None or k in keep}


def _tokenizer(meta: dict) -> tuple[dict, dict]:
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
        "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {}},
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [m.split(" ") for m in merges]},
    }
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(1e30)}
    for name, key in names.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None:
            tok_cfg[name] = tokens[int(i)]
    return tok, tok_cfg


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


def convert(gguf: Path, out: Path) -> None:
    """Write the fp32 HF folder of ``gguf`` into ``out`` (an empty folder); raises NotCovered for
    a file this converter does not handle (the caller then uses transformers')."""
    from safetensors.numpy import save_file

    layout = GGUFLayout(gguf, strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    meta = layout.metadata
    arch = meta.get("general.architecture")
    if arch not in _PERMUTED:
        raise NotCovered(f"architecture {arch!r}")
    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") not in _PLAIN_PRE | _QWEN2_PRE:
        raise NotCovered(f"tokenizer {meta.get('tokenizer.ggml.model')!r}/{meta.get('tokenizer.ggml.pre')!r}")
    _check_biases(arch, layout.tensors)
    if meta.get("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.add_eos_token"):
        raise NotCovered("a tokenizer that adds BOS/EOS")
    unknown = layout.unknown_types()
    if unknown:
        name, ttype = next(iter(unknown.items()))
        raise GGUFError(f"{gguf}: tensor {name!r} has GGML type {ttype}, which neither ddspec nor gguf-py knows "
                        f"({len(unknown)} such tensor{'s' if len(unknown) > 1 else ''}): a newer or damaged file; "
                        "re-quantize it to a common type (e.g. llama-quantize ... Q8_0)")
    cfg = _config(meta, layout.tensors, len(meta["tokenizer.ggml.tokens"]))
    tok, tok_cfg = _tokenizer(meta)
    # the weights the kernels read as blocks stay in the GGUF file (listed in MANIFEST), the rest in fp32
    held = manifest_tensors(layout, lambda name: rotary_heads(arch, name, cfg))
    in_blocks = {tensor for tensor, _ in held.values()}
    weights = {}
    for name, (ttype, dims, raw) in layout.tensors.items():
        hf = hf_tensor_name(name)
        if name in in_blocks:
            continue
        w = dequantize_tensor(ttype, dims, raw)
        if heads := rotary_heads(arch, name, cfg):
            w = unpermute_rotary(w, heads)
        weights[hf] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    manifest = {"source": str(Path(gguf).resolve()), "tensors": held}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(dict(gen, use_cache=True), indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    template = meta.get("tokenizer.chat_template")
    if template:
        (out / "chat_template.jinja").write_text(template)
