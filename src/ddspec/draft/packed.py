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

import torch

from ddspec.kv_cache import StaticKVCache
from ddspec.models.kernels import KernelPlan, Weight, choose_plan, measure_plan
from ddspec.models.llama import LlamaLayer, layer_forward, native_layers_forward


def _plan_for(name: str, weights: list[torch.Tensor], build) -> KernelPlan:
    """The cached kernel plan for these weights ([out, in] each); ``build(options)`` gives the
    Weight objects to time when it must be measured."""
    w = weights[0]
    shapes = [list(t.shape) for t in weights]
    return choose_plan(name, shapes, w.device, w.dtype, lambda options: measure_plan([build(options)], options))


class PackedHead:
    def __init__(self, head) -> None:  # an EagleHead (head.py builds this: no import back)
        state = {k: v.detach() for k, v in head.state_dict().items()}
        self.arch, self.rotary = head.arch, head.rotary()
        n_layers = len(head.layers)

        def build(options) -> list[Weight]:
            plan = KernelPlan.uniform("mm")
            layers = [LlamaLayer(state, f"layers.{i}.", self.arch, plan, set(options)) for i in range(n_layers)]
            return [Weight(state["fc.weight"], set(options))] + [w for layer in layers for w in layer.weights]

        names = [k for k in state if k.endswith("_proj.weight")] + ["fc.weight"]
        self.plan = _plan_for(f"head x{n_layers}", [state[k] for k in names], build)
        self.fc = Weight(state["fc.weight"], self.plan.needed)
        self.fc_bias = state.get("fc.bias")
        self.layers = [LlamaLayer(state, f"layers.{i}.", self.arch, self.plan) for i in range(n_layers)]

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
            x = native_layers_forward(self.layers, x[0], self.rotary, positions, cache, flat)
            cache.advance(n)
            return x.view(1, n, -1)
        for i, layer in enumerate(self.layers):
            x = layer_forward(layer, x, self.arch, self.rotary, positions,
                              lambda k, v, i=i: cache.write(i, k, v), mask)
        cache.advance(embeds.shape[1])
        return x


class DraftLMHead:
    """The target's lm_head restricted to the draft vocabulary, on the kernel-planned path."""

    def __init__(self, lm_head_oi: torch.Tensor) -> None:  # [Vd, H]
        w = lm_head_oi.contiguous()
        self.plan = _plan_for("draft lm_head", [w], lambda options: [Weight(w, set(options))])
        self.weight = Weight(w, self.plan.needed)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, Vd]."""
        return self.weight(hidden, self.plan.kernel(hidden.shape[0]))
