"""Context tokens beside a reduced draft vocabulary (draft/context_vocab.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.context_vocab import ContextVocab
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.errors import ConfigError
from ddspec.methods import split_method, tree_config

SMALL = TreeConfig(top_k=4, depth=4, total_tokens=14, ddd_check_depths=(2, 4), max_depth=5)
BASE = torch.arange(10, 74)  # a 64-token draft vocabulary
PROMPT = [5, 17, 33, 8, 90, 120, 5, 3]  # 5, 8, 90, 120 and 3 lie outside it


def reduced_head(target, seed: int = 1):
    head = random_head(target.hf_config, seed=seed)
    head.register_buffer("d2t", BASE - torch.arange(BASE.numel()))
    return head.eval().requires_grad_(False)


def drafter_for(target, method: str, context_vocab: int, seed: int = 1) -> EagleDrafter:
    cfg = tree_config(method, replace(SMALL, context_vocab=context_vocab))
    if cfg.depth_policy != "cost":
        return EagleDrafter(reduced_head(target, seed), target, cfg)
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, linear_cost

    cost = CostModel(linear_cost(2.0, 0.05), draft_root_ms=0.1, draft_level_ms=0.2, other_ms=0.1)
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    return EagleDrafter(reduced_head(target, seed), target, cfg, cost_policy=policy)


def test_context_vocab_adds_new_tokens_in_order_and_drops_the_oldest():
    lm = torch.randn(200, 8)
    ctx = ContextVocab(BASE, lm, capacity=3)
    ctx.add(torch.tensor([5, 20, 5, 90, 30, 3]))  # 20 and 30 are in the draft vocabulary already
    assert ctx.ids.tolist() == [5, 90, 3]
    assert torch.equal(ctx.all_ids, torch.cat([BASE, torch.tensor([5, 90, 3])]))
    assert torch.equal(ctx.weight, lm[[5, 90, 3]])
    ctx.add(torch.tensor([90, 120]))  # 90 is known; 120 pushes 5 out
    assert ctx.ids.tolist() == [90, 3, 120]
    ctx.add(torch.tensor([5]))  # 5 may come back, as the newest
    assert ctx.ids.tolist() == [3, 120, 5]
    h = torch.randn(2, 8)
    assert torch.allclose(ctx.logits(h), h @ lm[[3, 120, 5]].t())
    ctx.clear()
    assert ctx.size == 0 and torch.equal(ctx.all_ids, BASE)


def test_drafter_scores_context_tokens_as_the_full_vocabulary_would(tiny_targets):
    target = tiny_targets[("llama", "native")]
    drafter = drafter_for(target, "eagle2", context_vocab=16)
    drafter.reset(64)
    drafter._see(torch.tensor(PROMPT))
    extra = [5, 8, 90, 120, 3]
    assert drafter.context.ids.tolist() == extra
    hidden = torch.randn(3, target.info.hidden_size)
    rows = torch.cat([BASE, torch.tensor(extra)])
    want = torch.log_softmax(hidden @ target.lm_head_weight_t()[:, rows], dim=-1)
    assert (drafter.logprobs(hidden) - want).abs().max() <= 1e-3  # the draft rows' Q8_0 copies round a little
    assert torch.equal(drafter.to_target_ids(torch.tensor([0, 64, 68])), torch.tensor([10, 5, 3]))


@pytest.mark.parametrize("method", ["chain", "eagle", "eagle2", "ddd", "ddspec"])
def test_context_tokens_keep_every_method_lossless(tiny_targets, method):
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    ref = Engine(target).generate(PROMPT, stop).token_ids
    drafter = drafter_for(target, method, context_vocab=8)
    res = Engine(target, drafter).generate(PROMPT, stop)
    assert res.token_ids == ref
    seen = [t for t in PROMPT + ref if not 10 <= t < 74]
    assert drafter.context.size == min(8, len(set(seen)))
    assert set(drafter.context.ids.tolist()) <= set(seen)
    # the next step's root sits where the target's cache ends (the head's may lag behind it after
    # plain steps of the cost-aware method, which it catches up on before drafting)
    tree = drafter.propose(torch.tensor(ref[-1]), len(PROMPT) + len(ref) - 1)
    allowed = set(BASE.tolist()) | set(drafter.context.ids.tolist())
    assert set(tree.tokens[1:].tolist()) <= allowed


def test_context_tokens_get_drafted_and_sampling_stays_reproducible(tiny_targets):
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    drafted = set()
    for seed in range(3):
        drafter = drafter_for(target, "eagle2", context_vocab=64, seed=seed)
        Engine(target, drafter).generate(PROMPT, stop)
        tree = drafter.propose(torch.tensor(PROMPT[-1]), drafter.cache.length)
        drafted |= set(tree.tokens[1:].tolist()) - set(BASE.tolist())
    assert drafted  # a random head spreads its mass: some of 60 drafted tokens come from the context
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, seed=5)
    a, b = (Engine(target, drafter_for(target, "eagle2", 64), cfg).generate(PROMPT, stop).token_ids for _ in range(2))
    assert a == b


def test_no_context_when_off_or_when_the_head_has_its_own_lm_head(tiny_targets):
    from ddspec.draft.eagle3 import Eagle3Head

    target = tiny_targets[("llama", "native")]
    assert drafter_for(target, "eagle2", context_vocab=0).context is None
    full = random_head(target.hf_config, seed=1).eval().requires_grad_(False)  # full vocabulary: nothing to add
    assert EagleDrafter(full, target, SMALL).context is None
    e3 = Eagle3Head({**target.hf_config, "draft_vocab_size": 32}, (1, 1, 1)).eval().requires_grad_(False)
    assert EagleDrafter(e3, target, SMALL).context is None  # its lm_head has rows for its vocabulary only


def test_context_vocab_settings():
    assert split_method("eagle2@c0") == ("eagle2", {"context_vocab": 0})
    assert split_method("eagle2@d3k4t0.8c32") == ("eagle2", {"depth": 3, "top_k": 4, "draft_temperature": 0.8,
                                                             "context_vocab": 32})
    assert tree_config("eagle2@c0").context_vocab == 0
    with pytest.raises(ConfigError, match="--context-vocab"):
        TreeConfig(context_vocab=-1)


def test_a_reused_prefix_keeps_its_own_context_tokens_only(tiny_targets):
    """With prefix reuse the drafter keeps the shared prefix's context tokens and forgets those of
    the answer that the new prompt does not carry: the same set as a fresh start on that prompt."""
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=12, stop_on_eos=False)
    engine = Engine(target, drafter_for(target, "eagle2", 64), reuse_prefix=True)
    first = engine.generate(PROMPT, stop).token_ids
    follow_up = PROMPT + first[:4] + [100, 10, 101]  # keeps part of the answer, then a new turn
    warm = engine.generate(follow_up, stop)
    assert warm.stats.reused_tokens > len(PROMPT)
    fresh = drafter_for(target, "eagle2", 64)
    assert Engine(target, fresh).generate(follow_up, stop).token_ids == warm.token_ids
    assert engine.drafter.context.ids.tolist() == fresh.context.ids.tolist()


def test_ddspec_plain_steps_leave_the_context_to_the_catch_up_in_order(tiny_targets, monkeypatch):
    """The cost-aware method's plain steps only record their tokens; the head's catch-up tells the
    context vocabulary, in order, so a drafted step sees what drafting on every step would have."""
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    drafter = drafter_for(target, "ddspec", context_vocab=6)
    choices = iter([True] + [False] * 200)
    monkeypatch.setattr(drafter.cost_policy, "draft_now", lambda chain=None: next(choices))
    engine = Engine(target, drafter)
    res = engine.generate(PROMPT, stop)
    assert res.token_ids == Engine(target).generate(PROMPT, stop).token_ids
    seen_before = drafter.context.ids.tolist()
    drafter._flush_pending()
    reference = ContextVocab(BASE, target.lm_head_weight_t().t(), 6)
    reference.add(torch.tensor(engine._held + [engine._held_root]))
    assert drafter.context.ids.tolist() == reference.ids.tolist()
    assert seen_before != reference.ids.tolist()  # the plain steps' tokens waited for the catch-up
