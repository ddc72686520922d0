"""The lookup method (prompt lookup decoding): drafts copied from earlier in the context, no head."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig
from ddspec.draft.lookup import LookupDrafter
from ddspec.engine import Engine
from ddspec.methods import make_drafter

# prompts that repeat themselves (so drafts exist) and one that does not
PROMPTS = [[5, 17, 33, 8, 90, 5, 17, 33, 8, 91, 5, 17], [7] * 9, [12, 40, 41, 42, 43, 12, 40, 41], [100, 3, 64, 12, 99]]


def test_continuation_follows_the_latest_earlier_occurrence():
    d = LookupDrafter(depth=3, copy_depth=3)
    d.reset(64)
    d.prefill(torch.tensor([5, 1, 2, 3, 4, 9, 8, 2, 3, 6, 1, 2]), None, torch.tensor(3))
    assert d.continuation() == [4, 9, 8]  # "1 2 3" (the longest match) was followed by 4 9 8
    d.tokens.append(7)
    assert d.continuation() == []  # "3 7" and "2 3 7" never occurred: no drafts
    d.tokens += [5, 1]  # "7 5 1" is new, "5 1" occurred at the start
    assert d.continuation() == [2, 3, 4]
    d.resume(64, 3)  # prefix reuse keeps positions [0, 3)
    assert d.tokens == [5, 1, 2] and d.continuation() == []


def test_a_three_token_match_drafts_copy_depth_tokens(tiny_targets):
    d = LookupDrafter()  # the defaults: 3 drafts, 6 after a match of the context's last 3 tokens
    assert (d.depth, d.copy_depth, d.max_tree_size) == (3, 6, 7)
    d.reset(64)
    d.prefill(torch.tensor([5, 1, 2, 3, 4, 9, 8, 7, 6, 0, 2, 3]), None, torch.tensor(4))
    assert d.continuation() == [9, 8, 7, 6, 0, 2] and d.order == 3  # "2 3 4" occurred: a copy, 6 tokens
    d.tokens[-3:] = [11, 3, 4]  # now only "3 4" matches
    assert d.continuation() == [9, 8, 7] and d.order == 2
    assert LookupDrafter(depth=2).copy_depth == 2  # a depth of its own holds for every chain
    target = tiny_targets[("llama", "native")]
    sized = make_drafter("lookup@d3", target, None)  # lookup@d<depth>: that length after any match
    assert (sized.depth, sized.copy_depth) == (3, 3)
    assert make_drafter("lookup", target, None).max_tree_size == 7


@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("family, impl", [("llama", "native"), ("mistral", "hf")])
def test_lookup_is_greedy_identical_to_plain(tiny_targets, family, impl, depth):
    target = tiny_targets[(family, impl)]
    stop = StopConfig(max_new_tokens=40, stop_on_eos=False)
    drafted = 0
    for prompt in PROMPTS:
        ref = Engine(target).generate(prompt, stop).token_ids
        res = Engine(target, make_drafter(f"lookup@d{depth}", target, None)).generate(prompt, stop)
        assert res.token_ids == ref
        assert max(s.tree_size for s in res.stats.steps) <= depth + 1
        drafted += sum(s.tree_size > 1 for s in res.stats.steps)
    assert drafted > 0  # the repeated prompts did get drafts (tiny random models repeat themselves too)


def test_lookup_samples_reproducibly_and_stays_in_the_window(tiny_targets):
    target = tiny_targets[("llama", "native")]
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, seed=5)
    stop = StopConfig(max_new_tokens=25, stop_on_eos=False)
    a = Engine(target, make_drafter("lookup", target, None), cfg).generate(PROMPTS[0], stop).token_ids
    b = Engine(target, make_drafter("lookup", target, None), cfg).generate(PROMPTS[0], stop).token_ids
    assert a == b and len(a) == 25
    window = target.info.max_position
    prompt = [(7 * i) % 20 + 5 for i in range(window - 12)]  # periodic: drafts everywhere
    stop = StopConfig(max_new_tokens=32, stop_on_eos=False)
    ref = Engine(target).generate(prompt, stop).token_ids
    res = Engine(target, make_drafter("lookup@d6", target, None)).generate(prompt, stop)
    assert res.token_ids == ref and len(ref) == 12


def test_lookup_with_prefix_reuse(tiny_targets):
    """A chat's second turn keeps the first turn's caches: the drafter keeps its tokens too."""
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=20, stop_on_eos=False)
    engine = Engine(target, make_drafter("lookup", target, None), reuse_prefix=True)
    first = engine.generate(PROMPTS[0], stop).token_ids
    second_prompt = PROMPTS[0] + first + [5, 17, 33]
    res = engine.generate(second_prompt, stop)
    assert res.stats.reused_tokens > 0
    assert res.token_ids == Engine(target).generate(second_prompt, stop).token_ids


def test_ddspec_plain_steps_verify_lookup_chains_and_the_head_catches_up(tiny_targets, monkeypatch):
    """The cost-aware method's plain steps verify the lookup chain when there is one; the head
    then catches up over every token they committed, as if it had seen each step."""
    from test_spec_engine import eagle

    target = tiny_targets[("llama", "native")]
    drafter = eagle(target, "ddspec")
    from ddspec.draft.lookup import LookupDrafter

    drafter.lookup = LookupDrafter(max_position=target.info.max_position)
    choices = iter([True, False, False, False] * 100)
    monkeypatch.setattr(drafter.cost_policy, "draft_now", lambda chain=None: next(choices))
    prompt, stop = PROMPTS[0], StopConfig(max_new_tokens=60, stop_on_eos=False)
    engine = Engine(target, drafter)
    res = engine.generate(prompt, stop)
    assert res.token_ids == Engine(target).generate(prompt, stop).token_ids
    free = [s for i, s in enumerate(res.stats.steps) if i % 4 and s.tree_size > 1]  # plain steps with a chain
    assert free and sum(s.accepted for s in free) > 0
    drafter._flush_pending()
    caught_up = drafter.root_hidden.clone()
    # the same sequence taken in by a fresh drafter in one prefill: the same head state at the end
    # (the caches' sequence: the last step may have accepted tokens past the budget, not emitted)
    seq, root = torch.tensor(engine._held), engine._held_root
    assert engine._held[: len(prompt) + len(res.token_ids) - 1] == prompt + res.token_ids[:-1]
    target.reset(128)
    out = target.forward(seq, torch.arange(len(seq)), None, drafter.hidden_layers)
    fresh = eagle(target, "ddspec")
    fresh.reset(128)
    fresh.prefill(seq, out, torch.tensor(root))
    assert fresh.cache.length == 0 and fresh.root_hidden is None  # the cost-aware method's head takes the
    fresh._flush_pending()  # prompt in when it first drafts (never, where drafting does not pay)
    assert fresh.cache.length == len(seq)
    assert torch.allclose(caught_up, fresh.root_hidden, atol=1e-4, rtol=1e-4)


def test_ddspec_never_runs_the_head_while_drafting_does_not_pay(tiny_targets, monkeypatch):
    """Where the policy keeps to plain steps (drafting costs more than it gains on this machine)
    the head does no work at all, not even the prompt's prefill; the output is plain decoding's."""
    from test_spec_engine import eagle

    target = tiny_targets[("llama", "native")]
    drafter = eagle(target, "ddspec")
    drafter.lookup = LookupDrafter(max_position=target.info.max_position)
    monkeypatch.setattr(drafter.cost_policy, "draft_now", lambda chain=None: False)
    ran = []
    monkeypatch.setattr(drafter, "_run", lambda *a, **k: ran.append(1))
    prompt, stop = PROMPTS[0], StopConfig(max_new_tokens=40, stop_on_eos=False)
    res = Engine(target, drafter).generate(prompt, stop)
    assert res.token_ids == Engine(target).generate(prompt, stop).token_ids
    assert not ran and drafter.cache.length == 0


def test_a_resumed_sequence_takes_in_only_the_kept_prefix_of_the_plain_steps(tiny_targets, monkeypatch):
    """A server's next request keeps a prefix of the previous sequence (prefix reuse), often none: the
    head takes in the pending plain steps up to that prefix, not the whole previous generation."""
    from test_spec_engine import eagle

    target = tiny_targets[("llama", "native")]
    drafter = eagle(target, "ddspec")
    monkeypatch.setattr(drafter.cost_policy, "draft_now", lambda chain=None: False)
    prompt, stop = PROMPTS[0], StopConfig(max_new_tokens=40, stop_on_eos=False)
    Engine(target, drafter).generate(prompt, stop)
    rows, run = [], drafter._run
    monkeypatch.setattr(drafter, "_run", lambda features, tokens, *a: rows.append(tokens.numel())
                        or run(features, tokens, *a))
    pending = list(drafter._pending)
    drafter.resume(128, 0)  # nothing kept: nothing to take in
    assert rows == [] and drafter.cache.length == 0 and drafter._pending == []
    drafter._pending[:] = pending
    drafter.resume(128, len(prompt) + 2)  # the prompt and the first two plain steps (one token each)
    assert rows == [len(prompt) + 2] and drafter.cache.length == len(prompt) + 2


def test_ddspec_drafted_trees_carry_the_lookup_chain(tiny_targets, monkeypatch):
    """When the cost-aware method drafts with the head, the lookup's chain (if the context's ending
    occurred before) is merged into the tree: outputs stay identical to plain decoding, the merged
    nodes get accepted on repetitive text, and the acceptance map learns from the head's nodes only."""
    from test_spec_engine import eagle

    target = tiny_targets[("llama", "native")]
    drafter = eagle(target, "ddspec")
    drafter.lookup = LookupDrafter(max_position=target.info.max_position)
    policy = drafter.cost_policy
    monkeypatch.setattr(policy, "draft_now", lambda chain=None: True)
    trees, learned, grafts = [], [], []
    propose, observe, observe_graft = drafter.propose, policy.observe, policy.observe_graft

    def spy_propose(root, position):
        tree = propose(root, position)
        trees.append((tree.size, drafter._head_nodes))
        return tree

    def spy_observe(scores, accepted):
        learned.append((len(scores), trees[-1][1]))  # host lists on a CPU
        observe(scores, accepted)

    def spy_graft(accepted):
        grafts.append(accepted)
        observe_graft(accepted)

    monkeypatch.setattr(drafter, "propose", spy_propose)
    monkeypatch.setattr(policy, "observe", spy_observe)
    monkeypatch.setattr(policy, "observe_graft", spy_graft)
    stop = StopConfig(max_new_tokens=60, stop_on_eos=False)
    for prompt in PROMPTS[:3]:
        assert Engine(target, drafter).generate(prompt, stop).token_ids == Engine(target).generate(prompt, stop).token_ids
    assert any(size > head for size, head in trees), "no drafted tree carried a lookup chain"
    assert all(size <= drafter.max_tree_size for size, _ in trees)
    assert sum(grafts) > 0 and policy.graft_gain > 0  # merged nodes were accepted, and the forecast knows it
    assert all(n == head - 1 for n, head in learned)  # scores of the head's drafted nodes only


def test_continuation_says_which_ngram_found_it():
    d = LookupDrafter(depth=2, min_ngram=1)
    d.reset(64)
    d.prefill(torch.tensor([5, 1, 2, 3, 4, 9, 2]), None, torch.tensor(3))
    assert d.continuation() == [4, 9] and d.order == 2  # "2 3" occurred before
    d.tokens.append(9)
    assert d.continuation() == [2, 3] and d.order == 1  # only "9" did
    d.tokens.append(77)
    assert d.continuation() == [] and d.order == 0
