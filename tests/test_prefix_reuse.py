"""Prefix reuse (Engine(..., reuse_prefix=True)): a follow-up prompt prefills only what the
caches do not hold, and every output, step and drafted tree is the same as without reuse."""

from __future__ import annotations

import itertools

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.methods import tree_config
from ddspec.prompts import chat_prompt_ids

SMALL = TreeConfig(top_k=4, depth=4, total_tokens=12)
TURNS = ["Tell me about the sea.", "Shorter, please.", "And now about mountains?"]


def drafter_for(target, method: str, fuse: tuple[int, ...] = ()):
    if method == "vanilla":
        return None
    head = random_head(target.hf_config, seed=3, std=0.05, fuse_layers=fuse)
    if fuse:
        with torch.no_grad():
            head.fuse.weight.normal_(0.0, 0.05)
    head, cfg = head.eval().requires_grad_(False), tree_config(method, SMALL)
    if cfg.depth_policy != "cost":
        return EagleDrafter(head, target, cfg)
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, linear_cost

    cost = CostModel(linear_cost(2.0, 0.05), draft_root_ms=0.1, draft_level_ms=0.2, other_ms=0.1)
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    return EagleDrafter(head, target, cfg, cost_policy=policy)


def ticking_clock():
    """A deterministic clock (the cost-aware method learns from step times): 1 ms per reading."""
    return itertools.count(0.0, 1e-3).__next__


def run_chat(engine: Engine, stop: StopConfig) -> list[dict]:
    """Three turns; per turn the prompt, the output ids, the reused count and every step's tree."""
    tok = engine.target.tokenizer
    history: list[dict[str, str]] = []
    turns = []
    for text in TURNS:
        history.append({"role": "user", "content": text})
        ids = chat_prompt_ids(tok, history)
        out, trees, pieces = [], [], []
        stream = engine.stream(ids, stop, trace=True)
        while True:
            try:
                chunk = next(stream)
            except StopIteration as done:
                stats = done.value
                break
            out += chunk.token_ids
            pieces.append(chunk.text)
            if chunk.tree is not None:
                trees.append((chunk.tree.tokens, chunk.tree.parents, chunk.tree.path))
        history.append({"role": "assistant", "content": "".join(pieces)})
        turns.append({"prompt": ids, "out": out, "reused": stats.reused_tokens, "trees": trees,
                      "steps": [(s.accepted, s.tree_size) for s in stats.steps]})
    return turns


CASES = [("llama", "native", "vanilla", ()), ("llama", "native", "eagle2", ()), ("llama", "native", "chain", ()),
         ("llama", "native", "eagle", ()), ("llama", "native", "eagle2", (1,)), ("mistral", "hf", "eagle2", ()),
         ("qwen2", "native", "vanilla", ()), ("llama", "native", "ddspec", ()), ("llama", "native", "ddspec", (1,))]


@pytest.mark.parametrize("family, impl, method, fuse", CASES)
def test_three_turn_chat_is_identical_with_and_without_reuse(tiny_targets, family, impl, method, fuse):
    target = tiny_targets[(family, impl)]
    stop = StopConfig(max_new_tokens=24)
    cold = run_chat(Engine(target, drafter_for(target, method, fuse), clock=ticking_clock()), stop)
    warm = run_chat(Engine(target, drafter_for(target, method, fuse), reuse_prefix=True, clock=ticking_clock()), stop)
    for c, w in zip(cold, warm):
        assert w["prompt"] == c["prompt"]
        assert w["out"] == c["out"]
        assert w["steps"] == c["steps"]  # the head's state is the same: same trees, same acceptance
        assert w["trees"] == c["trees"]
        assert c["reused"] == 0
    assert warm[0]["reused"] == 0
    for before, now in zip(warm, warm[1:]):  # a follow-up turn keeps at least the last prompt
        assert now["reused"] >= len(before["prompt"]) - (method != "vanilla")  # (the head one less)
        assert now["reused"] < len(now["prompt"])


def test_sampling_is_identical_with_reuse(tiny_targets):
    target = tiny_targets[("llama", "native")]
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=11)
    stop = StopConfig(max_new_tokens=20)
    cold = run_chat(Engine(target, drafter_for(target, "eagle2"), sampling), stop)
    warm = run_chat(Engine(target, drafter_for(target, "eagle2"), sampling, reuse_prefix=True), stop)
    assert [t["out"] for t in warm] == [t["out"] for t in cold]
    assert warm[2]["reused"] > 0


def test_resumed_head_cache_equals_a_cold_prefill(tiny_targets):
    """After a kept prefix, the head's entries and its root prediction match a full prefill."""
    target = tiny_targets[("llama", "native")]
    drafter = drafter_for(target, "eagle2")
    engine = Engine(target, drafter, reuse_prefix=True)
    first = [5, 17, 33, 8, 90, 41, 12]
    res = engine.generate(first, StopConfig(max_new_tokens=10, stop_on_eos=False))
    follow = first + res.token_ids + [7, 8, 9]
    stream = engine.stream(follow, StopConfig(max_new_tokens=1))
    next(stream)
    stream.close()
    assert target.cache_length == len(follow)
    n = len(follow)
    warm_keys, warm_root = drafter.cache.keys[:, :, :, :n].clone(), drafter.root_hidden.clone()
    cold = Engine(target, drafter)
    stream = cold.stream(follow, StopConfig(max_new_tokens=1))
    next(stream)
    stream.close()
    assert torch.allclose(drafter.cache.keys[:, :, :, :n], warm_keys, atol=1e-5)
    assert torch.allclose(drafter.root_hidden, warm_root, atol=1e-5)


def test_reuse_after_a_closed_stream_and_a_changed_drafter(tiny_targets):
    """A stream closed mid-way leaves a consistent, reusable state; a different drafter (or another
    engine on the same target) makes the next prompt prefill from scratch."""
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    prompt = [5, 17, 33, 8, 90]
    ref = Engine(target).generate(prompt + [3, 4], stop).token_ids
    engine = Engine(target, drafter_for(target, "eagle2"), reuse_prefix=True)
    stream = engine.stream(prompt, stop)
    next(stream), next(stream)
    stream.close()
    res = engine.generate(prompt + [3, 4], stop)
    assert res.token_ids == ref and res.stats.reused_tokens == len(prompt) - 1
    engine.drafter = drafter_for(target, "chain")
    res = engine.generate(prompt + [3, 4], stop)
    assert res.token_ids == ref and res.stats.reused_tokens == 0
    Engine(target).generate([9, 9, 9], StopConfig(max_new_tokens=3))  # someone else uses the target
    res = engine.generate(prompt + [3, 4], stop)
    assert res.token_ids == ref and res.stats.reused_tokens == 0


def test_reuse_grows_the_caches_and_keeps_their_content(tiny_targets):
    target = tiny_targets[("qwen2", "native")]
    engine = Engine(target, drafter_for(target, "eagle2"), reuse_prefix=True)
    prompt = [7, 8, 9, 10]
    first = engine.generate(prompt, StopConfig(max_new_tokens=5, stop_on_eos=False))
    longer = prompt + first.token_ids + list(range(20, 60))
    stop = StopConfig(max_new_tokens=150, stop_on_eos=False)  # needs more room than the first call made
    res = engine.generate(longer, stop)
    assert res.stats.reused_tokens >= len(prompt)
    assert res.token_ids == Engine(target).generate(longer, stop).token_ids
