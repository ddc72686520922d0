"""A compact Llama-family target (Llama, Mistral, Qwen2, SmolLM) written for speed.

Why this exists: through HF transformers one SmolLM2 token costs ~3x the memory floor on our
CPU, mostly per-layer Python and op overhead (DESIGN.md §6). Here each decoder layer is four
matmuls on fused weights (qkv, o, gate+up, down), one RoPE over q and k together, one SDPA
call, and a static KV cache written by slot. Which fp32 matmul kernel runs is chosen per
machine and row count by measurement (models/kernels.py): on a CPU, oneDNN with prepacked
weights keeps a forward over a small draft tree near the cost of one token, where the default
MKL path costs 2-4x. The choice is measured once per CPU, torch build, thread count and
weight shapes, and cached (``<cache root>/kernels/``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass

from pathlib import Path

import torch
import torch.nn.functional as F

from ddspec.config import DEFAULT_DRAFT_WEIGHTS
from ddspec.errors import ConfigError
from ddspec.kv_cache import StaticKVCache
from ddspec.models.base import ModelInfo, TargetOutput, expand_mask, masked_attention_backends
from ddspec.models.kernels import KernelPlan, Weight, choose_plan, forced_kernel, measure_plan


@dataclass(frozen=True, slots=True)
class LlamaArch:
    """The hyper-parameters the native forward needs, read from a HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or a llama3-style dict
    max_position: int
    qkv_bias: bool
    tie_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArch":
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            max_position=cfg.get("max_position_embeddings", 4096),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama-3 frequency scaling when configured."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = arch.rope_scaling
    if s is None:
        return inv.float()
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.float()


class LlamaLayer:
    """One decoder layer's weights: fused qkv and gate+up, each a :class:`Weight` in the layouts
    of the kernels ``plan`` chooses (shared by all layers of a model).

    blocks: GGUF blocks of some weights by name (models/gguf_blocks.py), read by the ``native``
    kernel instead of the fp32 values. With ``native`` among the kernels, ``self.fused``
    describes the whole layer to ``dd_layers_forward``."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, arch: LlamaArch, plan: KernelPlan,
                 kernels: set[str] | None = None, blocks: dict | None = None) -> None:
        attn = f"{prefix}self_attn."
        kernels = plan.needed if kernels is None else kernels
        self.plan = plan
        self.input_norm = w.get(f"{prefix}input_layernorm.weight")  # absent in EAGLE heads
        self.post_norm = w[f"{prefix}post_attention_layernorm.weight"]
        native = _native_parts(blocks, kernels)
        self.qkv, self.o, self.gate_up, self.down = (  # stacked where several (no copy of a single one)
            Weight(w[names[0]] if len(names) == 1 else torch.cat([w[n] for n in names]), kernels, native(names))
            for names in stacked_names(prefix))
        self.qkv_bias = (
            torch.cat([w[f"{attn}{p}_proj.bias"] for p in "qkv"]) if arch.qkv_bias else None
        )
        self.fused = None
        if "native" in kernels:
            from ddspec import native as native_lib

            self._qkv_native = self.qkv.native.with_bias(self.qkv_bias)  # the struct points into it: keep it
            self.fused = native_lib.layer_struct(arch, self.input_norm, self.post_norm, self._qkv_native,
                                                 self.o.native, self.gate_up.native, self.down.native)

    @property
    def weights(self) -> list[Weight]:
        return [self.qkv, self.o, self.gate_up, self.down]


# the bytes of layer weights the AVX-512 passes are timed on (native.choose_wide): past the last-level
# caches of these CPUs (32 MB L3 per core complex on AMD EPYC), so that the weights come from
# memory as in a forward: timed on 8 layers (21 MB, held in the caches between rounds), the
# choice for 3 rows of the int8 model ran its forward 1.10x slower than the 8-lane passes
WIDE_TIMING_BYTES = 64 << 20


def stacked_names(prefix: str) -> list[list[str]]:
    """The weights a layer multiplies as one matrix each: q|k|v, o, gate|up, down."""
    attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    return [[f"{attn}{p}_proj.weight" for p in "qkv"], [f"{attn}o_proj.weight"],
            [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"], [f"{mlp}down_proj.weight"]]


def _native_parts(blocks: dict | None, kernels: set[str]):
    """names -> the stacked NativeWeight of those GGUF block weights, or None (use fp32 values)."""
    def parts(names: list[str]):
        if "native" not in kernels or not blocks or any(n not in blocks for n in names):
            return None
        from ddspec.native import concat

        found = [blocks[n] for n in names]
        return found[0] if len(found) == 1 else concat(found) if len({b.kind for b in found}) == 1 else None
    return parts


def native_layers_forward(layers: list[LlamaLayer] | None, x: torch.Tensor, rotary: "Rotary", positions: torch.Tensor,
                          cache: StaticKVCache, mask: torch.Tensor | None, hidden_layers=(), hidden=None,
                          first: int = 0, array=None, extra: torch.Tensor | None = None,
                          final_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """The decoder layers through ``dd_layers_forward``, in place on x [N, H]: one C call for all
    of them, which also copies the residual streams of ``hidden_layers`` out on the way.

    The same maths as :func:`layer_forward`; the new keys and values go into ``cache`` (layer
    ``first + i``) at its current length. mask: [N, length + N] bool or None (see everything).
    Residual streams entering the layers in ``hidden_layers`` are copied into ``hidden``.
    array: ``native.layer_array`` of the layers' structs, when the caller keeps one (``layers``
    may then be None).
    extra: [N, width] rows that layers built with ``extra`` read before their normed input (an
    EAGLE-3 midlayer's normed embeddings).
    final_norm: (weight [H], epsilon) of an RMSNorm applied to x after the last layer, in the same
    C call (x is then the normed output)."""
    from ddspec.native import layer_array, layers_forward

    x = x.contiguous()
    positions = positions.to(torch.int64).contiguous()
    mask = None if mask is None else mask.to(torch.bool).contiguous()
    array = layer_array([layer.fused for layer in layers]) if array is None else array
    count = len(array)
    capture = {i: torch.empty_like(x) for i in hidden_layers if 0 <= i < count}
    layers_forward(array, x, positions, rotary.cos, rotary.sin, cache.keys[first:first + count, 0],
                   cache.values[first:first + count, 0], cache.length, mask, extra, capture, final_norm)
    if capture:
        hidden.update(capture)
    return x


class Rotary:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, arch: LlamaArch, device: torch.device, dtype: torch.dtype) -> None:
        inv = rope_inv_freq(arch).to(device)
        t = torch.arange(arch.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, N, H, D]; positions: [N] or [B, N]."""
        cos = self.cos[positions].unsqueeze(-2)  # [.., N, 1, D]
        sin = self.sin[positions].unsqueeze(-2)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def attention(
    q: torch.Tensor,  # [B, N, nh * D]
    k: torch.Tensor,  # [B, N, nkv * D]
    v: torch.Tensor,  # [B, N, nkv * D]
    arch: LlamaArch,
    rotary: Rotary,
    positions: torch.Tensor,  # [N] or [B, N]
    attend,  # (k, v) [B, nkv, N, D] -> keys, values [B, nkv, T, D] to attend over (the cache)
    mask: torch.Tensor | None,  # [B or 1, 1, N, T] bool, True = attend; None = see everything
) -> torch.Tensor:
    """RoPE, cache write and scaled dot-product attention; returns [B, N, nh * D]."""
    b, n, _ = q.shape
    nh, nkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    qk = rotary.apply(torch.cat([q, k], dim=-1).view(b, n, nh + nkv, d), positions)  # [B, N, nh+nkv, D]
    keys, values = attend(qk[:, :, nh:].transpose(1, 2), v.view(b, n, nkv, d).transpose(1, 2))
    query = qk[:, :, :nh].transpose(1, 2)
    # a GPU: no cuDNN plan per shape (see masked_attention_backends); the CPU path skips even the call
    backends = masked_attention_backends(query.device) if mask is not None and query.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=nh != nkv)  # [B, nh, N, D]
    return out.transpose(1, 2).reshape(b, n, nh * d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_forward(
    layer: LlamaLayer,
    x: torch.Tensor,  # [B, N, H] the residual stream (or the already-normed input if no input_norm)
    arch: LlamaArch,
    rotary: Rotary,
    positions: torch.Tensor,  # [N] or [B, N]
    attend,  # see attention()
    mask: torch.Tensor | None,  # [B or 1, 1, N, T] bool or None
    kernel: str | None = None,  # None = the layer's plan for this many rows
) -> torch.Tensor:
    nq, nkv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    kernel = kernel or layer.plan.kernel(x.numel() // x.shape[-1])
    h = x if layer.input_norm is None else rms_norm(x, layer.input_norm, arch.rms_eps)
    qkv = layer.qkv(h, kernel)  # [B, N, nq + 2 nkv]
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias
    q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
    x = x + layer.o(attention(q, k, v, arch, rotary, positions, attend, mask), kernel)
    h = rms_norm(x, layer.post_norm, arch.rms_eps)
    gate, up = layer.gate_up(h, kernel).chunk(2, dim=-1)  # [B, N, I] each
    return x + layer.down(F.silu(gate) * up, kernel)


def measure_layers_plan(layers: list[LlamaLayer], arch: LlamaArch, rotary: Rotary, options: tuple[str, ...],
                        prefix: int = 64, reps: int = 3) -> KernelPlan:
    """The fastest kernel per row bucket, timing whole decoder layers as a forward runs them
    (after ``prefix`` cached tokens, causal mask): the ``native`` kernel runs each layer as one
    C call, so matmul timings alone would undercount what it saves. Median of ``reps``, interleaved."""
    import time

    from ddspec.models.kernels import BUCKETS, pick_fastest

    gen = torch.Generator().manual_seed(0)
    cache = StaticKVCache(len(layers), arch.num_kv_heads, arch.head_dim, prefix + max(BUCKETS),
                          dtype=rotary.cos.dtype, device=rotary.cos.device)
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    inputs = {}
    for b in BUCKETS:
        mask = torch.ones(b, prefix + b, dtype=torch.bool)
        mask[:, prefix:] = torch.ones(b, b, dtype=torch.bool).tril_()
        x = torch.randn(b, arch.hidden_size, generator=gen).to(rotary.cos.device, rotary.cos.dtype)
        inputs[b] = (x, prefix + torch.arange(b), mask)

    def timer(kernel: str):
        def run(b: int) -> float:
            x, positions, mask = inputs[b]
            cache.length = prefix
            t = time.perf_counter()
            if kernel == "native":
                native_layers_forward(layers, x.clone(), rotary, positions, cache, mask)
            else:
                y = x.view(1, b, -1)
                for i, layer in enumerate(layers):
                    y = layer_forward(layer, y, arch, rotary, positions, lambda kk, vv, i=i: cache.write(i, kk, vv),
                                      mask.view(1, 1, b, -1), kernel=kernel)
            return time.perf_counter() - t
        return run

    plan = pick_fastest({k: timer(k) for k in options}, reps)
    cache.length = 0
    return plan


PREFILL_CHUNK = 256  # a longer causal forward on the native kernel runs as forwards of this many tokens
# (800 / 2,000-token prompts, int8: one forward 502 / 2556 ms; chunks of 512 465 / 1592, 256 465 / 1589,
# 128 474 / 1615, 64 502 / 1740; Intel Xeon family 6 model 167, 2 threads, the same logits)
KV_CACHE_ENV = "DDSPEC_KV_CACHE"  # fp32 / fp16: overrides kv_cache_dtype's choice (for comparisons)


def kv_cache_dtype(activations: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of a native target's KV cache: fp16 for 8-bit activations on a CPU, else the model's.

    With 8-bit activations the model is already llama.cpp's rounding of the fp32 one, whose
    caches hold fp16 too; each key and value is rounded once, as it is written, and every row
    reads the same rounded values (a tree's row still equals its token decoded alone, bit for
    bit). The attention then reads half the bytes. Measured on an Intel Xeon (family 6 model 167,
    2 threads, held-out prompts, every output equal to plain decoding): a forward over 1 / 4 / 8
    tokens after 800 took 4.54 / 5.92 / 8.35 ms against 5.21 / 6.91 / 9.22; decoding after ~540-token
    prompts ran 1.12-1.14x as fast, after ~90-token ones 1.02-1.03x; the prefill took as long. The
    fp32 model keeps fp32 (its logits match HF's). ``DDSPEC_KV_CACHE=fp32`` or ``fp16`` overrides."""
    forced = os.environ.get(KV_CACHE_ENV, "").strip().lower()
    if forced in ("fp32", "float32"):
        return torch.float32
    if forced in ("fp16", "float16"):
        return torch.float16
    if forced:
        raise ConfigError(f"{KV_CACHE_ENV}={forced!r}: use fp32 or fp16 (or unset it for the default)")
    return torch.float16 if activations == "int8" and device.type == "cpu" else dtype


class NativeLlama:
    """The native implementation of the :class:`~ddspec.models.base.TargetModel` interface."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        hf_config: dict,
        info: ModelInfo,
        tokenizer: object = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        plans: tuple[KernelPlan, KernelPlan] | None = None,
        gguf=None,
        activations: str = "fp32",
    ) -> None:
        """plans: the matmul kernels of the decoder layers and of the lm_head (models/kernels.py);
        None = the cached choice for this machine, measured on first use (a few seconds).
        gguf: the GGUF file these weights were dequantised from, if any: the ``native`` kernel
        then reads its Q4_1 / Q8_0 blocks (exactly the same weights, fewer bytes).
        activations: ``fp32``, or ``int8``: those blocks multiply activations rounded to 8 bits per
        block of 32 (as llama.cpp does; native/ddspec_kernels.c, DD_Q4_1_A8): faster, most at
        several rows, and a slightly different model (plain and speculative decoding share it); its
        KV cache holds fp16 (see :func:`kv_cache_dtype`)."""
        self.arch = LlamaArch.from_hf_config(hf_config)
        self.hf_config = dict(hf_config)
        self.info, self.tokenizer = info, tokenizer
        self.device, self.dtype = torch.device(device), dtype
        w = {k.removeprefix("model."): v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        self.embed_tokens = w["embed_tokens.weight"]  # [V, H]
        self.norm = w["norm.weight"]
        self._final_norm_c = (self.norm.float().contiguous(), float(self.arch.rms_eps))  # the native forward's own
        head = self.embed_tokens if self.arch.tie_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self._lm_head_oi = head  # [V, H] (the embeddings when tied: no copy)
        self.blocks = self._gguf_blocks(gguf, w) if gguf is not None else {}
        self.activations = activations
        compute = self._activation_blocks(activations)  # what the target multiplies with
        head_name = "embed_tokens.weight" if head is self.embed_tokens else "lm_head.weight"
        self._choose_wide(compute, head_name)
        self.layer_plan, self.head_plan = plans or self._choose_plans(w, head, compute.get(head_name), compute)
        self.layers = [LlamaLayer(w, f"layers.{i}.", self.arch, self.layer_plan, blocks=compute)
                       for i in range(self.arch.num_layers)]
        self.lm_head_w = Weight(head, self.head_plan.needed, compute.get(head_name))
        # the layers hold their (stacked) blocks now; keep only the lm_head's, for draft lm_heads
        self.blocks = {k: v for k, v in self.blocks.items() if k == head_name}
        self.rotary = Rotary(self.arch, self.device, dtype)
        self.cache: StaticKVCache | None = None
        self.kv_dtype = kv_cache_dtype(activations, dtype, self.device)
        # the layers' C structs in one array (for dd_layers_forward), when the native kernel runs them
        self._layer_array = None
        if self.layers and self.layers[0].fused is not None:
            from ddspec.native import layer_array

            self._layer_array = layer_array([layer.fused for layer in self.layers])
            self._choose_attention()
            self._tune_wide(compute, head_name)

    def _choose_attention(self, prefix: int = 256, sizes: tuple[int, ...] = (4, 8), reps: int = 9) -> None:
        """Whether the native attention's shared passes run on 16 lanes (where the kernels have them):
        measured once per machine (cached) as this model's forward over 4 and 8 tokens after
        ``prefix``, both settings interleaved, by the sum of their medians. The same bits either way."""
        from ddspec import native
        from ddspec.machine import interleaved_medians

        a = self.arch
        if prefix + max(sizes) > a.max_position:
            return

        def measure() -> bool:
            print("ddspec: timing the attention passes on this CPU (once, cached)", file=sys.stderr)
            gen = torch.Generator().manual_seed(0)
            vocab = self.info.vocab_size
            try:
                self.reset(prefix + max(sizes))
                self.forward(torch.randint(0, vocab, (prefix,), generator=gen), torch.arange(prefix))
                gain = 0.0  # seconds the 16 lanes save, summed over the sizes
                for n in sizes:
                    tokens, mask = torch.randint(0, vocab, (n,), generator=gen), torch.ones(n, n, dtype=torch.bool).tril_()

                    def setup(wide: bool) -> None:
                        native.set_attention_wide(wide)
                        self.truncate(prefix)

                    medians = interleaved_medians((True, False), lambda _: self.forward(tokens, prefix + torch.arange(n), mask),
                                                  reps, setup=setup)
                    gain += medians[False] - medians[True]
            finally:
                self.cache = None
            return gain > 0

        native.choose_attention_wide({"heads": a.num_heads, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
                                      "layers": a.num_layers, "hidden": a.hidden_size}, measure)

    def native_matmuls(self) -> dict[str, list]:
        """The C kernels' weights a forward multiplies with, by matmul, each list in layer order:
        ``q/k/v``, ``o``, ``gate/up``, ``down`` of every layer that runs as one C layer, and ``lm_head``
        (empty where it is not on the C kernels)."""
        names = ("q/k/v", "o", "gate/up", "down")
        out: dict[str, list] = {name: [] for name in names}
        for layer in self.layers:
            if layer.fused is not None:  # its four matmuls' C weights (the struct points into them)
                for name, w in zip(names, (layer._qkv_native, layer.o.native, layer.gate_up.native, layer.down.native)):
                    out[name].append(w)
        out["lm_head"] = [] if self.lm_head_w.native is None else [self.lm_head_w.native]
        return out

    def _tune_wide(self, blocks: dict, head_name: str, prefix: int = 128) -> None:
        """Choose the AVX-512 passes of the kinds this forward multiplies with (the layers' and the
        lm_head's blocks) on the forward itself, over 1..8 new tokens after ``prefix``, among the
        options that each kind's matmuls alone (native.gemm_sweep over this model's weights of the
        kind) keep: once per machine, cached (native.tune_wide_on_forward). Models whose layer
        weights are smaller than WIDE_TIMING_BYTES / 4 (test models: they stay in the caches, unlike
        a real forward's) keep the choice timed on their matmuls alone (_choose_wide)."""
        from ddspec import native

        streamed = [b for name, b in blocks.items() if name.startswith("layers.")]
        streamed_bytes = sum(b.nbytes for b in streamed)
        if streamed_bytes < WIDE_TIMING_BYTES // 4 or not native.wide_available():
            return
        if any(self.layer_plan.kernel(n) != "native" for n in range(1, native.WIDE_ROWS + 1)):
            return
        a, rows = self.arch, native.WIDE_ROWS
        prefix = min(prefix, a.max_position - rows - 1)
        kinds = sorted({b.kind for b in streamed} | ({blocks[head_name].kind} if head_name in blocks else set()))
        gen = torch.Generator().manual_seed(0)
        vocab = self.info.vocab_size
        inputs = {n: (torch.randint(0, vocab, (n,), generator=gen),
                      None if n == 1 else torch.ones(n, n, dtype=torch.bool).tril_()) for n in range(1, rows + 1)}
        prefilled = []  # the prefix is run when the first timing needs it (a cached choice times nothing)

        def setup(n: int) -> None:
            if not prefilled:
                self.reset(prefix + rows)
                self.forward(torch.randint(0, vocab, (prefix,), generator=gen), torch.arange(prefix))
                prefilled.append(True)
            self.truncate(prefix)

        def run(n: int) -> None:
            self.forward(inputs[n][0], prefix + torch.arange(n), inputs[n][1])

        # each kind's matmuls alone (the screening of tune_wide_on_forward): the layers' weights of
        # that kind in a forward's order, then the lm_head's, one C call per input width
        per = self.native_matmuls()
        mats = [w for ws in zip(per["q/k/v"], per["o"], per["gate/up"], per["down"]) for w in ws] + per["lm_head"]
        by_kind: dict[str, dict[int, list]] = {}  # kind -> input width -> its weights, in a forward's order
        for m in mats:
            by_kind.setdefault(m.kind, {}).setdefault(m.in_features, []).append(m)
        xs = {(n, w): torch.randn(n, w, generator=gen) for n in range(1, rows + 1) for w in {m.in_features for m in mats}}

        def alone(kind: str, n: int) -> None:
            for width, weights in by_kind.get(kind, {}).items():
                native.gemm_sweep(weights, xs[n, width])

        model = {"layers": a.num_layers, "hidden": a.hidden_size, "vocab": vocab, "bytes": streamed_bytes}
        try:
            native.tune_wide_on_forward(kinds, model, run, setup, alone=alone)
        finally:
            self.cache = None

    def _gguf_blocks(self, gguf, w: dict[str, torch.Tensor]) -> dict:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return {}
        from ddspec import native

        if not native.available():
            return {}
        from ddspec.models.gguf_blocks import native_weights, orders_path

        return native_weights(gguf, w, orders_path(Path(gguf)))

    def _choose_wide(self, blocks: dict, head_name: str) -> None:
        """How far ahead the quantised passes prefetch and, where the kernels have AVX-512 passes,
        which to run for each row count of the blocks' kinds: measured once per machine (cached) on
        the layers' weights stacked as the layers
        multiply them, as many layers as make WIDE_TIMING_BYTES (more than a CPU's caches hold,
        as in a forward, which streams every layer from memory), and on the lm_head. Where the
        kernels also have the passes for 8-bit activations and the target does not use the
        default draft heads' kind (q4_1a8), that kind is timed too, on the first 4 layers' Q4_1
        weights (a head's working set, which stays in the caches between its levels)."""
        from ddspec import native

        if not blocks or not native.available():
            return
        groups = [names for i in range(self.arch.num_layers) for names in stacked_names(f"layers.{i}.")
                  if all(n in blocks for n in names) and len({blocks[n].kind for n in names}) == 1]
        head = blocks.get(head_name)
        shapes: dict[str, set[str]] = {}
        for names in groups:
            shapes.setdefault(blocks[names[0]].kind, set()).add(
                f"{sum(blocks[n].out_features for n in names)}x{blocks[names[0]].in_features}")
        if head is not None:
            shapes.setdefault(head.kind, set()).add(f"{head.out_features}x{head.in_features}")
        heads, base = DEFAULT_DRAFT_WEIGHTS, DEFAULT_DRAFT_WEIGHTS.removesuffix("a8")
        for_heads = heads != base and heads not in shapes and base in shapes
        if for_heads:
            shapes[heads] = {"head " + s for s in shapes[base]}

        def weights() -> dict[str, list]:
            parts = _native_parts(blocks, {"native"})
            by_kind: dict[str, list] = {}
            taken = 0
            for names in groups:
                if taken >= WIDE_TIMING_BYTES:
                    break
                weight = parts(names)
                by_kind.setdefault(weight.kind, []).append(weight)
                taken += weight.nbytes
            if head is not None:
                by_kind.setdefault(head.kind, []).append(head)
            if for_heads:
                by_kind[heads] = [w.with_int8_activations() for w in by_kind[base][:16] if w.kind == base]
            return by_kind

        native.choose_wide(weights, {k: sorted(v) for k, v in shapes.items()})

    def _activation_blocks(self, activations: str) -> dict:
        """The blocks the target multiplies with: ``self.blocks``, or for ``int8`` their kinds with
        8-bit activations (``self.blocks`` stays as read, for draft heads' lm_heads)."""
        if activations == "fp32":
            return self.blocks
        if activations != "int8":
            raise ConfigError(f"unknown activations {activations!r}: choose fp32 or int8")
        if not any(b.kind in ("q4_1", "q8_0") for b in self.blocks.values()):
            raise ConfigError(
                f"--activations int8 multiplies a GGUF model's Q4_1 / Q8_0 weights on a CPU with ddspec's "
                f"kernels; {self.info.name or 'this model'} has none here (a .gguf file and --device cpu "
                f"--dtype float32 give them). Use --activations fp32.")
        return {k: b.with_int8_activations() for k, b in self.blocks.items()}

    def _choose_plans(self, w: dict[str, torch.Tensor], head: torch.Tensor, head_blocks,
                      blocks: dict) -> tuple[KernelPlan, KernelPlan]:
        """Measure (once per machine, cached) which kernel runs each row count fastest, on the first
        few layers' own weights and on the lm_head."""
        if blocks is not self.blocks:  # int8 activations: every matmul of the blocks on those kernels, one model
            forced = forced_kernel()
            if forced not in (None, "native"):
                raise ConfigError(f"--activations int8 runs on the native kernels; DDSPEC_KERNEL={forced} asks for "
                                  f"another. Unset DDSPEC_KERNEL or use --activations fp32.")
            return KernelPlan.uniform("native"), KernelPlan.uniform("native")
        probe_layers = range(min(4, self.arch.num_layers))

        def layers(options: tuple[str, ...]) -> KernelPlan:
            print(f"ddspec: choosing matmul kernels for this CPU ({', '.join(options)}; once, cached)", file=sys.stderr)
            probe = [LlamaLayer(w, f"layers.{i}.", self.arch, KernelPlan.uniform("mm"), set(options), blocks)
                     for i in probe_layers]
            return measure_layers_plan(probe, self.arch, Rotary(self.arch, self.device, self.dtype), options)

        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        layer_shapes = [list(w[f"layers.0.{n}.weight"].shape) for n in names]
        variant = ",".join(sorted({f"{b.kind}" for b in blocks.values()}))  # which GGUF blocks the native kernel reads
        layer_plan = choose_plan(f"layers x{len(probe_layers)}", layer_shapes, self.device, self.dtype, layers, variant)
        head_plan = choose_plan("lm_head", [list(head.shape)], self.device, self.dtype,
                                lambda options: measure_plan([[Weight(head, set(options), head_blocks)]], options),
                                head_blocks.kind if head_blocks is not None else "")
        return layer_plan, head_plan

    # -- cache ---------------------------------------------------------------------------
    @property
    def cache_length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    def reset(self, max_length: int) -> None:
        a = self.arch
        if self.cache is None or self.cache.max_length < max_length:
            self.cache = StaticKVCache(
                a.num_layers, a.num_kv_heads, a.head_dim, max_length, dtype=self.kv_dtype, device=self.device
            )
        self.cache.truncate(0)

    def reserve(self, max_length: int) -> None:
        if self.cache is None:
            self.reset(max_length)
        self.cache.reserve(max_length)

    def commit(self, keep: torch.Tensor) -> None:
        self.cache.keep(keep)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    # -- shared pieces -------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[tokens]

    def lm_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head_w(features, self.head_plan.kernel(features.numel() // features.shape[-1]))

    def _lm_head_argmax(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, each row's argmax or None): the argmax comes with the logits where the lm_head runs
        on the native kernel (taken inside its parallel region, see NativeWeight.with_argmax)."""
        native = self.lm_head_w.native
        if native is None or self.head_plan.kernel(features.shape[0]) != "native":
            return self.lm_head(features), None
        return native.with_argmax(features)

    def lm_head_weight_t(self) -> torch.Tensor:
        """The lm_head as [H, V] (a view of the [V, H] weight; what drafters and trainers multiply by)."""
        return self._lm_head_oi.t()

    def lm_head_blocks(self, rows: torch.Tensor | None):
        """The lm_head's GGUF blocks (a NativeWeight) for these vocabulary rows, or None without blocks."""
        blocks = self.lm_head_w.native if self.lm_head_w.native is not None else None
        if blocks is None or blocks.kind not in ("q4_1", "q8_0"):
            blocks = self.blocks.get("embed_tokens.weight" if self._lm_head_oi is self.embed_tokens else "lm_head.weight")
        if blocks is None:
            return None
        return blocks if rows is None else blocks.select(rows.cpu())

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.arch.rms_eps)

    # -- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        last_logits: bool = False,
    ) -> TargetOutput:
        cache = self.cache
        if cache is None:
            raise RuntimeError("call reset(max_length) before forward")
        n = tokens.shape[-1]
        cache.check_room(n)
        if mask is None and n > PREFILL_CHUNK and self.layer_plan.kernel(n) == self.layer_plan.kernel(PREFILL_CHUNK) == "native":
            return self._forward_chunks(tokens, positions, hidden_layers, last_logits)
        full = expand_mask(mask, cache.length, n, self.device)
        attn_mask = None if full is None else full.view(1, 1, n, -1)
        positions = positions.to(self.device)
        x = self.embed(tokens.to(self.device)).view(1, n, -1)  # [1, N, H]
        hidden: dict[int, torch.Tensor] = {}
        if self.layer_plan.kernel(n) == "native":
            features = native_layers_forward(self.layers, x[0], self.rotary, positions, cache, full, hidden_layers,
                                             hidden, array=self._layer_array, final_norm=self._final_norm_c)
            cache.advance(n)
            if self.arch.num_layers in hidden_layers:
                hidden[self.arch.num_layers] = features
            logits, best = self._lm_head_argmax(features[-1:] if last_logits else features)
            return TargetOutput(logits, features, hidden, best)
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                hidden[i] = x[0]
            x = layer_forward(
                layer, x, self.arch, self.rotary, positions,
                lambda k, v, i=i: cache.write(i, k, v), attn_mask,
            )
        cache.advance(n)
        features = self.final_norm(x[0])  # [N, H]
        if self.arch.num_layers in hidden_layers:  # as in HF: the last entry is post-norm
            hidden[self.arch.num_layers] = features
        return TargetOutput(self.lm_head(features[-1:] if last_logits else features), features, hidden)

    def _forward_chunks(self, tokens: torch.Tensor, positions: torch.Tensor, hidden_layers: tuple[int, ...],
                        last_logits: bool) -> TargetOutput:
        """A long causal forward (a prompt) as forwards of PREFILL_CHUNK tokens, each attending to the
        cache the ones before wrote: the same bits as one forward (every row is computed alone, see
        native/ddspec_kernels.c), without the one forward's [tokens x heads x keys] score matrix,
        which outgrows the caches (measured: a 2,000-token prompt 2.56 -> 1.59 s, int8, Intel Xeon
        family 6 model 167). Afterwards the cache holds all of them as the last forward's entries."""
        n = tokens.shape[-1]
        outs = [self.forward(tokens[s:s + PREFILL_CHUNK], positions[s:s + PREFILL_CHUNK], None, hidden_layers,
                             last_logits) for s in range(0, n, PREFILL_CHUNK)]
        self.cache.pending = n
        hidden = {k: torch.cat([o.hidden_states[k] for o in outs]) for k in outs[0].hidden_states}
        logits = outs[-1].logits if last_logits else torch.cat([o.logits for o in outs])
        return TargetOutput(logits, torch.cat([o.features for o in outs]), hidden)

    @torch.inference_mode()
    def forward_batch(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features [B, T, H] of right-padded sequences [B, T] without touching the cache."""
        x = self._batch_layers(tokens, attention_mask, len(self.layers))
        return self.final_norm(x)

    @torch.inference_mode()
    def hidden_batch(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                     hidden_layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """Residual streams [B, T, H] at the inputs of ``hidden_layers`` (HF hidden_states indices < the
        layer count); only the layers below the deepest one asked for are run."""
        out: dict[int, torch.Tensor] = {}
        self._batch_layers(tokens, attention_mask, max(hidden_layers), lambda i, x: out.__setitem__(i, x)
                           if i in hidden_layers else None)
        return out

    def _batch_layers(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None, upto: int,
                      visit=None) -> torch.Tensor:
        b, t = tokens.shape
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril_()
        mask = causal.view(1, 1, t, t)
        if attention_mask is not None:  # [B, T] True = real token
            mask = mask & attention_mask.to(self.device, torch.bool).view(b, 1, 1, t)
            mask = mask | torch.eye(t, dtype=torch.bool, device=self.device)  # no empty rows
        positions = torch.arange(t, device=self.device)
        x = self.embed(tokens.to(self.device))
        for i, layer in enumerate(self.layers[:upto]):
            if visit:
                visit(i, x)
            x = layer_forward(layer, x, self.arch, self.rotary, positions, lambda k, v: (k, v), mask)
        if visit:
            visit(upto, x)
        return x
