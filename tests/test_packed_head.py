"""The drafting fast path (PackedHead, DraftLMHead) computes what EagleHead.forward computes."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.draft.head import EagleHead
from ddspec.draft.packed import PackedHead


# drafting weights -> how far the packed head may be from the module, relative to the output's
# scale (None: the module's maths to 1e-4); see test_packed_head_equals_the_module
TOLERANCE = {"exact": None, "q8_0": 0.03, "q4_1a8": 0.2}


def weights_of(kernel: str) -> str:
    """The drafting weights a ``kernel[-weights]`` parameter asks for."""
    return kernel.split("-")[1] if "-" in kernel else "exact"


@pytest.mark.parametrize("kernel", ["mm", "linear", "onednn", "native", "native-q8_0", "native-q4_1a8"])
@pytest.mark.parametrize("layers", [1, 2])
def test_packed_head_equals_the_module(tiny_targets, kernel, layers, monkeypatch):
    """Exact weights: the module's maths to 1e-4. Q8_0 weights: an approximation of it, within a
    few percent of the output's scale; Q4_1 weights with 8-bit activations (the native default):
    a coarser one, 16 levels per block (worst 0.11 of the scale over 25 seeded random heads, 0.7%
    for Q8_0), within a fifth; a wrong layout or scale errs by the whole scale."""
    from ddspec import native

    if kernel.startswith("native") and not native.available():
        pytest.skip(native.unavailable_reason())
    monkeypatch.setenv("DDSPEC_KERNEL", kernel.split("-")[0])
    target = tiny_targets[("llama", "native")]
    torch.manual_seed(layers)  # the same heads whatever ran before
    head = EagleHead({**target.hf_config, "num_hidden_layers": layers}).eval().requires_grad_(False)
    for p in head.parameters():  # make the later layers matter too (a fresh head's are random anyway)
        p.add_(0.01 * torch.randn_like(p))
    weights = weights_of(kernel)
    packed = PackedHead(head, weights)
    if kernel.startswith("native"):
        assert packed.layers[0].qkv.native.kind == {"exact": "f32"}.get(weights, weights)
    gen = torch.Generator().manual_seed(0)
    tol = TOLERANCE[weights]
    for want, got in module_and_packed(head, packed, target.info.hidden_size, gen):
        if tol:
            assert 0 < (got - want).abs().max() <= tol * want.abs().max()
        else:
            assert (got - want).abs().max() <= 1e-4


def module_and_packed(head, packed, h: int, gen: torch.Generator):
    """(module output, packed output) for a prefill of 5 entries, then 3 tree-like rows attending to
    it, each on its own cache; checks both caches advanced by all 8."""
    caches = [head.new_cache(32), head.new_cache(32)]
    for n, prefix in ((5, 0), (3, 5)):
        embeds, feats = torch.randn(1, n, h, generator=gen), torch.randn(1, n, h, generator=gen)
        positions = torch.arange(prefix, prefix + n)
        mask = torch.ones(1, 1, n, prefix + n, dtype=torch.bool)
        mask[0, 0, :, prefix:] = torch.ones(n, n, dtype=torch.bool).tril_()
        with torch.inference_mode():
            want = head(embeds, feats, positions, mask, caches[0])
        yield want, packed(embeds, feats, positions, mask, caches[1])
    assert caches[0].length == caches[1].length == 8


def test_drafter_logprobs_use_the_draft_vocabulary(tiny_targets):
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=2).eval().requires_grad_(False)
    drafter = EagleDrafter(head, target, TreeConfig(top_k=4, depth=3, total_tokens=8))
    hidden = torch.randn(3, target.info.hidden_size)
    want = torch.log_softmax(hidden @ target.lm_head_weight_t(), dim=-1)
    assert (drafter.logprobs(hidden) - want).abs().max() <= 1e-4


@pytest.mark.parametrize("kernel", ["mm", "onednn", "native", "native-q8_0", "native-q4_1a8"])
def test_packed_eagle3_head_equals_the_module(tiny_targets, kernel, monkeypatch):
    """The EAGLE-3 drafting fast path against Eagle3Head.forward: exact weights to 1e-4, Q8_0 copies
    within a few percent of the output's scale, Q4_1 copies with 8-bit activations (the default)
    within a fifth (see the test above); fc of the captured states likewise."""
    from ddspec import native
    from ddspec.draft.eagle3 import Eagle3Head
    from ddspec.draft.packed import PackedEagle3Head
    from ddspec.models.base import TargetOutput

    if kernel.startswith("native") and not native.available():
        pytest.skip(native.unavailable_reason())
    monkeypatch.setenv("DDSPEC_KERNEL", kernel.split("-")[0])
    target = tiny_targets[("llama", "native")]
    torch.manual_seed(1)
    head = Eagle3Head({**target.hf_config, "draft_vocab_size": 32}, (1, 1, 1)).eval().requires_grad_(False)
    for name, p in head.named_parameters():
        if "norm" in name:
            p.add_(0.1 * torch.randn_like(p))  # norms that matter
    weights = weights_of(kernel)
    packed = PackedEagle3Head(head, weights)
    assert (packed._array is not None) == kernel.startswith("native")  # the midlayer as one C call
    scale = TOLERANCE[weights]
    tol = (lambda want: scale * want.abs().max()) if scale else (lambda want: 1e-4)
    gen = torch.Generator().manual_seed(0)
    h = target.info.hidden_size
    for want, got in module_and_packed(head, packed, h, gen):
        assert (got - want).abs().max() <= tol(want)
    out = TargetOutput(None, None, {1: torch.randn(4, h, generator=gen)})
    with torch.inference_mode():
        want = head.committed_features(out, torch.tensor([0, 2]))
    assert (packed.committed_features(out, torch.tensor([0, 2])) - want).abs().max() <= tol(want)
