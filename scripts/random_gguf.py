"""Random-weight GGUF files with the exact shapes of five small model families.

Decoding speed depends on an architecture's shapes (hidden size, layers, heads, head
size, FFN width, vocabulary, tied or untied output, fused or split projections, norms,
sliding windows), not on the values of its weights. This script writes a model that
llama.cpp loads and runs, with the metadata keys and tensor names that llama.cpp's
``convert_hf_to_gguf.py`` writes for that architecture, and Gaussian weights
(std 0.02 for matrices, norms 1 + small noise, which is also the stored form of a Gemma
norm), so that ddspec and llama.cpp can be timed on an architecture whose real weights
are not at hand. The text such a model writes is noise; only its speed means anything.

The vocabulary is the byte-level BPE one of another GGUF (``tokenizer.ggml.model``
``gpt2``; by default the default model's, or ``--vocab-from`` a Qwen2 file; its pre-tokenizer and
chat template), padded with unused tokens
(``<|pad_N|>``, type UNUSED) up to the family's vocabulary size, or cut down to it: then
the ordinary tokens are kept from the start of the list, the special tokens
(``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...) move to the last ids, and
every merge whose parts or result fell out is dropped, so the vocabulary stays
consistent and the chat template still works.

The tensors are written one at a time (the largest, an embedding, is built in row
chunks), so memory stays near the size of the largest tensor. Quantize the F16 file
with llama.cpp's own tool for the usual formats, e.g.

    python scripts/random_gguf.py qwen3 /tmp/qwen3-F16.gguf
    llama-quantize --allow-requantize /tmp/qwen3-F16.gguf qwen3-Q4_K_M.gguf Q4_K_M

Run: python scripts/random_gguf.py FAMILY OUT.gguf [--type f16|f32] [--seed N]
     [--vocab-from QWEN2.gguf] [--ctx N]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gguf
from gguf import MODEL_TENSOR as T
from gguf import TENSOR_NAMES, GGUFReader, GGUFWriter, LlamaFileType, TokenType

MATRIX_STD = 0.02
NORM_STD = 0.02
CHUNK_ELEMENTS = 1 << 25  # rows generated per step of a large matrix: ~32M values


@dataclass(frozen=True)
class Shape:
    arch: str               # llama.cpp architecture name (general.architecture)
    source: str             # the public model whose config.json these numbers come from
    label: str              # general.name is "random <label>"
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx: int              # context_length written to the file
    rope_theta: float | None  # None: key not written (llama.cpp's default, 10000, applies)
    rms_eps: float
    tied: bool              # no output.weight: the output reuses token_embd
    qk_norm: bool = False   # attn_q_norm / attn_k_norm [head_dim]
    post_norms: bool = False  # post_attention_norm / post_ffw_norm [n_embd]
    fused: bool = False     # attn_qkv and a 2*n_ff ffn_up (gate and up stacked), no ffn_gate
    shifted_norms: bool = False  # norm weights stored as 1 + w (Gemma); noted, values alike
    extra: dict = field(default_factory=dict)  # family-specific keys, see write_metadata


# Values from each model's public config.json; the keys each family gets follow
# llama.cpp's conversion/<family>.py.
SHAPES: dict[str, Shape] = {
    "qwen3": Shape(
        arch="qwen3", source="Qwen/Qwen3-0.6B", label="Qwen3 0.6B",
        n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072,
        n_vocab=151936, n_ctx=40960, rope_theta=1e6, rms_eps=1e-6, tied=True,
        qk_norm=True,
    ),
    "gemma3": Shape(
        arch="gemma3", source="google/gemma-3-270m", label="Gemma 3 270M",
        n_embd=640, n_layer=18, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048,
        n_vocab=262144, n_ctx=32768, rope_theta=1e6, rms_eps=1e-6, tied=True,
        qk_norm=True, post_norms=True, shifted_norms=True,
        # every 6th layer (5, 11, 17) is global: llama.cpp's gemma3 default pattern, not
        # a key; local layers use rope base 10000 (rope_local_base_freq)
        extra={"sliding_window": 512, "rope_freq_base_swa": 10000.0},
    ),
    "gemma2": Shape(
        arch="gemma2", source="google/gemma-2-2b", label="Gemma 2 2B",
        n_embd=2304, n_layer=26, n_head=8, n_head_kv=4, head_dim=256, n_ff=9216,
        n_vocab=256000, n_ctx=8192, rope_theta=None, rms_eps=1e-6, tied=True,
        post_norms=True, shifted_norms=True,
        # query_pre_attn_scalar 256 has no key: llama.cpp scales queries by
        # 1/sqrt(head_dim) = 1/sqrt(256) for the 2B; even layers slide, odd are global
        extra={"sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    ),
    "phi3": Shape(
        arch="phi3", source="microsoft/Phi-3-mini-4k-instruct", label="Phi 3 mini 4k",
        n_embd=3072, n_layer=32, n_head=32, n_head_kv=32, head_dim=96, n_ff=8192,
        n_vocab=32064, n_ctx=4096, rope_theta=10000.0, rms_eps=1e-5, tied=False,
        fused=True,
        # original context == context and no long/short factors: no rope_factors
        # tensors; llama.cpp reads the sliding window and turns it off for phi3
        extra={"rope_orig_ctx": 4096, "rope_dims": 96, "sliding_window": 2047},
    ),
    "llama": Shape(
        arch="llama", source="meta-llama/Llama-3.2-1B", label="Llama 3.2 1B",
        n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192,
        n_vocab=128256, n_ctx=131072, rope_theta=500000.0, rms_eps=1e-5, tied=True,
        # llama3 rope scaling lives in the rope_freqs tensor, not in keys
        extra={"rope_dims": 64, "vocab_size": True,
               "llama3_rope": {"factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_context": 8192}},
    ),
}


# ----------------------------------------------------------------------------- vocabulary

@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    chat_template: str | None
    pre: str                # the pre-tokenizer's name, as the source file has it
    bos: int
    eos: int
    pad: int
    n_source: int           # tokens of the source vocabulary (its own padding excluded)
    n_merges_dropped: int


def build_vocab(path: str, n_vocab: int) -> Vocab:
    reader = GGUFReader(path)

    def field_value(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field_value("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"{path}: expected a byte-level BPE ('gpt2') vocabulary")
    src_tokens = field_value("tokenizer.ggml.tokens")
    src_types = field_value("tokenizer.ggml.token_type")
    src_merges = field_value("tokenizer.ggml.merges")
    template = field_value("tokenizer.chat_template")
    pre = field_value("tokenizer.ggml.pre") or "gpt2"

    real = [(t, ty) for t, ty in zip(src_tokens, src_types) if ty != TokenType.UNUSED]
    if len(real) <= n_vocab:
        tokens = [t for t, _ in real]
        types = [ty for _, ty in real]
    else:
        special = [(t, ty) for t, ty in real if ty in (TokenType.CONTROL, TokenType.USER_DEFINED)]
        normal = [(t, ty) for t, ty in real if ty not in (TokenType.CONTROL, TokenType.USER_DEFINED)]
        kept = normal[: n_vocab - len(special)] + special
        tokens = [t for t, _ in kept]
        types = [ty for _, ty in kept]
    for i in range(len(tokens), n_vocab):
        tokens.append(f"<|pad_{i}|>")
        types.append(int(TokenType.UNUSED))

    index = {t: i for i, t in enumerate(tokens)}
    assert len(index) == n_vocab, "duplicate token text"
    merges = []
    for m in src_merges:
        a, sep, b = m.partition(" ")
        if sep and a in index and b in index and (a + b) in index:
            merges.append(m)

    def tid(text: str, fallback: int = 0) -> int:
        return index.get(text, fallback)

    eot = tid("<|endoftext|>")
    return Vocab(tokens=tokens, types=types, merges=merges, chat_template=template, pre=pre,
                 bos=eot, eos=tid("<|im_end|>", eot), pad=eot, n_source=len(real),
                 n_merges_dropped=len(src_merges) - len(merges))


# ----------------------------------------------------------------------------- metadata

def write_metadata(w: GGUFWriter, name: str, s: Shape, vocab: Vocab, ftype: int, n_ctx: int) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    # not the source's own name: llama.cpp gives Phi-3 token attributes to any model whose
    # general.name contains "phi-3" or "phi3", and that needs <s>, </s> and <unk> tokens
    w.add_name(f"random {s.label}")
    w.add_description(
        f"Random Gaussian weights in the shapes of {s.source} ({name}), for speed "
        "measurements only: the model writes noise.")
    w.add_file_type(ftype)

    w.add_context_length(n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.rope_theta is not None:
        w.add_rope_freq_base(s.rope_theta)
    if s.arch != "phi3":  # phi3's converter writes the rope dimension count only
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)

    x = s.extra
    if "rope_dims" in x:
        w.add_rope_dimension_count(x["rope_dims"])
    if "rope_orig_ctx" in x:
        w.add_rope_scaling_orig_ctx_len(x["rope_orig_ctx"])
    if "sliding_window" in x:
        w.add_sliding_window(x["sliding_window"])
    if "rope_freq_base_swa" in x:
        w.add_rope_freq_base_swa(x["rope_freq_base_swa"])
    if "attn_logit_softcapping" in x:
        w.add_attn_logit_softcapping(x["attn_logit_softcapping"])
    if "final_logit_softcapping" in x:
        w.add_final_logit_softcapping(x["final_logit_softcapping"])
    if x.get("vocab_size"):
        w.add_vocab_size(s.n_vocab)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(False)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


# ----------------------------------------------------------------------------- tensors

def tensor_plan(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape [rows=out, cols=in], kind) in file order."""
    def n(t, bid=None):
        return TENSOR_NAMES[t].format(bid=bid) + ".weight"

    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    plan = [(n(T.TOKEN_EMBD), (s.n_vocab, s.n_embd), "matrix")]
    if "llama3_rope" in s.extra:
        plan.append((n(T.ROPE_FREQS), (s.head_dim // 2,), "rope_freqs"))
    for i in range(s.n_layer):
        plan.append((n(T.ATTN_NORM, i), (s.n_embd,), "norm"))
        if s.fused:
            plan.append((n(T.ATTN_QKV, i), (q + 2 * kv, s.n_embd), "matrix"))
        else:
            plan += [(n(T.ATTN_Q, i), (q, s.n_embd), "matrix"),
                     (n(T.ATTN_K, i), (kv, s.n_embd), "matrix"),
                     (n(T.ATTN_V, i), (kv, s.n_embd), "matrix")]
        if s.qk_norm:
            plan += [(n(T.ATTN_Q_NORM, i), (s.head_dim,), "norm"),
                     (n(T.ATTN_K_NORM, i), (s.head_dim,), "norm")]
        plan.append((n(T.ATTN_OUT, i), (s.n_embd, q), "matrix"))
        if s.post_norms:
            plan.append((n(T.ATTN_POST_NORM, i), (s.n_embd,), "norm"))
        plan.append((n(T.FFN_NORM, i), (s.n_embd,), "norm"))
        if s.fused:
            plan.append((n(T.FFN_UP, i), (2 * s.n_ff, s.n_embd), "matrix"))
        else:
            plan += [(n(T.FFN_GATE, i), (s.n_ff, s.n_embd), "matrix"),
                     (n(T.FFN_UP, i), (s.n_ff, s.n_embd), "matrix")]
        plan.append((n(T.FFN_DOWN, i), (s.n_embd, s.n_ff), "matrix"))
        if s.post_norms:
            plan.append((n(T.FFN_POST_NORM, i), (s.n_embd,), "norm"))
    plan.append((n(T.OUTPUT_NORM), (s.n_embd,), "norm"))
    if not s.tied:
        plan.append((n(T.OUTPUT), (s.n_vocab, s.n_embd), "matrix"))
    return plan


def llama3_rope_factors(s: Shape) -> np.ndarray:
    """The per-frequency divisors of llama3 rope scaling (LlamaModel.generate_extra_tensors)."""
    p = s.extra["llama3_rope"]
    dim, base = s.head_dim, s.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = p["original_context"] / p["low_freq_factor"]
    high_wavelen = p["original_context"] / p["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_context"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / p["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def make_tensor(s: Shape, shape, kind: str, dtype, rng: np.random.Generator) -> np.ndarray:
    if kind == "rope_freqs":
        return llama3_rope_factors(s)
    if kind == "norm":
        # stored value is the multiplier itself for every family (Gemma's 1 + w included)
        return (1.0 + NORM_STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    out = np.empty(shape, dtype=dtype)
    rows = max(1, CHUNK_ELEMENTS // shape[1])
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        chunk = rng.standard_normal((r1 - r0, shape[1]), dtype=np.float32)
        chunk *= MATRIX_STD
        out[r0:r1] = chunk
    return out


def write_model(family: str, out: Path, wtype: str, seed: int, vocab_from: str, n_ctx: int | None) -> None:
    s = SHAPES[family]
    vocab = build_vocab(vocab_from, s.n_vocab)
    wdtype = np.float16 if wtype == "f16" else np.float32
    ftype = LlamaFileType.MOSTLY_F16 if wtype == "f16" else LlamaFileType.ALL_F32

    w = GGUFWriter(out, s.arch)
    write_metadata(w, family, s, vocab, int(ftype), n_ctx or s.n_ctx)
    plan = tensor_plan(s)
    n_params = 0
    for name, shape, kind in plan:
        dt = wdtype if kind == "matrix" else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        w.add_tensor_info(name, shape, np.dtype(dt), nbytes)
        n_params += int(np.prod(shape))

    print(f"{family}: {s.arch} in the shapes of {s.source}, {n_params / 1e6:.1f}M parameters, "
          f"{len(plan)} tensors, vocab {s.n_vocab} ({vocab.n_source} from {vocab_from}, "
          f"{len(vocab.merges)} merges, {vocab.n_merges_dropped} dropped; bos/eos/pad "
          f"{vocab.bos}/{vocab.eos}/{vocab.pad}) -> {out}", file=sys.stderr)
    w.write_header_to_file(out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, (name, shape, kind) in enumerate(plan):
        rng = np.random.default_rng([seed, k])
        w.write_tensor_data(make_tensor(s, shape, kind, wdtype, rng))
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=("f16", "f32"), default="f16",
                    help="type of the 2-D weights (norms and rope factors are always F32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-from", default=None,
                    help="a GGUF with a byte-level BPE vocabulary (default: the default model's, SmolLM2's 49,152 "
                         "tokens; a Qwen2 GGUF gives Qwen's 151,643)")
    ap.add_argument("--ctx", type=int, default=None,
                    help="context_length to write instead of the model's own")
    a = ap.parse_args()
    if a.vocab_from is None:
        from ddspec.models.loading import default_gguf_path

        a.vocab_from = str(default_gguf_path())
    write_model(a.family, a.out, a.type, a.seed, a.vocab_from, a.ctx)


if __name__ == "__main__":
    main()
