"""Weights as ddspec's CPU kernels read them, and the matmuls over them.

:class:`NativeWeight` describes one weight to the kernels: fp32 ``[out, in]`` (kept as fp16 / bf16
when those hold it exactly), or the GGUF blocks of a Q4_1 / Q8_0 / K-type weight (models/gguf_blocks.py),
multiplied with fp32 or 8-bit activations; it is packed into the kernels' layout (groups of 16
outputs) on first use. :func:`concat` stacks weights (q|k|v, gate|up) and :func:`gemm_sweep`
runs several matmuls in one C call.
"""

from __future__ import annotations

import ctypes

import torch

from ddspec.native.lib import CWeight, library

KINDS = {"f32": 0, "q4_1": 1, "q8_0": 2, "f16": 3, "bf16": 4, "q4_1a8": 5, "q8_0a8": 6,
         "q4_k": 7, "q6_k": 8, "q4_ka8": 9, "q6_ka8": 10, "q5_1": 11, "q5_1a8": 12, "stack": 13}
INT8_ACTIVATIONS = {"q4_1": "q4_1a8", "q8_0": "q8_0a8", "q4_k": "q4_ka8", "q6_k": "q6_ka8", "q5_1": "q5_1a8"}
K_KINDS = ("q4_k", "q6_k", "q4_ka8", "q6_ka8")  # super-blocks of 256 inputs (GGUF's K types)
HALVES = {"f16": torch.float16, "bf16": torch.bfloat16}


class NativeWeight:
    """One weight as the kernels read it, packed in groups of 16 outputs (see native/kernels/).

    Built from the row layout: kind ``f32``: ``w`` [out, in]; ``q4_1``: ``qs`` uint8
    [out, in/32, 16] (GGUF nibbles: byte j holds elements j and j + 16 of the block), ``d``/``m``
    float32 [out, in/32]; ``q8_0``: ``qs`` int8 [out, in/32, 32], ``d`` [out, in/32]; the K kinds
    ``q4_k`` (levels 0..15) and ``q6_k`` (any K type's levels, int8): ``qs`` int8 [out, in] (the
    levels in input order), ``d`` float32 [out, in/256, 2] (each super-block's d and dmin), ``m``
    int8 [out, in/32, 4] (per block of 32 inputs the scale of its first and last 16 inputs, its
    minimum, and the zero point z that makes the levels q + z unsigned (32 for Q6_K, 4 for Q3_K, else
    0); both scales equal for ``q4_k``): w = d * sc * q - dmin * m; ``q5_1``: ``qs`` int8
    [out, in] (levels 0..31), ``d``/``m`` float32 [out, in/32]: w = d * q + m. The kinds ending in
    ``a8`` hold the same blocks, multiplied with 8-bit activations (see :meth:`with_int8_activations`). The row layout is kept (``rows``) for stacking weights and
    taking subsets of outputs.
    """

    def __init__(self, kind: str, out: int, inp: int, *, w=None, qs=None, d=None, m=None, bias=None) -> None:
        self.kind, self.out_features, self.in_features = kind, out, inp
        self.rows = (w, qs, d, m)
        self.bias = None if bias is None else bias.float().contiguous()
        unit = 256 if kind in K_KINDS else 32
        if inp % unit and kind not in ("f32", *HALVES):
            raise ValueError(f"a {kind} weight needs an input width that is a multiple of {unit}, not {inp}")
        self._packed: tuple | None = None
        self._struct: CWeight | None = None

    # packed on first use: a weight that is only stacked into another (q, k, v) is never packed
    @property
    def packed(self) -> tuple:
        """w, qs, d, m in the group layout."""
        if self._packed is None:
            self._packed = _pack(self.kind, self.out_features, self.in_features, *self.rows)
        return self._packed

    def release_rows(self) -> None:
        """Keep only the packed layout (a loaded model's layer weights: their row layout, about a byte
        a weight for the block kinds, is needed only to stack, select or re-kind them); nothing to
        do for a weight not packed yet."""
        if self._packed is not None:
            self.rows = None

    @property
    def struct(self) -> CWeight:
        if self._struct is None:
            self._struct = CWeight(KINDS[self.kind], self.out_features, self.in_features,
                                   *(ptr(t) for t in self.packed), ptr(self.bias))
        return self._struct

    @classmethod
    def dense(cls, w_oi: torch.Tensor, bias: torch.Tensor | None = None) -> "NativeWeight":
        """A dense weight, stored as fp16 or bf16 when that holds every value exactly (a head or
        model shipped in half precision: half the bytes to read, the same maths), else fp32."""
        w = w_oi.detach().float()
        return cls(exact_kind(w), w.shape[0], w.shape[1], w=w, bias=bias)

    @classmethod
    def q8_0(cls, w_oi: torch.Tensor) -> "NativeWeight":
        """``w_oi`` [out, in] quantised to GGUF's Q8_0 (per block of 32 inputs: d = max|w| / 127 in
        fp16, q = round(w / d)): a quarter of fp32's bytes, an approximation of the weight (for a
        draft head, whose output only proposes tokens the target then verifies)."""
        blocks = _blocks_of(w_oi)
        d = (blocks.abs().amax(dim=-1) / 127).to(torch.float16).float()  # [out, nb]
        q = (blocks * _reciprocal(d).unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return cls("q8_0", *w_oi.shape, qs=q, d=d)

    @classmethod
    def q4_1(cls, w_oi: torch.Tensor) -> "NativeWeight":
        """``w_oi`` [out, in] quantised to GGUF's Q4_1 (per block of 32 inputs: m = min w and
        d = (max w - m) / 15, both fp16, q = round((w - m) / d) in 0..15): an eighth of fp32's
        bytes and a coarser approximation than :meth:`q8_0` (for a draft head)."""
        blocks = _blocks_of(w_oi)
        m = blocks.amin(dim=-1).to(torch.float16).float()  # [out, nb]
        d = ((blocks.amax(dim=-1) - m) / 15).to(torch.float16).float()
        q = ((blocks - m.unsqueeze(-1)) * _reciprocal(d).unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)  # GGUF's nibbles: byte j holds elements j and j + 16
        return cls("q4_1", *w_oi.shape, qs=qs.contiguous(), d=d, m=m)

    def with_int8_activations(self) -> "NativeWeight":
        """This block weight multiplying activations rounded to 8 bits per block of 32
        (kinds ``q4_1a8`` / ``q8_0a8`` / ``q4_ka8`` / ``q6_ka8`` / ``q5_1a8``; see native/kernels/); other
        kinds unchanged."""
        kind = INT8_ACTIVATIONS.get(self.kind)
        if kind is None:
            return self
        w, qs, d, m = self.rows
        return NativeWeight(kind, self.out_features, self.in_features, w=w, qs=qs, d=d, m=m, bias=self.bias)

    def with_bias(self, bias: torch.Tensor | None) -> "NativeWeight":
        if bias is None:
            return self
        w, qs, d, m = self.rows
        return NativeWeight(self.kind, self.out_features, self.in_features, w=w, qs=qs, d=d, m=m, bias=bias)

    def select(self, rows: torch.Tensor) -> "NativeWeight":
        """The weight of a subset of outputs (e.g. a draft vocabulary's rows of an lm_head)."""
        pick = [None if t is None else t[rows] for t in self.rows]
        return NativeWeight(self.kind, rows.numel(), self.in_features, w=pick[0], qs=pick[1], d=pick[2], m=pick[3])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (fp32) @ W^T -> [..., out]."""
        return self._gemm(x, None)

    def with_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ W^T, the first index of each row's maximum as numpy's argmax gives it): the argmax taken
        by each thread over its half of the outputs inside the matmul's parallel region, while they
        are still in its caches (an lm_head's greedy choice; 0.1 ms a token read afterwards)."""
        best = torch.empty(x.shape[:-1], dtype=torch.int64)
        return self._gemm(x, best), best

    def _gemm(self, x: torch.Tensor, best: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        rc = library().dd_gemm(ctypes.byref(self.struct), x2.data_ptr(), x2.shape[0], y.data_ptr(),
                               torch.get_num_threads(), None if best is None else best.data_ptr())
        if rc:
            raise ValueError(f"dd_gemm refused a {self.kind} weight of shape [{self.out_features}, {self.in_features}]")
        return y.view(*lead, self.out_features)


def gemm_sweep(weights: list[NativeWeight], x: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ W^T for each weight in turn, in one C call and one parallel region (dd_gemm_sweep):
    the matmuls alone, without a call per matmul; returns the last one's output [n, out]. The same
    weight listed k times times its arithmetic with the weight in the caches; k different weights
    stream them as a forward does. Every weight must take ``in`` inputs."""
    lib = library()
    if lib is None:
        raise ValueError("the native kernels are not built here")
    if not weights or any(w.in_features != x.shape[-1] for w in weights):
        raise ValueError(f"gemm_sweep: every weight must take {x.shape[-1]} inputs")
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = torch.empty(x2.shape[0], max(w.out_features for w in weights), dtype=torch.float32)
    structs = [w.struct for w in weights]
    ptrs = (ctypes.POINTER(CWeight) * len(structs))(*(ctypes.pointer(s) for s in structs))
    if lib.dd_gemm_sweep(ctypes.addressof(ptrs), len(structs), x2.data_ptr(), x2.shape[0], y.data_ptr(),
                         torch.get_num_threads()):
        raise ValueError("dd_gemm_sweep refused a quantised weight whose input width is not a multiple of 32")
    n, out = x2.shape[0], weights[-1].out_features
    return y.view(-1)[:n * out].view(n, out)  # each matmul writes its rows out wide


def _blocks_of(w_oi: torch.Tensor) -> torch.Tensor:
    """[out, in] -> fp32 [out, in / 32, 32]: GGUF's blocks of 32 inputs."""
    return w_oi.detach().float().reshape(w_oi.shape[0], w_oi.shape[1] // 32, 32)


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where a block's scale is 0 (an all-equal block: every level 0)."""
    return torch.where(d > 0, 1.0 / d, torch.zeros_like(d))


GROUP = 16


def _half(t: torch.Tensor, what: str) -> torch.Tensor:
    """A block format's fp32 scales or minimums as fp16, the kernels' layout: GGUF stores them in
    fp16 (and NativeWeight.q4_1 / q8_0 round them so), so this keeps every value."""
    half = t.to(torch.float16)
    if not torch.equal(half.float(), t.float()):
        raise ValueError(f"block {what} that fp16 cannot hold exactly: the kernels keep them in fp16, as GGUF does")
    return half


def _pack(kind: str, out: int, inp: int, w, qs, d, m) -> tuple:
    """Row layout -> the kernels' group layout (outputs padded to a multiple of 16 with zeros)."""
    groups = -(-out // GROUP)
    pad = groups * GROUP - out

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, ...] -> [G, ..., 16]
        t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))]) if pad else t
        t = t.reshape(groups, GROUP, *t.shape[1:])
        return t.movedim(1, -1).contiguous()

    if kind == "f32":
        return grouped(w.float()), None, None, None
    if kind in HALVES:
        return grouped(w.to(HALVES[kind])), None, None, None
    nb = inp // 32
    if kind in K_KINDS:
        return _pack_k(kind, out, inp, qs, d, m, grouped)
    if kind in ("q4_1", "q4_1a8"):
        q = grouped(torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, inp))  # [G, in, 16] values 0..15
        levels = _nibbles(q, kind, groups, nb)
        head = [grouped(_half(d, "scales").reshape(out, nb)), grouped(_half(m, "minimums").reshape(out, nb))]  # [G, nb, 16]
    elif kind in ("q5_1", "q5_1a8"):  # levels 0..31 (bytes, or 6 bits with 8-bit activations) under fp16 d and -m
        q = grouped(qs.reshape(out, inp).view(torch.uint8))
        levels = _bits6(q, kind, groups, nb) if kind.endswith("a8") else _bytes8(q.view(torch.int8), kind, groups, nb)
        head = [grouped(_half(d, "scales").reshape(out, nb)), grouped(_half(-m, "minimums").reshape(out, nb))]
    else:
        levels = _bytes8(grouped(qs.reshape(out, inp).view(torch.int8)), kind, groups, nb)
        head = [grouped(_half(d, "scales").reshape(out, nb))]
    # one contiguous block per (group, 32 inputs): fp16 scales (and minimums), then the levels
    blocks = torch.cat([h.contiguous().view(torch.uint8) for h in head] + [levels], dim=-1).contiguous()
    return None, blocks, None, None


def _nibbles(q: torch.Tensor, kind: str, groups: int, nb: int) -> torch.Tensor:
    """Levels 0..15 grouped [G, in, 16] -> the 4-bit kinds' level bytes [G, nb, 256]: byte 8k + j holds
    outputs j and j + 8 of input k, or (8-bit activations) per quad i of 4 inputs byte 4o + j holds
    q(o, 4i + j) | q(o + 8, 4i + j) << 4."""
    if kind.endswith("a8"):
        q = q.reshape(groups, nb, 8, 4, GROUP)  # [G, block, quad, j, output]
        return (q[..., :8] | (q[..., 8:] << 4)).permute(0, 1, 2, 4, 3).reshape(groups, nb, 256)
    return (q[..., :8] | (q[..., 8:] << 4)).reshape(groups, nb, 256)


def _bytes8(q: torch.Tensor, kind: str, groups: int, nb: int) -> torch.Tensor:
    """int8 levels grouped [G, in, 16] -> the 8-bit kinds' level bytes [G, nb, 512]: input by input,
    or (8-bit activations) per quad of 4 inputs outputs 0-7 then 8-15, byte 4o + j = q(o, 4i + j)."""
    q = q.view(torch.uint8)
    if kind.endswith("a8"):
        q = q.reshape(groups, nb, 8, 4, 2, 8)  # [G, block, quad, j, half, output]
        return q.permute(0, 1, 2, 4, 5, 3).reshape(groups, nb, 512)
    return q.reshape(groups, nb, 512)


def _bits6(u: torch.Tensor, kind: str, groups: int, nb: int) -> torch.Tensor:
    """Levels 0..63 grouped [G, in, 16] -> the 6-bit kinds' level bytes [G, nb, 384] (8-bit
    activations): their low nibbles as :func:`_nibbles` gives them, then per quad of 4 inputs 16
    bytes whose byte b holds in bits 2s, 2s + 1 the high 2 bits of the level b + 16 s of the quad's
    64 (outputs 0-7 then 8-15, byte 4o + j each: the order k_levels_a8 rebuilds)."""
    low = _nibbles(u & 0x0F, kind, groups, nb)
    t = (u >> 4).reshape(groups, nb, 8, 4, 2, 8).permute(0, 1, 2, 4, 5, 3).reshape(groups, nb, 8, 4, 16)
    packed = t[:, :, :, 0] | (t[:, :, :, 1] << 2) | (t[:, :, :, 2] << 4) | (t[:, :, :, 3] << 6)  # [G, nb, 8, 16]
    return torch.cat([low, packed.reshape(groups, nb, 128)], dim=-1)


def _pack_k(kind: str, out: int, inp: int, qs, d, m, grouped) -> tuple:
    """The K kinds (kernels/kquant.h): per (group, block of 32 inputs) the small integer scales and
    minimums then the levels, and the super-blocks' d / dmin as a side array [G, in/256, 32]."""
    groups, nb = -(-out // GROUP), inp // 32
    sc = m.view(torch.int8).reshape(out, nb, 4)
    levels = grouped(qs.reshape(out, inp).view(torch.int8))  # [G, in, 16]
    head = [grouped(sc[..., 0].contiguous()), grouped(sc[..., 2].contiguous())]  # scale, minimum: [G, nb, 16]
    if kind.startswith("q4_k"):
        if not torch.equal(sc[..., 0], sc[..., 1]):
            raise ValueError("a q4_k weight has one scale per block of 32 inputs")
        if levels.min() < 0 or levels.max() > 15:
            raise ValueError("a q4_k weight's levels are 0..15")
        body = _nibbles(levels.view(torch.uint8), kind, groups, nb)
    else:
        zero = grouped(sc[..., 3].contiguous())  # [G, nb, 16]
        head = [head[0], grouped(sc[..., 1].contiguous()), head[1], zero]
        if kind.endswith("a8"):  # u = q + z in 0..63 (a byte's wrap-around gives it exactly)
            u = (levels.view(torch.uint8).reshape(groups, nb, 32, GROUP) + zero.view(torch.uint8).unsqueeze(2))
            if u.max() > 63:
                raise ValueError("a q6_k weight's levels plus their zero points are 0..63")
            if not torch.isin(zero, torch.tensor([0, 1, 2, 4, 8, 16, 32], dtype=zero.dtype)).all():
                # the 8-bit-activation passes take z * (sum of the activations) back as a shift
                raise ValueError("a q6_k weight's zero points are 0 or a power of two (32 for Q6_K, 4 for Q3_K)")
            body = _bits6(u.reshape(groups, inp, GROUP), kind, groups, nb)
        else:
            body = _bytes8(levels, kind, groups, nb)
    blocks = torch.cat([h.view(torch.uint8) for h in head] + [body], dim=-1).contiguous()
    side = torch.cat([grouped(d[..., 0].float().contiguous()), grouped(d[..., 1].float().contiguous())], dim=-1)
    return None, blocks, side.contiguous(), None


def exact_kind(w: torch.Tensor) -> str:
    """``f16`` or ``bf16`` when that format holds every value of the fp32 tensor ``w`` exactly, else ``f32``."""
    for kind, dtype in HALVES.items():
        if torch.equal(w.to(dtype).float(), w):
            return kind
    return "f32"


def ptr(t: torch.Tensor | None) -> int | None:
    """The address of a tensor's data for a C struct (None: a null pointer)."""
    return None if t is None else t.data_ptr()


def stacked_kind(kinds) -> str | None:
    """The kind weights of these kinds are stacked into (q|k|v, gate|up), or None where they cannot be:
    one kind, or Q4_K beside another K type (its levels hold exactly in q6_k's)."""
    kinds = set(kinds)
    if len(kinds) == 1:
        return kinds.pop()
    for wide in ("q6_k", "q6_ka8"):
        if kinds == {wide.replace("q6", "q4"), wide}:
            return wide
    return None


def concat(weights: list[NativeWeight]) -> NativeWeight:
    """Weights of one input width stacked along the outputs (q|k|v, gate|up): one weight where their
    kinds can share one (:func:`stacked_kind`), else a :class:`StackedWeight` of the parts as they are."""
    kind, inp = stacked_kind(w.kind for w in weights), weights[0].in_features
    if any(w.in_features != inp for w in weights):
        raise ValueError("only weights of one input width can be stacked")
    if kind is None:
        return StackedWeight(weights)
    parts = [torch.cat([w.rows[i] for w in weights]) if weights[0].rows[i] is not None else None
             for i in range(4)]
    return NativeWeight(kind, sum(w.out_features for w in weights), inp, w=parts[0], qs=parts[1], d=parts[2], m=parts[3])


class StackedWeight(NativeWeight):
    """Weights of kinds that share no layout (a Q5_1 q and k beside a Q8_0 v) stacked along the
    outputs: one matmul to its callers (kernel kind ``stack``), each part multiplied by its own kind
    into its columns, so that every part keeps its blocks."""

    def __init__(self, parts: list[NativeWeight], bias: torch.Tensor | None = None) -> None:
        self.parts = [p for w in parts for p in (w.parts if isinstance(w, StackedWeight) else [w])]
        self.kind, self.in_features = "stack", self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)
        self.bias = None if bias is None else bias.float().contiguous()
        if bias is not None:  # each part adds its slice
            cuts = torch.cumsum(torch.tensor([0] + [p.out_features for p in self.parts]), 0).tolist()
            self.parts = [p.with_bias(self.bias[a:b]) for p, a, b in zip(self.parts, cuts, cuts[1:])]
        self.rows = (None, None, None, None)
        self._struct = None
        self._array = None

    @property
    def packed(self) -> tuple:
        return tuple(t for p in self.parts for t in p.packed)

    @property
    def struct(self) -> CWeight:
        if self._struct is None:
            self._array = (CWeight * len(self.parts))(*(p.struct for p in self.parts))
            self._struct = CWeight(KINDS["stack"], self.out_features, self.in_features, None, None, None, None, None,
                                   ctypes.addressof(self._array), len(self.parts))
        return self._struct

    def with_int8_activations(self) -> "NativeWeight":
        return StackedWeight([p.with_int8_activations() for p in self.parts])

    def with_bias(self, bias: torch.Tensor | None) -> "NativeWeight":
        return self if bias is None else StackedWeight(self.parts, bias)

    def select(self, rows: torch.Tensor) -> "NativeWeight":
        raise ValueError("a stack of weights of several kinds has no rows to select from")

    def release_rows(self) -> None:
        for p in self.parts:
            p.release_rows()
