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

import torch

from ddspec import native as native_lib
from ddspec.draft.features import fusion_input
from ddspec.errors import ConfigError
from ddspec.kv_cache import StaticKVCache
from ddspec.models.kernels import KernelPlan, Weight, choose_plan, measure_plan
from ddspec.models.llama import LlamaLayer, layer_forward, measure_layers_plan, native_layers_forward


def draft_weights() -> str:
    """How the native kernel holds a head's matmul weights: ``DDSPEC_DRAFT_WEIGHTS`` = ``exact``
    (their values; fp16 when they are fp16 values) or ``q8_0`` (GGUF Q8_0 blocks: a quarter of
    fp32's bytes; the drafts change a little, the output does not: the target verifies them)."""
    value = os.environ.get("DDSPEC_DRAFT_WEIGHTS", DEFAULT_DRAFT_WEIGHTS).strip().lower()
    if value not in ("exact", "q8_0"):
        raise ConfigError(f"DDSPEC_DRAFT_WEIGHTS={value!r}: choose exact or q8_0")
    return value


DEFAULT_DRAFT_WEIGHTS = "q8_0"  # measured: the same tau, cheaper levels (AMD EPYC, 2026-12-01)


class PackedHead:
    def __init__(self, head, weights: str | None = None) -> None:  # an EagleHead (head.py builds this: no import back)
        state = {k: v.detach() for k, v in head.state_dict().items()}
        self.arch, self.rotary = head.arch, head.rotary()
        n_layers = len(head.layers)
        names = [k for k in state if k.endswith("_proj.weight")] + ["fc.weight"] + (["fuse.weight"] if head.fuse_layers else [])
        self.weights = weights or draft_weights()
        quantise = self.weights == "q8_0" and native_lib.available() and all(state[k].shape[1] % 32 == 0 for k in names)
        blocks = {k: native_lib.NativeWeight.q8_0(state[k]) for k in names} if quantise else None

        def measure(options) -> KernelPlan:  # whole head layers, as a draft level runs them
            plan = KernelPlan.uniform("mm")
            layers = [LlamaLayer(state, f"layers.{i}.", self.arch, plan, set(options), blocks) for i in range(n_layers)]
            return measure_layers_plan(layers, self.arch, self.rotary, options, prefix=128)

        w = state[names[0]]
        self.plan = choose_plan(f"head layers x{n_layers}", [list(state[k].shape) for k in names], w.device, w.dtype,
                                measure, "q8_0" if quantise else "")
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
        return f + self.fuse(extra, self.plan.kernel(extra.shape[0]))

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
    ``native`` kernel only if they rebuild ``lm_head_oi`` exactly (checked here)."""

    def __init__(self, lm_head_oi: torch.Tensor, blocks=None) -> None:  # [Vd, H]
        w = lm_head_oi.contiguous()
        if blocks is not None and not torch.equal(blocks(torch.eye(w.shape[1], dtype=w.dtype)), w.t()):
            blocks = None  # another head's own lm_head: its fp32 values it is
        variant = "" if blocks is None else blocks.kind
        self.plan = choose_plan("draft lm_head", [list(w.shape)], w.device, w.dtype,
                                lambda options: measure_plan([[Weight(w, set(options), blocks)]], options), variant)
        self.weight = Weight(w, self.plan.needed, blocks)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, Vd]."""
        return self.weight(hidden, self.plan.kernel(hidden.shape[0]))
