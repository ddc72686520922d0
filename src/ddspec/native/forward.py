"""The C calls of a forward beyond its matmuls: decoder layers run whole (:func:`layers_forward`, from
the structs of :func:`layer_struct` in a :func:`layer_array`), and a draft level's top-k
log-probabilities (:func:`top_logprobs`)."""

from __future__ import annotations

import ctypes

import torch

from ddspec.native.lib import CLayer, library
from ddspec.native.weights import NativeWeight, ptr

KV_DTYPES = (torch.float32, torch.float16)  # the caches dd_layers_forward reads and writes


def layer_struct(arch, in_norm, post_norm, qkv: NativeWeight, o: NativeWeight, gate_up: NativeWeight,
                 down: NativeWeight, extra: int = 0, q_norm=None, k_norm=None, attn_norm=None, mlp_norm=None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0) -> CLayer:
    """extra > 0: q/k/v read ``cat(extra row, in_norm(x))`` (an EAGLE-3 midlayer), the extra rows
    given to :func:`layers_forward`. q_norm / k_norm: [head_dim] norms of each q and k head;
    attn_norm / mlp_norm: [hidden] norms of the attention's and MLP's outputs (fp32, contiguous,
    kept alive by the caller, as every norm); rope: the layer's own (cos, sin) tables; window > 0:
    the layer attends through layers_forward's local mask. The activation, attention scale and
    soft-capping come from ``arch`` (LlamaArch; its defaults for other archs)."""
    cos, sin = rope if rope is not None else (None, None)
    return CLayer(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, down.in_features,
                  arch.rms_eps, ptr(in_norm), ptr(post_norm), qkv.struct, o.struct, gate_up.struct, down.struct,
                  extra, ptr(q_norm), ptr(k_norm), ptr(attn_norm), ptr(mlp_norm),
                  int(getattr(arch, "activation", "silu") == "gelu_tanh"), float(getattr(arch, "attn_scale", 0.0) or 0.0),
                  float(getattr(arch, "attn_softcap", 0.0) or 0.0), int(window), ptr(cos), ptr(sin))


def layer_array(layers: list[CLayer]):
    """Consecutive decoder layers as one C array (for :func:`layers_forward`); the weights they
    point to stay owned by their LlamaLayer objects."""
    return (CLayer * len(layers))(*layers)


def top_logprobs(a: torch.Tensor, b: torch.Tensor | None, scale: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of ``log_softmax(scale * cat([a, b], -1), -1)`` for each row, descending, and their
    columns (b's numbered after a's): a [n, Va], b [n, Vb] or None, fp32. One C pass per row instead of
    torch's cat, multiply, log_softmax and topk (about 0.1 ms for one row of 8,448 on our 2-core CPUs,
    most of it per-op dispatch). Equal values come earlier column first; the normaliser's sum runs in
    another order than torch's, so a value can differ from log_softmax's in its last bit.
    Returns (values [n, k] fp32, ids [n, k] int64)."""
    a = a.float().contiguous()
    b = None if b is None or b.shape[-1] == 0 else b.float().contiguous()
    n = a.shape[0]
    values = torch.empty(n, k, dtype=torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64)
    if library().dd_top_logprobs(a.data_ptr(), a.shape[-1], None if b is None else b.data_ptr(),
                                 0 if b is None else b.shape[-1], n, scale, k, values.data_ptr(), ids.data_ptr()):
        raise ValueError(f"dd_top_logprobs: bad sizes (rows {n}, columns {a.shape[-1]} + "
                         f"{0 if b is None else b.shape[-1]}, k {k}, scale {scale})")
    return values, ids


def layers_forward(array, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   mask: torch.Tensor | None, extra: torch.Tensor | None = None,
                   capture: dict[int, torch.Tensor] | None = None,
                   final_norm: tuple[torch.Tensor, float] | None = None,
                   local_mask: torch.Tensor | None = None) -> None:
    """Every layer of ``array`` in order, in place on x [n, H], in one C call. keys/values: the
    caches of those layers [count, Hkv, Tmax, D] (a contiguous slice of the model's cache), both fp32
    or both fp16 (each new key and value is then rounded to fp16 as it is written).
    extra: [n, E] fp32 contiguous, for layers built with ``extra=E``. capture: {i: out} with out
    [n, H] fp32 contiguous, filled with x as it enters layer i. final_norm: (weight [H] fp32
    contiguous, epsilon) of an RMSNorm applied to x after the last layer, in the same call.
    local_mask: [n, start + n] bool, the mask of layers built with a window (None: ``mask``)."""
    n, count = x.shape[0], len(array)
    if keys.dtype != values.dtype or keys.dtype not in KV_DTYPES:
        raise ValueError(f"dd_layers_forward takes fp32 or fp16 keys and values, got {keys.dtype} and {values.dtype}")
    slots = None
    if capture:
        slots = (ctypes.c_void_p * count)(*[capture[i].data_ptr() if i in capture else None for i in range(count)])
    rc = library().dd_layers_forward(
        array, count, x.data_ptr(), n, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.shape[2], start,
        None if mask is None else mask.data_ptr(), torch.get_num_threads(), None if extra is None else extra.data_ptr(),
        slots, None if final_norm is None else final_norm[0].data_ptr(), 0.0 if final_norm is None else final_norm[1],
        int(keys.dtype == torch.float16), None if local_mask is None else local_mask.data_ptr())
    if rc:
        raise ValueError(f"dd_layers_forward refused layer {rc // 8}'s sizes (n={n}, start={start}, "
                         f"cache {list(keys.shape)})")


def layers_forward_seqs(array, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        seqs: list[tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None, torch.Tensor | None]],
                        final_norm: tuple[torch.Tensor, float] | None = None,
                        capture: dict[int, torch.Tensor] | None = None) -> None:
    """:func:`layers_forward` over the rows of several sequences in one C call (continuous batching):
    x [n, H] holds their rows in order, positions [n] theirs; seqs: per sequence (keys, values, rows,
    start, mask, local_mask), keys/values that sequence's caches of these layers [count, Hkv, Tmax, D]
    (all fp32 or all fp16), ``rows`` how many rows of x are its, ``start`` its cached tokens, its masks
    [rows, start + rows] bool contiguous or None. Each row gets what its sequence gets alone.
    capture: as for :func:`layers_forward`, over all the rows."""
    count, nseq = len(array), len(seqs)
    dtype = seqs[0][0].dtype
    if any(k.dtype != dtype or v.dtype != dtype for k, v, *_ in seqs) or dtype not in KV_DTYPES:
        raise ValueError("dd_layers_forward_seqs takes caches all fp32 or all fp16")
    rows = [0]
    for s in seqs:
        rows.append(rows[-1] + s[2])
    if rows[-1] != x.shape[0]:
        raise ValueError(f"the sequences hold {rows[-1]} rows, x has {x.shape[0]}")

    def arr(ctype, values):
        return (ctype * len(values))(*values)

    p = ctypes.c_void_p
    rc = library().dd_layers_forward_seqs(
        array, count, x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), nseq,
        arr(ctypes.c_int64, rows), arr(p, [k.data_ptr() for k, *_ in seqs]), arr(p, [s[1].data_ptr() for s in seqs]),
        arr(ctypes.c_int64, [k.stride(0) for k, *_ in seqs]), arr(ctypes.c_int64, [k.shape[2] for k, *_ in seqs]),
        arr(ctypes.c_int64, [s[3] for s in seqs]), arr(p, [None if s[4] is None else s[4].data_ptr() for s in seqs]),
        arr(p, [None if s[5] is None else s[5].data_ptr() for s in seqs]), torch.get_num_threads(),
        arr(p, [capture[i].data_ptr() if i in capture else None for i in range(count)]) if capture else None,
        None if final_norm is None else final_norm[0].data_ptr(), 0.0 if final_norm is None else final_norm[1],
        int(dtype == torch.float16))
    if rc:
        raise ValueError(f"dd_layers_forward_seqs refused layer {rc // 8}'s sizes (rows {rows})")
