"""The draft head's drafting forward on the target's fast path.

A draft level runs the head over the frontier (top_k rows) and its lm_head over the draft
vocabulary: small-row matmuls, exactly where the kernel choice matters most on a CPU
(models/kernels.py). :class:`PackedHead` holds the head's weights as kernel-planned
:class:`~ddspec.models.kernels.Weight` objects and runs each decoder layer through the native
target's ``layer_forward`` (an EAGLE head's layer is a Llama layer without its first RMSNorm,
which ``LlamaLayer`` already allows). The maths is :meth:`EagleHead.forward` with a cache;
that stays the slow, obvious reference (tests/test_packed_head.py checks they agree).

The weights are copied when the drafter is built: rebuild the drafter after changing the head.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from ddspec import native as native_lib
from ddspec.draft.features import fusion_input
from ddspec.config import DEFAULT_DRAFT_WEIGHTS
from ddspec.errors import ConfigError
from ddspec.kv_cache import StaticKVCache
from ddspec.models.kernels import KernelPlan, Weight, choose_plan, measure_plan
from ddspec.models.llama import LlamaLayer, layer_forward, measure_layers_plan, native_layers_forward


def draft_weights() -> str:
    """How the native kernel holds a head's matmul weights: ``DDSPEC_DRAFT_WEIGHTS`` = ``exact``
    (their values; fp16 when they are fp16 values), ``q8_0`` (GGUF Q8_0 blocks: a quarter of
    fp32's bytes), ``q4_1`` (GGUF Q4_1 blocks: an eighth), or ``q8_0a8`` / ``q4_1a8`` (those
    blocks with activations rounded to 8 bits, also for the draft lm_head: the integer kernels).
    The drafts change a little, the output does not: the target verifies them."""
    value = os.environ.get("DDSPEC_DRAFT_WEIGHTS", DEFAULT_DRAFT_WEIGHTS).strip().lower()
    if value not in DRAFT_WEIGHTS:
        raise ConfigError(f"DDSPEC_DRAFT_WEIGHTS={value!r}: choose one of {', '.join(DRAFT_WEIGHTS)}")
    return value


DRAFT_WEIGHTS = ("exact", "q8_0", "q8_0a8", "q4_1", "q4_1a8")


def _blocks(mats: dict, weights: str) -> dict:
    """Q8_0 or Q4_1 copies of the head's matrices (8-bit activations too for ``...a8``)."""
    quantise = native_lib.NativeWeight.q4_1 if weights.startswith("q4_1") else native_lib.NativeWeight.q8_0
    blocks = {k: quantise(m) for k, m in mats.items()}
    return {k: b.with_int8_activations() for k, b in blocks.items()} if weights.endswith("a8") else blocks




class DraftingForward(Protocol):
    """What a head's ``drafting_forward()`` returns and the EAGLE drafter runs: a :class:`PackedHead`,
    a :class:`PackedEagle3Head`, or an Eagle3Head itself (off a CPU, or outside fp32)."""

    weights: str  # how its matmul weights are held, one of DRAFT_WEIGHTS (part of what a draft level costs)

    def __call__(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None, cache: StaticKVCache) -> torch.Tensor:
        """Append head entries for embeds, features [1, N, H] at ``positions`` [N] (``mask`` [1, 1, N, T]
        over the cache, None = all of it) to ``cache``; returns the head's outputs [1, N, H]."""

    def committed_features(self, target_out, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input features at committed positions (``rows`` of the forward; None = all)."""


class PackedHead:
    def __init__(self, head, weights: str | None = None) -> None:  # an EagleHead (head.py builds this: no import back)
        state = {k: v.detach() for k, v in head.state_dict().items()}
        self.arch, self.rotary = head.arch, head.rotary()
        n_layers = len(head.layers)
        names = [k for k in state if k.endswith("_proj.weight")] + ["fc.weight"] + (["fuse.weight"] if head.fuse_layers else [])
        self.weights = weights or draft_weights()
        quantise = self.weights != "exact" and native_lib.available() and all(state[k].shape[1] % 32 == 0 for k in names)
        blocks = _blocks({k: state[k] for k in names}, self.weights) if quantise else None

        def measure(options) -> KernelPlan:  # whole head layers, as a draft level runs them
            plan = KernelPlan.uniform("mm")
            layers = [LlamaLayer(state, f"layers.{i}.", self.arch, plan, set(options), blocks) for i in range(n_layers)]
            return measure_layers_plan(layers, self.arch, self.rotary, options, prefix=128)

        w = state[names[0]]
        self.plan = choose_plan(f"head layers x{n_layers}", [list(state[k].shape) for k in names], w.device, w.dtype,
                                measure, self.weights if quantise else "")
        needed = self.plan.needed
        self.fc = Weight(state["fc.weight"], needed, blocks and blocks["fc.weight"])
        self.fc_bias = state.get("fc.bias")
        self.fuse_layers = head.fuse_layers  # a fused head's f_t + fuse(...) on the same kernels
        self.fuse = Weight(state["fuse.weight"], needed, blocks and blocks["fuse.weight"]) if self.fuse_layers else None
        self.layers = [LlamaLayer(state, f"layers.{i}.", self.arch, self.plan, None, blocks) for i in range(n_layers)]
        native = self.layers and self.layers[0].fused is not None
        self._array = native_lib.layer_array([layer.fused for layer in self.layers]) if native else None  # C structs

    @torch.inference_mode()
    def committed_features(self, target_out, rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`EagleHead.committed_features` with the fuse matmul on the planned kernel."""
        f = target_out.features if rows is None else target_out.features[rows]
        if self.fuse is None:
            return f
        states = [target_out.hidden_states[i] for i in self.fuse_layers]
        extra = fusion_input(states if rows is None else [s[rows] for s in states])
        return f + self.fuse(extra.to(f.dtype), self.plan.kernel(extra.shape[0]))  # as EagleHead.fused_features

    @torch.inference_mode()
    def __call__(
        self,
        embeds: torch.Tensor,  # [1, N, H] embeddings of token_{t+1}
        features: torch.Tensor,  # [1, N, H] target (or predicted) features f_t
        positions: torch.Tensor,  # [N] the positions t
        mask: torch.Tensor | None,  # [1, 1, N, T] bool; None = see the whole cache
        cache: StaticKVCache,  # written at slots [length, length + N)
    ) -> torch.Tensor:
        """Predicted features f̂_{t+1}: [1, N, H]."""
        n = embeds.shape[1]
        kernel = self.plan.kernel(n)
        x = self.fc(torch.cat([embeds, features], dim=-1), kernel)
        if self.fc_bias is not None:
            x = x + self.fc_bias
        if kernel == "native":  # each layer one C call (the head's layers are Llama layers)
            flat = None if mask is None else mask.reshape(n, -1)
            x = native_layers_forward(self.layers, x[0], self.rotary, positions, cache, flat, array=self._array)
            cache.advance(n)
            return x.view(1, n, -1)
        for i, layer in enumerate(self.layers):
            x = layer_forward(layer, x, self.arch, self.rotary, positions,
                              lambda k, v, i=i: cache.write(i, k, v), mask)
        cache.advance(embeds.shape[1])
        return x


class DraftLMHead:
    """The target's lm_head restricted to the draft vocabulary, on the kernel-planned path.

    blocks: the same rows as GGUF blocks (``NativeLlama.lm_head_blocks``), used by the
    ``native`` kernel only if they rebuild ``lm_head_oi`` exactly (checked here). weights: the
    head's ``DDSPEC_DRAFT_WEIGHTS``; with ``...a8`` the blocks multiply 8-bit activations. The
    rows stay as the target holds them (Q8_0 for the default model) whatever the head's weights:
    Q4_1 copies of them cost 2% of the shipped head's EAGLE-2 tau (4.081 -> 3.999 on 24 training
    prompts, AMD EPYC, 2026-12-02)."""

    def __init__(self, lm_head_oi: torch.Tensor, blocks=None, weights: str = "exact") -> None:  # [Vd, H]
        w = lm_head_oi.contiguous()
        if blocks is not None and not torch.equal(blocks(torch.eye(w.shape[1], dtype=w.dtype)), w.t()):
            blocks = None  # another head's own lm_head: its fp32 values it is
        if blocks is not None and weights.endswith("a8"):
            blocks = blocks.with_int8_activations()
        variant = "" if blocks is None else blocks.kind
        self.plan = choose_plan("draft lm_head", [list(w.shape)], w.device, w.dtype,
                                lambda options: measure_plan([[Weight(w, set(options), blocks)]], options), variant)
        self.weight = Weight(w, self.plan.needed, blocks)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, Vd]."""
        return self.weight(hidden, self.plan.kernel(hidden.shape[0]))


class PackedEagle3Head:
    """An EAGLE-3 head's drafting forward (:meth:`Eagle3Head.forward` with a cache) on planned kernels.

    The midlayer is a Llama layer but for its q/k/v input, ``cat(input_layernorm(e), hidden_norm(g))``
    (2H wide) while its residual is ``g``: on the native kernel it runs as one C call, given the
    normed embeddings as the layer's extra inputs; on the other kernels its four matmuls (q/k/v
    stacked, o, gate/up stacked, down) run one by one, the small ops in torch between them. ``fc``
    too, for committed positions. Q8_0 copies by default, as for :class:`PackedHead`."""

    def __init__(self, head, weights: str | None = None) -> None:  # an Eagle3Head (eagle3.py builds this)
        state = {k: v.detach() for k, v in head.state_dict().items()}
        self.arch, self.rotary, self.capture_layers = head.arch, head.rotary(), head.capture_layers
        p = "midlayer."
        stacks = {"qkv": [f"{p}self_attn.{x}_proj.weight" for x in "qkv"], "o": [f"{p}self_attn.o_proj.weight"],
                  "gate_up": [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"],
                  "down": [f"{p}mlp.down_proj.weight"], "fc": ["fc.weight"]}
        mats = {k: torch.cat([state[n] for n in names]) for k, names in stacks.items()}
        self.qkv_bias = (torch.cat([state[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"])
                         if f"{p}self_attn.q_proj.bias" in state else None)
        self.weights = weights or draft_weights()
        quantise = self.weights != "exact" and native_lib.available() and all(m.shape[1] % 32 == 0 for m in mats.values())
        blocks = _blocks(mats, self.weights) if quantise else {}
        layer = ["qkv", "o", "gate_up", "down"]

        def measure(options) -> KernelPlan:  # the midlayer's matmuls, as a draft level runs them
            return measure_plan([[Weight(mats[k], set(options), blocks.get(k)) for k in layer]], options)

        w = mats["qkv"]
        self.plan = choose_plan("eagle3 midlayer", [list(mats[k].shape) for k in layer], w.device, w.dtype, measure,
                                self.weights if quantise else "")
        self.mats = {k: Weight(m, self.plan.needed, blocks.get(k)) for k, m in mats.items()}
        self.norms = {k: state[f"{p}{k}.weight"] for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
        self._array = None
        # the midlayer as one C layer reading the normed embeddings first (the C code reads fp32 norms)
        if "native" in self.plan.needed and all(v.dtype == torch.float32 for v in self.norms.values()):
            m = self.mats
            self._qkv_native = m["qkv"].native.with_bias(self.qkv_bias)  # the struct points into it: keep it
            layer = native_lib.layer_struct(self.arch, self.norms["hidden_norm"], self.norms["post_attention_layernorm"],
                                            self._qkv_native, m["o"].native, m["gate_up"].native, m["down"].native,
                                            extra=self.arch.hidden_size)
            self._array = native_lib.layer_array([layer])

    @torch.inference_mode()
    def committed_features(self, target_out, rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`Eagle3Head.committed_features` with ``fc`` on the planned kernel."""
        states = [target_out.hidden_states[i] for i in self.capture_layers]
        x = torch.cat(states if rows is None else [s[rows] for s in states], dim=-1)
        return self.mats["fc"](x, self.plan.kernel(x.shape[0]))

    @torch.inference_mode()
    def __call__(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None, cache: StaticKVCache) -> torch.Tensor:
        """The head's pre-norm output h: [1, N, H] (arguments as :meth:`Eagle3Head.forward`)."""
        from ddspec.models.llama import attention, rms_norm

        a, m, n = self.arch, self.mats, embeds.shape[1]
        kernel = self.plan.kernel(n)
        if kernel == "native" and self._array is not None:
            e = rms_norm(embeds[0], self.norms["input_layernorm"], a.rms_eps).float().contiguous()
            flat = None if mask is None else mask.reshape(n, -1)
            h = native_layers_forward(None, features[0].float().clone(), self.rotary, positions, cache, flat,
                                      array=self._array, extra=e)
            cache.advance(n)
            return h.view(1, n, -1)
        nq, nkv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        x = torch.cat([rms_norm(embeds, self.norms["input_layernorm"], a.rms_eps),
                       rms_norm(features, self.norms["hidden_norm"], a.rms_eps)], dim=-1)
        qkv = m["qkv"](x, kernel)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        h = features + m["o"](attention(q, k, v, a, self.rotary, positions, lambda k_, v_: cache.write(0, k_, v_), mask),
                              kernel)
        gate, up = m["gate_up"](rms_norm(h, self.norms["post_attention_layernorm"], a.rms_eps), kernel).chunk(2, dim=-1)
        h = h + m["down"](torch.nn.functional.silu(gate) * up, kernel)
        cache.advance(n)
        return h
