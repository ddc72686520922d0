"""A compact Llama-family target (Llama, Mistral, Qwen2, SmolLM) written for speed.

Why this exists: through HF transformers one SmolLM2 token costs ~3x the memory floor on our
CPU, mostly per-layer Python and op overhead (docs/design.md §6). Here each decoder layer is four
matmuls on fused weights (qkv, o, gate+up, down), one RoPE over q and k together, one SDPA
call, and a static KV cache written by slot. Which fp32 matmul kernel runs is chosen per
machine and row count by measurement (models/kernels.py): on a CPU, oneDNN with prepacked
weights keeps a forward over a small draft tree near the cost of one token, where the default
MKL path costs 2-4x. The choice is measured once per CPU, torch build, thread count and
weight shapes, and cached (``<cache root>/kernels/``); models/tuning.py makes it, before the
model is built from its :class:`LlamaWeights`, and tunes the C kernels on the built model.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddspec.errors import ConfigError
from ddspec.kv_cache import StaticKVCache
from ddspec.models.base import ModelInfo, TargetOutput, expand_mask, masked_attention_backends
from ddspec.models.kernels import KernelPlan, Weight


# the families the native forward runs (HF model_type); others use the HF adapter (models/loading.py)
NATIVE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_ROPE_TYPES = ("default", "llama3", "linear", "longrope")


def _rope_of(cfg: dict, layer_type: str | None = None) -> dict:
    """The RoPE settings of a config (transformers 5's ``rope_parameters``, per layer type where it
    has one, or the older ``rope_theta`` / ``rope_scaling``) as one dict with rope_type and rope_theta."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    elif layer_type == "sliding_attention" and cfg.get("rope_local_base_freq"):  # older Gemma 3 configs
        rope = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    rope = dict(rope)
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def layer_windows(cfg: dict) -> tuple[int, ...]:
    """Each layer's sliding window (0: it attends to the whole context), as transformers decides it:
    ``layer_types`` where the config lists them, else each family's rule (Mistral and Phi-3: every
    layer; Gemma 2: every other one from the first; Gemma 3: all but every ``sliding_window_pattern``-th;
    Qwen2/3 with ``use_sliding_window``: the layers from ``max_window_layers`` on)."""
    n, window, family = cfg["num_hidden_layers"], cfg.get("sliding_window") or 0, cfg.get("model_type")
    types = cfg.get("layer_types")
    if not window:
        return (0,) * n
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if family in ("mistral", "phi3"):
        return (window,) * n
    if family == "gemma2":
        return tuple(window if i % 2 == 0 else 0 for i in range(n))
    if family == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return tuple(window if (i + 1) % pattern else 0 for i in range(n))
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        return tuple(window if i >= cfg.get("max_window_layers", n) else 0 for i in range(n))
    return (0,) * n


def why_not_native(cfg: dict) -> str | None:
    """Why the native forward cannot run a model of this HF config (None: it can)."""
    family = cfg.get("model_type", "unknown")
    if family not in NATIVE_FAMILIES:
        return f"its family {family!r} has no native forward (those with one: {', '.join(NATIVE_FAMILIES)})"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if family in _GEMMA:
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        return f"its activation {act!r} has no native kernel"
    types = ("full_attention", "sliding_attention") if family == "gemma3_text" else (None,)
    for t in types:
        rope = _rope_of(cfg, t)
        if rope["rope_type"] not in _ROPE_TYPES:
            return f"its RoPE scaling {rope['rope_type']!r} has no native table"
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        return f"its partial rotary factor {partial} has no native kernel"
    if len({w for w in layer_windows(cfg) if w}) > 1:
        return "its layers have sliding windows of different sizes"
    return None


@dataclass(frozen=True, slots=True)
class LlamaArch:
    """The hyper-parameters the native forward needs, read from a HF config: the Llama layer and
    what the other native families change in it (defaults: Llama's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or a llama3 / linear / longrope dict (see rope_inv_freq)
    max_position: int
    qkv_bias: bool
    tie_embeddings: bool
    family: str = "llama"
    norm_offset: bool = False  # Gemma: every RMSNorm multiplies by (1 + w)
    sandwich: bool = False  # Gemma 2 and 3: norms on the attention's and MLP's outputs too
    activation: str = "silu"  # or gelu_tanh
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim); Gemma 2 and 3: query_pre_attn_scalar ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores become cap * tanh(score / cap)
    logit_softcap: float = 0.0  # Gemma 2: the logits likewise
    windows: tuple[int, ...] = ()  # per layer: 0, or its sliding window (keys at positions > p - window)
    local_rope: dict | None = None  # the RoPE of the windowed layers where it differs (Gemma 3)
    fused_proj: bool = False  # Phi-3: q|k|v and gate|up stored as one matrix each

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArch":
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        family = cfg.get("model_type", "llama")
        gemma = family in _GEMMA
        rope = _rope_of(cfg, "full_attention" if family == "gemma3_text" else None)
        local = _rope_of(cfg, "sliding_attention") if family == "gemma3_text" else None
        act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else (cfg.get("hidden_act") or "silu")
        scalar = cfg.get("query_pre_attn_scalar") if family in ("gemma2", "gemma3_text") else None
        max_position = cfg.get("max_position_embeddings", 4096)
        if rope["rope_type"] == "longrope" and "original_max_position_embeddings" not in rope:
            rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings", max_position)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=rope if rope["rope_type"] != "default" else None,
            max_position=max_position,
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            family=family,
            norm_offset=gemma,
            sandwich=family in ("gemma2", "gemma3_text"),
            activation=_ACTIVATIONS.get(act, act),
            embed_scale=float(hidden) ** 0.5 if gemma else 1.0,
            attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if family == "gemma2" else 0.0,
            logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            windows=layer_windows(cfg) if "num_hidden_layers" in cfg else (),
            local_rope=local if local is not None and local != rope else None,
            fused_proj=family == "phi3",
        )

    def rope_parameters(self) -> dict:
        """The global RoPE as a config's ``rope_parameters``."""
        return dict(self.rope_scaling or {"rope_type": "default"}, rope_theta=self.rope_theta)

    @property
    def window(self) -> int:
        """The sliding window of the layers that have one (0: none has)."""
        return max(self.windows, default=0)


HEAD_FAMILIES = ("llama", "qwen2", "mistral")  # the decoder layers a draft head is built from


def head_arch(config: dict, layers: int) -> LlamaArch:
    """The arch of a draft head's ``layers`` decoder layers from its config.json (or its target's):
    Llama layers (Qwen2's with q/k/v biases) whatever the target's family: no Gemma norms or
    soft-capping, no windows, SiLU, and the RoPE of the target's global layers."""
    cfg = {k: v for k, v in config.items() if k not in ("layer_types", "sliding_window", "hidden_activation")}
    if cfg.get("model_type") not in HEAD_FAMILIES:
        cfg["rope_parameters"] = _rope_of(config, "full_attention" if config.get("model_type") == "gemma3_text" else None)
        cfg["model_type"] = "llama"
    cfg.update(num_hidden_layers=layers, hidden_act="silu")
    return LlamaArch.from_hf_config(cfg)


def rope_inv_freq(arch: LlamaArch, rope: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] of ``rope`` (default: the arch's global RoPE), with Llama-3's
    frequency scaling, linear scaling or LongRoPE's short factors (for the positions below its
    original context; :class:`Rotary` takes the long ones past it) when configured."""
    d = arch.head_dim
    theta = arch.rope_theta if rope is None else float(rope["rope_theta"])
    s = arch.rope_scaling if rope is None else (rope if rope["rope_type"] != "default" else None)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if s is None:
        return inv.float()
    if s["rope_type"] == "linear":
        return (inv.float() / s["factor"]).float()
    if s["rope_type"] == "longrope":
        shape = torch.arange(0, d, 2, dtype=torch.int64).float() / d  # transformers' formula, in fp32
        return 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta ** shape)
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
    of the kernels ``plan`` chooses (shared by all layers of a model), and its norms (Gemma's with
    the 1 folded in: each is the factor a normed value is multiplied by).

    blocks: GGUF blocks of some weights by name (models/gguf_blocks.py), read by the ``native``
    kernel instead of the fp32 values. With ``native`` among the kernels, ``self.fused``
    describes the whole layer to ``dd_layers_forward``. window: the layer's sliding window (0:
    none); rotary: its own RoPE tables (None: the model's)."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, arch: LlamaArch, plan: KernelPlan,
                 kernels: set[str] | None = None, blocks: dict | None = None, window: int = 0,
                 rotary: "Rotary | None" = None) -> None:
        attn = f"{prefix}self_attn."
        kernels = plan.needed if kernels is None else kernels
        self.plan, self.window, self.rotary = plan, window, rotary

        def plain(name: str) -> torch.Tensor | None:
            return offset_norm(w.get(f"{prefix}{name}.weight"), arch)

        self.input_norm = plain("input_layernorm")  # absent in EAGLE heads
        # the norm before the MLP: Gemma 2 and 3 name the attention output's norm post_attention_layernorm
        self.post_norm = plain("pre_feedforward_layernorm" if arch.sandwich else "post_attention_layernorm")
        self.attn_norm = plain("post_attention_layernorm") if arch.sandwich else None
        self.mlp_norm = plain("post_feedforward_layernorm") if arch.sandwich else None
        self.q_norm, self.k_norm = plain("self_attn.q_norm"), plain("self_attn.k_norm")
        native = native_parts(blocks, kernels)

        def weight(names: list[str]) -> Weight:  # stacked where several (no copy of a single one)
            blocks_of = native(names)
            if blocks_of is not None and kernels == {"native"}:  # the blocks alone: no fp32 values needed
                return Weight(None, kernels, blocks_of)
            return Weight(w[names[0]] if len(names) == 1 else torch.cat([w[n] for n in names]), kernels, blocks_of)

        self.qkv, self.o, self.gate_up, self.down = (weight(names) for names in stacked_names(prefix, arch))
        self.qkv_bias = (
            torch.cat([w[f"{attn}{p}_proj.bias"] for p in "qkv"]) if arch.qkv_bias else None
        )
        self.fused = None
        if "native" in kernels:
            from ddspec import native as native_lib

            self._qkv_native = self.qkv.native.with_bias(self.qkv_bias)  # the struct points into it: keep it
            self.fused = native_lib.layer_struct(
                arch, self.input_norm, self.post_norm, self._qkv_native, self.o.native, self.gate_up.native,
                self.down.native, q_norm=self.q_norm, k_norm=self.k_norm, attn_norm=self.attn_norm,
                mlp_norm=self.mlp_norm, rope=None if rotary is None else (rotary.cos, rotary.sin), window=window)

    @property
    def weights(self) -> list[Weight]:
        return [self.qkv, self.o, self.gate_up, self.down]


def offset_norm(weight: torch.Tensor | None, arch: LlamaArch) -> torch.Tensor | None:
    """An RMSNorm's weight as the factor it multiplies by: Gemma's (1 + w) (computed in fp32, as
    transformers does), the weight itself elsewhere."""
    if weight is None or not arch.norm_offset:
        return weight
    return (1.0 + weight.float()).to(weight.dtype)


def stacked_names(prefix: str, arch: LlamaArch | None = None) -> list[list[str]]:
    """The weights a layer multiplies as one matrix each: q|k|v, o, gate|up, down (Phi-3 stores
    q|k|v and gate|up as one matrix each already)."""
    attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    if arch is not None and arch.fused_proj:
        return [[f"{attn}qkv_proj.weight"], [f"{attn}o_proj.weight"], [f"{mlp}gate_up_proj.weight"],
                [f"{mlp}down_proj.weight"]]
    return [[f"{attn}{p}_proj.weight" for p in "qkv"], [f"{attn}o_proj.weight"],
            [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"], [f"{mlp}down_proj.weight"]]


def native_parts(blocks: dict | None, kernels: set[str]):
    """names -> the stacked NativeWeight of those GGUF block weights, or None (use fp32 values)."""
    def parts(names: list[str]):
        if "native" not in kernels or not blocks or any(n not in blocks for n in names):
            return None
        from ddspec.native.weights import concat

        found = [blocks[n] for n in names]
        return found[0] if len(found) == 1 else concat(found)
    return parts


def native_layers_forward(layers: list[LlamaLayer] | None, x: torch.Tensor, rotary: "Rotary", positions: torch.Tensor,
                          cache: StaticKVCache, mask: torch.Tensor | None, hidden_layers=(), hidden=None,
                          first: int = 0, array=None, extra: torch.Tensor | None = None,
                          final_norm: tuple[torch.Tensor, float] | None = None,
                          local_mask: torch.Tensor | None = None) -> torch.Tensor:
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
    C call (x is then the normed output). local_mask: [N, length + N] bool, the mask of layers with a
    sliding window (:func:`window_mask`; None: ``mask``)."""
    from ddspec.native import layer_array, layers_forward

    x = x.contiguous()
    positions = positions.to(torch.int64).contiguous()
    mask = None if mask is None else mask.to(torch.bool).contiguous()
    local_mask = None if local_mask is None else local_mask.to(torch.bool).contiguous()
    array = layer_array([layer.fused for layer in layers]) if array is None else array
    count = len(array)
    capture = {i: torch.empty_like(x) for i in hidden_layers if 0 <= i < count}
    layers_forward(array, x, positions, rotary.cos, rotary.sin, cache.keys[first:first + count, 0],
                   cache.values[first:first + count, 0], cache.length, mask, extra, capture, final_norm, local_mask)
    if capture:
        hidden.update(capture)
    return x


class Rotary:
    """Precomputed cos/sin tables indexed by absolute position, of the arch's RoPE or of ``rope``
    (a dict as LlamaArch.local_rope)."""

    def __init__(self, arch: LlamaArch, device: torch.device, dtype: torch.dtype, rope: dict | None = None) -> None:
        s = arch.rope_scaling if rope is None else rope
        t = torch.arange(arch.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(arch, rope).to(device))  # [T, D/2]
        scale = 1.0
        if s is not None and s.get("rope_type") == "longrope":  # past the original context: the long factors
            old = int(s["original_max_position_embeddings"])
            d = arch.head_dim
            long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32)
                          * float(s["rope_theta"] if rope else arch.rope_theta) ** (torch.arange(0, d, 2).float() / d))
            freqs[old:] = torch.outer(t[old:], long.to(device))
            factor = s.get("factor") or arch.max_position / old
            scale = s.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old)))
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        self.cos, self.sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

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
    scale = arch.attn_scale or None
    if arch.attn_softcap:  # Gemma 2: scores soft-capped before the mask and softmax
        group = nh // nkv
        scores = query @ keys.repeat_interleave(group, 1).transpose(-1, -2) * (scale or d ** -0.5)
        scores = torch.tanh(scores / arch.attn_softcap) * arch.attn_softcap
        if mask is not None:  # bool (True = attend) or additive, as SDPA takes them
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        out = scores.softmax(-1) @ values.repeat_interleave(group, 1)
        return out.transpose(1, 2).reshape(b, n, nh * d)
    # a GPU: no cuDNN plan per shape (see masked_attention_backends); the CPU path skips even the call
    backends = masked_attention_backends(query.device) if mask is not None and query.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=nh != nkv,
                                             scale=scale)  # [B, nh, N, D]
    return out.transpose(1, 2).reshape(b, n, nh * d)


def window_mask(mask: torch.Tensor | None, positions: torch.Tensor, start: int, window: int) -> torch.Tensor | None:
    """The mask of a sliding-window layer: ``mask`` [.., N, start + N] (None: every key) and, for the
    row at position p, only the keys at positions > p - window (transformers' rule). The cache holds
    the committed tokens at slots = positions and the N new ones after them at ``positions``.
    None when no key falls outside any row's window (the layer then uses ``mask``)."""
    n = positions.shape[-1]
    if window <= 0 or int(positions.max()) - window < 0:
        return None
    positions = positions.reshape(n)
    keys = torch.cat([torch.arange(start, device=positions.device), positions])
    inside = keys.view(1, -1) > (positions.view(n, 1) - window)  # [N, start + N]
    return inside if mask is None else mask & inside.view(*([1] * (mask.dim() - 2)), n, -1)


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
    local_mask: torch.Tensor | None = None,  # the mask of a layer with a window (window_mask; None: mask)
) -> torch.Tensor:
    nq, nkv, d = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.head_dim
    kernel = kernel or layer.plan.kernel(x.numel() // x.shape[-1])
    h = x if layer.input_norm is None else rms_norm(x, layer.input_norm, arch.rms_eps)
    qkv = layer.qkv(h, kernel)  # [B, N, nq + 2 nkv]
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias
    q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
    if layer.q_norm is not None:  # Qwen3, Gemma 3: each head normed before RoPE
        q = rms_norm(q.unflatten(-1, (-1, d)), layer.q_norm, arch.rms_eps).flatten(-2)
        k = rms_norm(k.unflatten(-1, (-1, d)), layer.k_norm, arch.rms_eps).flatten(-2)
    if layer.window and local_mask is not None:
        mask = local_mask
    out = layer.o(attention(q, k, v, arch, layer.rotary or rotary, positions, attend, mask), kernel)
    x = x + (out if layer.attn_norm is None else rms_norm(out, layer.attn_norm, arch.rms_eps))
    h = rms_norm(x, layer.post_norm, arch.rms_eps)
    gate, up = layer.gate_up(h, kernel).chunk(2, dim=-1)  # [B, N, I] each
    act = F.silu(gate) if arch.activation == "silu" else F.gelu(gate, approximate="tanh")
    out = layer.down(act * up, kernel)
    return x + (out if layer.mlp_norm is None else rms_norm(out, layer.mlp_norm, arch.rms_eps))


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
        # positions past a short context window wrap around (a timing: only the cost counts)
        inputs[b] = (x, (prefix + torch.arange(b)) % rotary.cos.shape[0], mask)

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


@dataclass
class LlamaWeights:
    """A Llama-family model's weights as :class:`NativeLlama` is built from them (:meth:`prepare`).
    The kernels are chosen on these before the model is built (models/tuning.py): the kernel plans
    decide which layouts each weight is built in."""

    arch: LlamaArch
    hf_config: dict
    tensors: dict[str, torch.Tensor]  # by name without "model.", on the device, in the dtype
    device: torch.device
    dtype: torch.dtype
    activations: str  # fp32 or int8
    blocks: dict  # the GGUF blocks read, NativeWeight by name ({} without)
    compute: dict  # what the target multiplies with: ``blocks``, or their kinds with 8-bit activations
    head_name: str  # the lm_head's weight: lm_head.weight, or embed_tokens.weight when tied

    @property
    def head(self) -> torch.Tensor:
        return self.tensors[self.head_name]

    @classmethod
    def prepare(cls, weights: dict[str, torch.Tensor], hf_config: dict, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, gguf=None, activations: str = "fp32",
                name: str | None = None, manifest: dict | None = None) -> "LlamaWeights":
        """gguf: the GGUF file these weights were dequantised from, if any: the ``native`` kernel
        then reads its blocks (Q4_0 .. Q8_0, the K types: exactly the same weights, fewer bytes).
        manifest: the weights held only as that file's blocks (gguf_blocks.read_manifest; they are
        missing from ``weights`` and dequantised only where something asks for their fp32 values).
        activations: ``fp32``, or ``int8``: those blocks multiply activations rounded to 8 bits per
        block of 32 (as llama.cpp does; native/kernels/q4_1.c): faster, most at
        several rows, and a slightly different model (plain and speculative decoding share it); its
        KV cache holds fp16 (see :func:`kv_cache_dtype`). name: the model's, for messages."""
        from ddspec.models.gguf_blocks import BlockTensors, lazy_dense, manifest_blocks

        device = torch.device(device)
        arch = LlamaArch.from_hf_config(hf_config)
        w = {k.removeprefix("model."): v.to(device=device, dtype=dtype) for k, v in weights.items()}
        on_kernels = gguf is not None and device.type == "cpu" and dtype == torch.float32  # the native kernel's case
        lazy = None
        if manifest is not None:
            from ddspec import native

            source = Path(gguf or manifest["source"])
            blocks = manifest_blocks(source, manifest)
            if not (on_kernels and native.available()):  # no kernels to read them: every weight in fp32 now
                from ddspec.models.gguf_blocks import dense_of

                w.update({k: dense_of(v).to(device=device, dtype=dtype) for k, v in blocks.items()})
                blocks = {}
            else:
                lazy = lazy_dense(source, manifest, blocks)
        else:
            blocks = read_gguf_blocks(gguf, w) if on_kernels else {}
        w = BlockTensors(w, lazy)
        tied = arch.tie_embeddings or "lm_head.weight" not in w
        return cls(arch, dict(hf_config), w, device, dtype, activations, blocks,
                   activation_blocks(blocks, activations, name), "embed_tokens.weight" if tied else "lm_head.weight")


def read_gguf_blocks(gguf, w: dict[str, torch.Tensor]) -> dict:
    """The GGUF file's quantised blocks of the weights ``w`` (fp32 on the CPU), NativeWeight by
    name: {} without the native kernels."""
    from ddspec import native

    if not native.available():
        return {}
    from ddspec.models.gguf_blocks import native_weights, orders_path

    return native_weights(gguf, w, orders_path(Path(gguf)))


def activation_blocks(blocks: dict, activations: str, name: str | None) -> dict:
    """The blocks the target multiplies with: ``blocks``, or for ``int8`` their kinds with 8-bit
    activations (``blocks`` stay as read, for draft heads' lm_heads)."""
    if activations == "fp32":
        return blocks
    if activations != "int8":
        raise ConfigError(f"unknown activations {activations!r}: choose fp32 or int8")
    from ddspec.native.weights import INT8_ACTIVATIONS

    if not any(b.kind in INT8_ACTIVATIONS for b in blocks.values()):
        raise ConfigError(
            f"--activations int8 multiplies a GGUF model's block weights (Q4_0 .. Q8_0, the K types) on a CPU with ddspec's "
            f"kernels; {name or 'this model'} has none here (a .gguf file and --device cpu "
            f"--dtype float32 give them). Use --activations fp32.")
    return {k: b.with_int8_activations() for k, b in blocks.items()}


class NativeLlama:
    """The native implementation of the :class:`~ddspec.models.base.TargetModel` interface, built from
    :class:`LlamaWeights` with the matmul kernels ``plans`` chose; models/tuning.py chooses them
    (and the C kernels' options) when models/loading.py loads a target."""

    def __init__(self, parts: LlamaWeights, info: ModelInfo, tokenizer: object,
                 plans: tuple[KernelPlan, KernelPlan]) -> None:
        """plans: the matmul kernels of the decoder layers and of the lm_head (models/kernels.py);
        each weight is built in the layouts of the kernels they name. With ``native`` among the
        layers' kernels the layers run as one C call (their structs in one array)."""
        self.arch = parts.arch
        self.hf_config = dict(parts.hf_config)
        self.info, self.tokenizer = info, tokenizer
        self.device, self.dtype = parts.device, parts.dtype
        w = parts.tensors
        self._tensors, self._head_name = w, parts.head_name  # embeddings and lm_head: fp32 when asked (see embed)
        self.norm = offset_norm(w["norm.weight"], self.arch)
        self._final_norm_c = (self.norm.float().contiguous(), float(self.arch.rms_eps))  # the native forward's own
        self.activations = parts.activations
        compute, head_name = parts.compute, parts.head_name  # what the target multiplies with
        self.layer_plan, self.head_plan = plans
        self.rotary = Rotary(self.arch, self.device, self.dtype)
        # Gemma 3's windowed layers turn at their own RoPE base
        local = None if self.arch.local_rope is None else Rotary(self.arch, self.device, self.dtype, self.arch.local_rope)
        windows = self.arch.windows or (0,) * self.arch.num_layers
        self.layers = [LlamaLayer(w, f"layers.{i}.", self.arch, self.layer_plan, blocks=compute, window=windows[i],
                                  rotary=local if windows[i] else None)
                       for i in range(self.arch.num_layers)]
        head_blocks = compute.get(head_name)
        only_blocks = head_blocks is not None and self.head_plan.needed == {"native"}
        self.lm_head_w = Weight(None if only_blocks else parts.head, self.head_plan.needed, head_blocks)
        if self.lm_head_w.native is not None:  # packed now, not in the first answer's prefill
            _ = self.lm_head_w.native.struct
        # the layers hold their (stacked) blocks now; keep the lm_head's (for draft lm_heads) and the
        # embeddings' (rows looked up from them while their fp32 values are not needed elsewhere)
        self.blocks = {k: v for k, v in parts.blocks.items() if k in (head_name, "embed_tokens.weight")}
        self.cache: StaticKVCache | None = None
        self.kv_dtype = kv_cache_dtype(parts.activations, self.dtype, self.device)
        # the layers' C structs in one array (for dd_layers_forward), when the native kernel runs them
        self._layer_array = None
        if self.native_layers:
            from ddspec.native import layer_array

            self._layer_array = layer_array([layer.fused for layer in self.layers])

    def release_rows(self) -> None:
        """Drop the row layout of the C layers' weights once they are packed (the lm_head's and the
        embeddings' blocks stay whole: draft heads select from them)."""
        for layer in self.layers:
            if layer.fused is not None:
                for w in (layer._qkv_native, layer.qkv.native, layer.o.native, layer.gate_up.native, layer.down.native):
                    if w.rows is not None and all(w is not b for b in self.blocks.values()):
                        w.release_rows()

    @property
    def native_layers(self) -> bool:
        """Whether the decoder layers run on the C kernels, all of them in one call."""
        return bool(self.layers) and self.layers[0].fused is not None

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
    @property
    def embed_tokens(self) -> torch.Tensor:
        """The embeddings [V, H] in fp32 (dequantised on first use where the model holds them as GGUF blocks)."""
        return self._tensors["embed_tokens.weight"]

    @property
    def _lm_head_oi(self) -> torch.Tensor:
        """The lm_head [V, H] in fp32 (the embeddings when tied: no copy)."""
        return self._tensors[self._head_name]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first layer's input for these tokens: their embeddings (Gemma's times sqrt(hidden), in
        the model's dtype, as transformers scales them)."""
        blocks = self.blocks.get("embed_tokens.weight")
        if blocks is not None and not self._tensors.held("embed_tokens.weight"):  # only these rows, from the blocks
            from ddspec.models.gguf_blocks import dense_of

            flat = tokens.reshape(-1).cpu()
            x = dense_of(blocks.select(flat)).to(self.device).reshape(*tokens.shape, -1)
        else:
            x = self.embed_tokens[tokens]
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        return x

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-capping (cap * tanh(logits / cap)); the logits as they are elsewhere."""
        cap = self.arch.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def lm_head(self, features: torch.Tensor) -> torch.Tensor:
        return self._softcap(self.lm_head_w(features, self.head_plan.kernel(features.numel() // features.shape[-1])))

    def _lm_head_argmax(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, each row's argmax or None): the argmax comes with the logits where the lm_head runs
        on the native kernel (taken inside its parallel region, see NativeWeight.with_argmax)."""
        native = self.lm_head_w.native
        if native is None or self.head_plan.kernel(features.shape[0]) != "native":
            return self.lm_head(features), None
        logits, best = native.with_argmax(features)
        return self._softcap(logits), best  # a monotone map: the same argmax

    def lm_head_weight_t(self) -> torch.Tensor:
        """The lm_head as [H, V] (a view of the [V, H] weight; what drafters and trainers multiply by)."""
        return self._lm_head_oi.t()

    def lm_head_blocks(self, rows: torch.Tensor | None):
        """The lm_head's GGUF blocks (a NativeWeight) for these vocabulary rows, or None without blocks."""
        from ddspec.native.weights import INT8_ACTIVATIONS

        blocks = self.lm_head_w.native if self.lm_head_w.native is not None else None
        if blocks is None or blocks.kind not in INT8_ACTIVATIONS:
            blocks = self.blocks.get(self._head_name)
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
        local = window_mask(full, positions, cache.length, self.arch.window)  # the windowed layers' (or None)
        x = self.embed(tokens.to(self.device)).view(1, n, -1)  # [1, N, H]
        hidden: dict[int, torch.Tensor] = {}
        if self.layer_plan.kernel(n) == "native":
            features = native_layers_forward(self.layers, x[0], self.rotary, positions, cache, full, hidden_layers,
                                             hidden, array=self._layer_array, final_norm=self._final_norm_c,
                                             local_mask=local)
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
                local_mask=None if local is None else local.view(1, 1, n, -1),
            )
        cache.advance(n)
        features = self.final_norm(x[0])  # [N, H]
        if self.arch.num_layers in hidden_layers:  # as in HF: the last entry is post-norm
            hidden[self.arch.num_layers] = features
        return TargetOutput(self.lm_head(features[-1:] if last_logits else features), features, hidden)

    def session(self) -> "NativeLlama":
        """Another handle on this model with a KV cache of its own (every weight shared): one per
        sequence that :meth:`forward_many` runs beside others."""
        other = copy.copy(self)
        other.cache = None
        return other

    def _batchable(self, calls: list) -> bool:
        """Whether ``calls`` can run as one C call whose rows each get the bits of their sequence's own
        forward: the native kernel for every sequence's row count, for all of them, and for the lm_head."""
        sizes = [c[1].shape[-1] for c in calls]
        heads = [1 if c[5] else n for c, n in zip(calls, sizes)]
        return (self.native_layers and len({id(c[0].cache) for c in calls}) == len(calls)
                and all(c[0].cache is not None for c in calls)
                and all(n <= PREFILL_CHUNK or c[3] is not None for c, n in zip(calls, sizes))
                and all(self.layer_plan.kernel(n) == "native" for n in sizes + [sum(sizes)])
                and len({self.head_plan.kernel(n) for n in heads + [sum(heads)]}) == 1)

    @torch.inference_mode()
    def forward_many(self, calls: list[tuple]) -> list[TargetOutput]:
        """Several sequences' forwards in one: calls = [(session, tokens, positions, mask, hidden_layers,
        last_logits)], each session this model's (:meth:`session`) with its own cache. Their rows run
        through the decoder layers in one C call (each weight read once for all of them) and through
        the lm_head together; each output equals that session's own :meth:`forward` bit for bit. Calls
        that cannot share a C call that way (other kernels, a long prompt) run one after the other."""
        if len(calls) < 2 or not self._batchable(calls):
            return [s.forward(t, p, m, h, last) for s, t, p, m, h, last in calls]
        from ddspec.native import layers_forward_seqs

        ids, pos, seqs = [], [], []
        for s, tokens, positions, mask, _, _ in calls:
            cache, n = s.cache, tokens.shape[-1]
            cache.check_room(n)
            full = expand_mask(mask, cache.length, n, self.device)
            local = window_mask(full, positions, cache.length, self.arch.window)
            ids.append(tokens.reshape(-1))
            pos.append(positions.to(self.device, torch.int64))
            seqs.append((cache.keys[:, 0], cache.values[:, 0], n, cache.length,
                         None if full is None else full.to(torch.bool).contiguous(),
                         None if local is None else local.to(torch.bool).contiguous()))
        # every sequence's embeddings in one lookup (rows alike: each gets the bits of its own)
        x, positions = self.embed(torch.cat(ids).to(self.device)).contiguous(), torch.cat(pos).contiguous()
        wanted = set().union(*(c[4] for c in calls))
        capture = {i: torch.empty_like(x) for i in wanted if 0 <= i < self.arch.num_layers}
        layers_forward_seqs(self._layer_array, x, positions, self.rotary.cos, self.rotary.sin, seqs,
                            self._final_norm_c, capture)
        rows, at = [], 0
        for s, tokens, *_ in calls:
            n = tokens.shape[-1]
            s.cache.advance(n)
            rows.append((at, at + n))
            at += n
        last = [c[5] for c in calls]  # a prompt chunk's last row alone goes through the lm_head
        heads = torch.cat([x[b - 1:b] if l else x[a:b] for l, (a, b) in zip(last, rows)]) if any(last) else x
        logits, best = self._lm_head_argmax(heads)
        outs, h = [], 0
        for c, (a, b) in zip(calls, rows):
            k = 1 if c[5] else b - a
            hidden = {i: capture[i][a:b] for i in c[4] if i in capture}
            if self.arch.num_layers in c[4]:
                hidden[self.arch.num_layers] = x[a:b]
            outs.append(TargetOutput(logits[h:h + k], x[a:b], hidden, None if best is None else best[h:h + k]))
            h += k
        return outs

    def _forward_chunks(self, tokens: torch.Tensor, positions: torch.Tensor, hidden_layers: tuple[int, ...],
                        last_logits: bool) -> TargetOutput:
        """A long causal forward (a prompt) as forwards of PREFILL_CHUNK tokens, each attending to the
        cache the ones before wrote: the same bits as one forward (every row is computed alone, see
        native/kernels/attention.inc), without the one forward's [tokens x heads x keys] score matrix,
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
        local = window_mask(mask, positions, 0, self.arch.window)
        x = self.embed(tokens.to(self.device))
        for i, layer in enumerate(self.layers[:upto]):
            if visit:
                visit(i, x)
            x = layer_forward(layer, x, self.arch, self.rotary, positions, lambda k, v: (k, v), mask, local_mask=local)
        if visit:
            visit(upto, x)
        return x
