"""A GGUF checkpoint's quantised blocks, matched to the fp32 weights they were dequantised into.

The default model ships as a Q4_1 GGUF; ddspec's fp32 model *is* its dequantisation (gguf-py's
formulas, done once when the GGUF is converted). So a kernel that reads the 4.5-bit blocks
and rebuilds each weight with the same formula computes with exactly the fp32 model's weights
while reading a seventh of the bytes (native/kernels/).

Nothing is assumed about how the converter renamed or reordered things: each GGUF tensor is
dequantised here and compared, bit for bit, with the fp32 weight it should become (HF's GGUF
loader permutes the rows of q and k; the permutation is recovered by matching rows). A weight
that does not match exactly is simply not offered to the quantised kernel.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from pathlib import Path

import numpy as np
import torch

from ddspec.native import NativeWeight

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}


# the layer tensors of the other architectures, where they differ from llama's (llama.cpp's tensor_mapping.py):
# Qwen3 and Gemma 3 normalise q and k per head; Gemma 2 and 3 have four norms per layer (ffn_norm is the one
# before the MLP, post_attention_norm the one on the attention's output); Phi-3 fuses q, k and v into one
# weight and gate and up into another (gate's rows first), as its Hugging Face checkpoint does
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA2_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "qwen3": _LAYER_NAMES | _QK_NORMS,
    "gemma2": _LAYER_NAMES | _GEMMA2_NORMS,
    "gemma3": _LAYER_NAMES | _GEMMA2_NORMS | _QK_NORMS,
    "phi3": {k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")}
    | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}

_BIASED = {"attn_q", "attn_k", "attn_v"}  # the layer tensors that may have a bias (qwen2's q, k and v)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF weight name of a GGUF tensor name of architecture ``arch`` (llama's layout, or the
    names :data:`_ARCH_LAYER_NAMES` gives it), without the ``model.`` prefix (None for names outside
    the layout). Besides the weights, the biases of q, k and v (qwen2) map to their projections' ``.bias``."""
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in names and (m.group(3) == "weight" or m.group(2) in _BIASED):
        return f"layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return _TOP_NAMES.get(gguf_name)


def layer_parts(arch: str) -> tuple[str, ...]:
    """The weights of each layer of ``arch``'s layout, by GGUF name (``blk.N.<part>.weight``)."""
    return tuple(_ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES))


def gguf_arch(layout: "GGUFLayout") -> str:
    """The file's ``general.architecture`` (llama for a file that does not say)."""
    return layout.metadata.get("general.architecture") or "llama"


# GGML tensor type -> the native kind its blocks are read into, exactly: Q4_1 and Q8_0 as they are;
# Q4_0 (d * (q - 8)) as Q4_1 with minimum -8d, and Q5_0 (d * (q - 16), 5-bit q) as Q8_0 with levels
# q - 16: the same fp16 scale, the same values (products of an fp16 scale and a small integer are
# exact in fp32), so the kernels compute with exactly the fp32 weights the file dequantises to
# The K types keep their integers: Q4_K as q4_k (4-bit levels, a scale and a minimum per 32 inputs),
# Q5_K, Q6_K and Q3_K as q6_k (8-bit levels, a scale per 16 inputs, a minimum per 32), under each
# super-block's d and dmin: w = fl(d * sc) * q - fl(dmin * m), gguf-py's formula, both products exact
# Q5_1 (d * q + m, 5-bit q) as q5_1: its levels in bytes under the file's fp16 d and m
NATIVE_SOURCES = {3: "q4_1", 8: "q8_0", 2: "q4_1", 6: "q8_0", 12: "q4_k", 13: "q6_k", 14: "q6_k", 11: "q6_k", 7: "q5_1"}
K_SOURCES = (11, 12, 13, 14)
GGML_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


def ggml_name(ttype: int) -> str:
    return GGML_NAMES.get(ttype, f"type {ttype}")


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block ``b[..., bytes]``."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0]


def native_blocks(ttype: int, raw: np.ndarray, rows: int) -> tuple[str, np.ndarray, np.ndarray, np.ndarray | None]:
    """raw [rows, bytes] of a GGML type in NATIVE_SOURCES -> (native kind, qs, d, m) per block of 32
    inputs; m is None for q8_0 (follows ggml's block layouts, ggml-common.h); the K types in the
    K kinds' row layout (see native.NativeWeight and :func:`k_blocks`)."""
    kind = NATIVE_SOURCES[ttype]
    if ttype in K_SOURCES:
        return (kind, *k_blocks(ttype, raw, rows))
    if ttype == 3:  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles (low: elements 0-15, high: 16-31)
        b = raw.reshape(rows, -1, 20)
        return kind, b[..., 4:], _fp16(b, 0), _fp16(b, 2)
    if ttype == 8:  # Q8_0: fp16 d, 32 int8
        b = raw.reshape(rows, -1, 34)
        return kind, b[..., 2:].copy().view(np.int8), _fp16(b, 0), None
    if ttype == 2:  # Q4_0: fp16 d, nibbles as Q4_1's
        b = raw.reshape(rows, -1, 18)
        d = _fp16(b, 0)
        m = d * np.float16(-8)
        if not np.isfinite(m).all():
            raise ValueError("a Q4_0 scale too large for fp16 once times 8")
        return kind, b[..., 2:], d, m
    # Q5_0: fp16 d, 32 high bits (bit j: element j), 16 bytes of low nibbles as Q4_0's; Q5_1: fp16 d
    # and m, then the same
    at = 2 if ttype == 6 else 4
    b = raw.reshape(rows, -1, 20 + at)
    high = b[..., at:at + 4].copy().view(np.uint32)  # [rows, blocks, 1]
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, blocks, 32]
    low = np.concatenate([b[..., at + 4:] & 0x0F, b[..., at + 4:] >> 4], axis=-1)
    if ttype == 7:
        return kind, (low | (bits << 4)).astype(np.int8), _fp16(b, 0), _fp16(b, 2)
    return kind, ((low | (bits << 4)).astype(np.int16) - 16).astype(np.int8), _fp16(b, 0), None


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums per super-block -> (sc, m) [..., 8] uint8:
    bytes 0-3 hold sc 0-3 (low 6 bits) and the top 2 bits of sc 4-7, bytes 4-7 m 0-3 and the top bits
    of m 4-7, bytes 8-11 the low 4 bits of sc 4-7 (low nibble) and m 4-7 (high nibble)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def k_blocks(ttype: int, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A K-type tensor (Q3_K, Q4_K, Q5_K, Q6_K; ggml-common.h's block_qN_K) -> (levels int8 [rows, in]
    in input order, d float32 [rows, in/256, 2] (each super-block's d and dmin), m int8 [rows, in/32, 4]
    (per block of 32 inputs the scales of inputs 0-15 and 16-31, the minimum, and the zero point that
    makes the levels unsigned: 32 for Q6_K, 4 for Q3_K, 0 for the others)): the weight is
    fl(d * sc) * q - fl(dmin * m), as gguf-py dequantises it."""
    size = {11: 110, 12: 144, 13: 176, 14: 210}[ttype]
    b = raw.reshape(rows, -1, size)
    n = b.shape[1]  # super-blocks per row

    def halves(v):  # fp16 field at bytes [at, at + 2) -> float32 [rows, n]
        return v.copy().view(np.float16)[..., 0].astype(np.float32)

    if ttype in (12, 13):  # d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of 5th bits), 128 bytes of nibbles
        d, dmin = halves(b[..., 0:2]), halves(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])  # [rows, n, 8]: per 32 inputs
        qs = b[..., -128:].reshape(rows, n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(rows, n, 8, 32)  # 32 bytes give inputs 64i + l (low) and 64i + 32 + l (high)
        if ttype == 13:
            qh = b[..., 16:48].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1) << 4)
        levels = q.astype(np.int8)
        scales = np.repeat(sc, 2, axis=-1)  # [rows, n, 16]: per 16 inputs
    else:
        if ttype == 14:  # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d
            ql = b[..., 0:128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
            qh = b[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
            q = ((ql & 0x0F).reshape(rows, n, 8, 32) | ((qh & 3).reshape(rows, n, 8, 32) << 4)).astype(np.int8) - 32
            scales, d = b[..., 192:208].view(np.int8), halves(b[..., 208:210])
        else:  # Q3_K: 32 bytes of high-bit masks, 64 of 2-bit levels, 12 of 6-bit scales, d
            ql = b[..., 32:96].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
            qh = b[..., 0:32].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = (ql & 3).reshape(rows, n, 8, 32).astype(np.int8) - (((qh & 1) ^ 1) << 2).astype(np.int8)
            lo = b[..., 96:104].reshape(rows, n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            hi = b[..., 104:108].reshape(rows, n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
            scales = ((lo.reshape(rows, n, 16) & 0x0F) | ((hi.reshape(rows, n, 16) & 3) << 4)).astype(np.int8) - 32
            d = halves(b[..., 108:110])
        levels, dmin, mn = q.astype(np.int8), np.zeros_like(d), np.zeros((rows, n, 8), dtype=np.uint8)
    zero = np.full_like(mn, {14: 32, 11: 4}.get(ttype, 0))  # makes the levels q + z unsigned (6 bits)
    m = np.stack([scales[..., 0::2], scales[..., 1::2], mn, zero], axis=-1).astype(np.int8)  # [rows, n, 8, 4]
    return levels.reshape(rows, -1), np.stack([d, dmin], axis=-1), m.reshape(rows, n * 8, 4)


def dequantize(kind: str, qs: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """fp32 weights [rows, in] by gguf-py's formulas (Q4_1: d*q + m; Q8_0: q*d; the K kinds
    fl(d * sc) * q - fl(dmin * m)), unfused."""
    if kind in ("q4_k", "q6_k"):
        rows, nb = qs.shape[0], qs.shape[1] // 32
        sup = np.repeat(d.astype(np.float32), 8, axis=1)  # [rows, nb, 2]: each block's d, dmin
        scale = sup[..., :1] * m[..., :2].astype(np.float32)  # [rows, nb, 2]: per 16 inputs
        minimum = sup[..., 1] * m[..., 2].astype(np.uint8).astype(np.float32)  # [rows, nb]
        w = scale[..., None] * qs.reshape(rows, nb, 2, 16).astype(np.float32) - minimum[..., None, None]
        return w.reshape(rows, -1)
    d32 = d.astype(np.float32)[..., None]
    if kind == "q4_1":
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # elements 0-15, 16-31
        w = (d32 * q) + m.astype(np.float32)[..., None]
    elif kind == "q5_1":
        w = (d32 * qs.reshape(*d.shape, 32).astype(np.float32)) + m.astype(np.float32)[..., None]
    else:
        w = qs.astype(np.float32) * d32
    return w.reshape(w.shape[0], -1)


def _unsigned_zeros(a: np.ndarray) -> np.ndarray:
    """``a`` with -0.0 as +0.0, every other value bit for bit: a Q4_0 block with a negative scale
    dequantises its level 8 to -0.0 where the Q4_1 form it is read in gives +0.0 (a weight's sign of
    zero changes no product's value, and no sum but an all-zero one)."""
    return a + np.float32(0.0)


def _row_order(deq: np.ndarray, dense: np.ndarray) -> np.ndarray | None:
    """The permutation p with deq[p] == dense bit for bit (but for the sign of zeros), or None."""
    if deq.shape != dense.shape:
        return None
    deq, dense = _unsigned_zeros(deq), _unsigned_zeros(dense)
    if np.array_equal(deq.view(np.uint32), dense.view(np.uint32)):
        return np.arange(deq.shape[0])
    where = {row.tobytes(): i for i, row in enumerate(deq)}
    order = [where.get(row.tobytes()) for row in dense]
    return None if any(i is None for i in order) else np.asarray(order)


_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


class GGUFLayout:
    """A GGUF file's metadata and tensor table, read without gguf-py (which decodes every
    vocabulary string as a Python object, ~9 s for this model's).

    metadata: key -> value for every key; arrays of numbers are numpy arrays, arrays of strings
    are decoded only for the keys in ``strings`` (None for the others).
    tensors: name -> (GGML type, dims as GGUF writes them (fastest first), memory-mapped bytes).
    """

    def __init__(self, path: Path, strings: tuple[str, ...] = ()):
        import struct

        data = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(data)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            vals = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return vals if len(vals) > 1 else vals[0]

        def string() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def value(vtype: int, decode: bool):
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = take("IQ")
                if etype in _NUMPY:
                    out = np.frombuffer(data, dtype=_NUMPY[etype], count=count, offset=pos).copy()
                    pos += _SCALARS[etype] * count
                    return out
                if etype == 8 and not decode:  # strings (the vocabulary): step over them
                    length = struct.Struct("<Q").unpack_from
                    for _ in range(count):
                        pos += 8 + length(buf, pos)[0]
                    return None
                return [value(etype, decode) for _ in range(count)]
            out = struct.unpack_from("<" + _FORMATS[vtype], buf, pos)[0]
            pos += _SCALARS[vtype]
            return out

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        pos = 4
        version, n_tensors, n_kv = take("IQQ")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = string()
            self.metadata[key] = value(take("I"), key in strings)
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            ttype, offset = take("IQ")
            infos.append((name, dims, ttype, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        self.tensors: dict[str, tuple[int, list[int], np.ndarray]] = {}
        for name, dims, ttype, offset in infos:
            nbytes = tensor_bytes(ttype, dims)
            if nbytes is not None and start + offset + nbytes > len(data):
                raise GGUFError(f"{path}: tensor {name!r} ({ggml_name(ttype)}, {dims}) ends at byte "
                                f"{start + offset + nbytes:,} but the file has {len(data):,}: the file is truncated "
                                "or its header is corrupt; download it again")
            raw = data[start + offset:start + offset + nbytes] if nbytes is not None else None
            self.tensors[name] = (ttype, dims, raw)

    def unknown_types(self) -> dict[str, int]:
        """Tensor name -> GGML type for the tensors whose type gguf-py does not know (no bytes read)."""
        return {name: ttype for name, (ttype, _, raw) in self.tensors.items() if raw is None}


class GGUFError(ValueError):
    """A GGUF file that cannot be read as its header says (truncated, corrupt, an unknown block type)."""


_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@functools.cache
def _block_sizes() -> dict[int, tuple[int, int]]:
    """GGML tensor type -> (elements per block, bytes per block), for every type gguf-py knows."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (int(per), int(size)) for t, (per, size) in GGML_QUANT_SIZES.items()}


def tensor_bytes(ttype: int, dims: list[int]) -> int | None:
    """Bytes of a tensor of GGML type ``ttype`` (None for a type gguf-py does not know)."""
    sizes = _block_sizes()
    if ttype not in sizes:
        return None
    per, size = sizes[ttype]
    if dims[0] % per:
        return None
    return int(np.prod(dims, dtype=np.int64)) // per * size


def quantised_tensors(path: Path, layout: GGUFLayout | None = None) -> dict[str, tuple[int, np.ndarray]]:
    """GGUF tensor name -> (GGML type, raw block bytes [rows, bytes per row], memory-mapped) for
    every tensor whose blocks the native kernels read (NATIVE_SOURCES)."""
    out = {}
    for name, (ttype, dims, raw) in (layout or GGUFLayout(path)).tensors.items():
        if ttype not in NATIVE_SOURCES or raw is None:
            continue
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        out[name] = (ttype, raw.reshape(rows, -1))
    return out


def native_weights(gguf: Path, dense: dict[str, torch.Tensor], orders: Path | None = None) -> dict[str, NativeWeight]:
    """HF name -> quantised NativeWeight for every tensor of ``gguf`` in a block type the kernels
    read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K) whose dequantisation equals ``dense[name]`` exactly (after a row
    permutation, if any). Weights in other block types (Q2_K, the IQ types, ...) are named in one
    notice: they run on their fp32 dequantisation.

    ``orders``: a file remembering each tensor's row permutation from an earlier load. A
    remembered permutation is checked on a sample of rows (bit for bit, as above) instead of
    dequantising and matching every row again (about 2 s of each start for the default model)."""
    known = _read_orders(orders)
    found: dict[str, np.ndarray] = {}
    out: dict[str, NativeWeight] = {}
    skipped = []
    layout = GGUFLayout(gguf)
    _notice_unread_types(layout, dense)
    arch = gguf_arch(layout)
    for gguf_name, (ttype, raw) in quantised_tensors(gguf, layout).items():
        name = hf_name(gguf_name, arch)
        if name is None or name not in dense:
            continue
        target = dense[name].detach().float().contiguous().numpy()
        rows = target.shape[0]
        if raw.shape[0] != rows:
            skipped.append(name)
            continue
        kind, qs, d, m = native_blocks(ttype, raw, rows)
        order = known.get(name)
        if order is None or order.shape != (rows,) or not _rows_match(kind, qs, d, m, order, target):
            order = _row_order(dequantize(kind, qs, d, m), target)
        if order is None:
            skipped.append(name)
            continue
        found[name] = order
        out[name] = block_weight(kind, target.shape[1], qs, d, m, order)
    if skipped:
        print(f"ddspec: {len(skipped)} GGUF tensors do not match their fp32 weights exactly (e.g. {skipped[0]}); "
              "those use fp32 kernels", file=sys.stderr)
    if orders is not None and (found.keys() != known.keys()
                               or any(not np.array_equal(found[k], known[k]) for k in found)):
        _write_orders(orders, found)
    return out


DENSE_TYPES = (0, 1, 30)  # F32, F16, BF16: the fp32 weights themselves (F16 / BF16 kept as such, see native.exact_kind)


def _notice_unread_types(layout: GGUFLayout, dense: dict[str, torch.Tensor]) -> None:
    """One line on stderr naming the model's weights in block types the kernels do not read yet."""
    unread: dict[str, int] = {}
    arch = gguf_arch(layout)
    for gguf_name, (ttype, _, _) in layout.tensors.items():
        if ttype in NATIVE_SOURCES or ttype in DENSE_TYPES or hf_name(gguf_name, arch) not in dense:
            continue
        unread[ggml_name(ttype)] = unread.get(ggml_name(ttype), 0) + 1
    if unread:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(unread.items(), key=lambda x: -x[1]))
        count = sum(unread.values())
        print(f"ddspec: {count} weight tensor{'s' if count > 1 else ''} ({kinds}) have no native kernel yet and run "
              "dequantised to fp32 (slower); the kernels read Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, F16 and BF16", file=sys.stderr)


SAMPLE_ROWS = 16


def file_key(path: Path) -> str:
    """Names a file by its path, size and modification time (cache entries derived from it)."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


def orders_path(gguf: Path) -> Path:
    """Where the row permutations of this GGUF file's tensors are remembered (user cache)."""
    from ddspec.machine import cache_root

    return cache_root() / "gguf-rows" / f"{gguf.stem}-{file_key(gguf)}.npz"


def _rows_match(kind: str, qs, d, m, order: np.ndarray, target: np.ndarray) -> bool:
    """Whether rows ``order[i]`` of the GGUF tensor dequantise to ``target[i]`` exactly, checked
    on SAMPLE_ROWS rows spread over the tensor (first and last included)."""
    rows = target.shape[0]
    idx = np.unique(np.linspace(0, rows - 1, min(rows, SAMPLE_ROWS)).astype(np.int64))
    if order.min() < 0 or order.max() >= rows:
        return False
    src = order[idx]
    deq = dequantize(kind, qs[src], d[src], None if m is None else m[src])
    return np.array_equal(_unsigned_zeros(deq).view(np.uint32), _unsigned_zeros(target[idx]).view(np.uint32))


def _read_orders(path: Path | None) -> dict[str, np.ndarray]:
    if path is None or not path.is_file():
        return {}
    try:
        with np.load(path) as f:
            return {k: f[k].astype(np.int64) for k in f.files}
    except (OSError, ValueError, KeyError):  # unreadable: match every row again and rewrite it
        return {}


def _write_orders(path: Path, orders: dict[str, np.ndarray]) -> None:
    """Atomically; a cache that cannot be written only costs the matching again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **{k: v.astype(np.int32) for k, v in orders.items()})
        tmp.replace(path)
    except OSError:
        pass


# The blocks of a GGUF file read straight into the kernels' weights, without an fp32 copy on disk:
# the converter (gguf_convert.convert) leaves every tensor the kernels read out of model.safetensors
# and lists it here instead, with the rows to put back in Hugging Face's order.
MANIFEST = "gguf_blocks.json"


def read_manifest(model_dir: Path) -> dict | None:
    """The converted folder's list of weights held as GGUF blocks ({"source": the GGUF's path,
    "tensors": {HF name: [GGUF name, rotary heads to un-permute or 0]}}), or None for a folder that
    holds every weight in fp32."""
    import json

    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("tensors"), dict):
            raise ValueError("no tensors")
        return manifest
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path} cannot be read ({e}): delete the folder {model_dir} and load the .gguf again") from None


def rotary_order(rows: int, heads: int) -> np.ndarray:
    """The GGUF rows that Hugging Face's rows 0 .. rows - 1 are, where llama.cpp interleaved the two
    halves of each rotary head (gguf_convert.unpermute_rotary applies it)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def manifest_blocks(gguf: Path, manifest: dict, notice: bool = True) -> dict[str, NativeWeight]:
    """HF name (without ``model.``) -> NativeWeight of every weight the manifest lists, read from the
    file's blocks (memory-mapped; the rows in Hugging Face's order); with ``notice``, the one-line
    notice of the file's weights in types the kernels do not read."""
    layout = GGUFLayout(Path(gguf))
    out: dict[str, NativeWeight] = {}
    for name, (tensor, heads) in manifest["tensors"].items():
        if tensor not in layout.tensors:
            raise GGUFError(f"{gguf}: tensor {tensor!r} is missing: the file changed since it was converted; "
                            "delete the converted folder and load it again")
        ttype, dims, raw = layout.tensors[tensor]
        rows = int(np.prod(dims[1:], dtype=np.int64))
        kind, qs, d, m = native_blocks(ttype, raw.reshape(rows, -1), rows)
        out[name.removeprefix("model.")] = block_weight(kind, dims[0], qs, d, m, rotary_order(rows, heads) if heads else None)
    if notice:
        arch = gguf_arch(layout)
        _notice_unread_types(layout, {hf_name(t, arch) for t in layout.tensors if hf_name(t, arch)})
    return out


def block_weight(kind: str, inp: int, qs: np.ndarray, d: np.ndarray, m: np.ndarray | None,
                 order: np.ndarray | None = None) -> NativeWeight:
    """The NativeWeight of :func:`native_blocks`' output (rows ``order`` of it, if given): scales in
    fp32 (the file's fp16 values), the K kinds' minimums and scales kept as the integers they are."""
    def pick(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a if order is None else a[order]))

    integers = kind in ("q4_k", "q6_k")
    return NativeWeight(kind, qs.shape[0], inp, qs=pick(qs), d=pick(d.astype(np.float32)),
                        m=pick(None if m is None else m if integers else m.astype(np.float32)))


def dense_of(weight: NativeWeight) -> torch.Tensor:
    """A block weight's fp32 values [out, in] (gguf-py's dequantisation: the weights the kernels compute with)."""
    _, qs, d, m = weight.rows
    as_np = lambda t: None if t is None else t.numpy()  # noqa: E731
    return torch.from_numpy(dequantize(weight.kind.removesuffix("a8"), as_np(qs), as_np(d), as_np(m)))


class BlockTensors(dict):
    """A model's tensors by name, where the weights held as GGUF blocks are dequantised to fp32 only
    when something asks for them (a draft head's training, a torch kernel), then kept. ``lazy``:
    name -> (shape, a function giving the fp32 tensor; it reads the blocks from the file again, so
    that nothing holds them meanwhile). ``held(name)``: whether the fp32 tensor exists already."""

    def __init__(self, dense: dict[str, torch.Tensor], lazy: dict[str, tuple[tuple[int, int], object]] | None = None):
        super().__init__(dense)
        self.lazy = {k: v for k, v in (lazy or {}).items() if k not in dense}

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in self.lazy:
            raise KeyError(name)
        self[name] = t = self.lazy[name][1]()
        return t

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self.lazy

    def get(self, name, default=None):
        return self[name] if name in self else default

    def held(self, name: str) -> bool:
        return dict.__contains__(self, name)

    def shape(self, name: str) -> tuple[int, int]:
        return tuple(dict.__getitem__(self, name).shape) if self.held(name) else self.lazy[name][0]


def lazy_dense(gguf: Path, manifest: dict, blocks: dict[str, NativeWeight]) -> dict[str, tuple[tuple[int, int], object]]:
    """BlockTensors' ``lazy`` for the manifest's weights (``blocks``, by name without ``model.``):
    each dequantised from the file when asked."""
    def reader(full: str, short: str):
        return lambda: dense_of(manifest_blocks(gguf, {"tensors": {full: manifest["tensors"][full]}}, notice=False)[short])

    lazy = {}
    for full in manifest["tensors"]:
        short = full.removeprefix("model.")
        lazy[short] = ((blocks[short].out_features, blocks[short].in_features), reader(full, short))
    return lazy


def manifest_tensors(layout: GGUFLayout, heads_of) -> dict[str, list]:
    """The entries of a converted folder's MANIFEST: every 2-D weight of the file in a block type the
    kernels read whole (its rows a multiple of the type's block), by HF name (with ``model.``):
    [GGUF name, ``heads_of(GGUF name)``: the rotary heads whose rows llama.cpp interleaved, or 0]."""
    out = {}
    arch = gguf_arch(layout)
    for name, (ttype, dims, raw) in layout.tensors.items():
        short = hf_name(name, arch)
        if ttype not in NATIVE_SOURCES or raw is None or len(dims) != 2 or short is None or not short.endswith(".weight"):
            continue
        if dims[0] % (256 if ttype in K_SOURCES else 32):
            continue
        out[short if short == "lm_head.weight" else f"model.{short}"] = [name, int(heads_of(name))]
    return out
