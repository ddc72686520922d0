"""A draft model as the drafter (--draft-model): chains and trees of a smaller same-tokenizer model."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.draft.model import DraftModelDrafter
from ddspec.engine import Engine
from ddspec.errors import ConfigError, DdspecError
from ddspec.methods import default_method, make_drafter, split_method, tree_config, uses_draft_model

PROMPTS = [[5, 17, 33, 8, 90, 5, 17], [7, 3, 60, 2], [12, 40, 41, 42, 43, 12, 40, 41, 100, 3, 64]]
METHODS = ["chain@d3m", "chain@d1m", "eagle2@d3k3n8m", "eagle2@d4k2n12m", "ddd@k3n10m", "ddspec@m"]
# tokens accepted per drafted step, at least, when the target drafts for itself (its drafts are its answer)
SELF_ACCEPTED = {"chain@d3m": 2.5, "chain@d1m": 0.9, "eagle2@d3k3n8m": 2.0, "eagle2@d4k2n12m": 2.5, "ddd@k3n10m": 1.5,
                 "ddspec@m": 1.0}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model of the tiny tokenizer (one layer, narrower): another model, as a real pair is."""
    from ddspec.models.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("draft") / "d", "llama", seed=7, layers=1, hidden=32)


def _drafter(method: str, target, draft_spec) -> DraftModelDrafter:
    d = make_drafter(method, target, None, TreeConfig(draft_model=str(draft_spec)))
    assert isinstance(d, DraftModelDrafter)
    return d


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family, impl", [("llama", "native"), ("qwen2", "hf")])
def test_a_draft_model_is_lossless(tiny_targets, tiny_dirs, draft_dir, family, impl, method):
    """Greedy output equals plain decoding for another model drafting and for the target drafting for
    itself; with itself as the draft model nearly every draft is accepted."""
    target = tiny_targets[(family, impl)]
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    for draft in (draft_dir, tiny_dirs[family]):
        accepted = drafted = 0
        for prompt in PROMPTS:
            ref = Engine(target).generate(prompt, stop).token_ids
            res = Engine(target, _drafter(method, target, draft)).generate(prompt, stop)
            assert res.token_ids == ref
            accepted += sum(s.accepted for s in res.stats.steps)
            drafted += sum(s.tree_size > 1 for s in res.stats.steps)
        assert drafted > 0
        if draft == tiny_dirs[family]:  # the target's own weights: its greedy continuation is the answer
            assert accepted >= SELF_ACCEPTED[method] * drafted


def test_a_chain_keeps_its_accepted_entries_and_trees_drop_theirs(tiny_targets, tiny_dirs):
    """After a step, the draft cache holds committed tokens only: a chain's accepted drafts stay (no
    recomputation), a tree's nodes go; every later step's catch-up starts where the cache ends."""
    target = tiny_targets[("llama", "native")]
    for method in ("chain@d3m", "eagle2@d3k3n8m"):
        d = _drafter(method, target, tiny_dirs["llama"])
        engine = Engine(target, d)
        res = engine.generate(PROMPTS[0], StopConfig(max_new_tokens=12, stop_on_eos=False))
        committed = len(PROMPTS[0]) + len(res.token_ids) - 1  # the last token is the root, never run
        assert d.draft.cache_length <= committed and d._kept == d.draft.cache_length
        if method.startswith("chain"):
            assert d.draft.cache_length > len(PROMPTS[0])  # accepted drafts were kept


def test_sampling_with_a_draft_model_is_reproducible(tiny_targets, draft_dir):
    target = tiny_targets[("llama", "native")]
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=3)
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    ref = Engine(target, None, sampling).generate(PROMPTS[1], stop).token_ids
    for method in ("chain@d3m", "eagle2@d3k3n8m"):
        assert Engine(target, _drafter(method, target, draft_dir), sampling).generate(PROMPTS[1], stop).token_ids == ref


def test_prefix_reuse_with_a_draft_model(tiny_targets, draft_dir):
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=16, stop_on_eos=False)
    engine = Engine(target, _drafter("chain@d3m", target, draft_dir), reuse_prefix=True)
    first = engine.generate(PROMPTS[2], stop).token_ids
    follow = PROMPTS[2] + first + [9, 10]  # a next turn: the first exchange is a kept prefix
    assert engine.generate(follow, stop).token_ids == Engine(target).generate(follow, stop).token_ids
    assert engine.generate(PROMPTS[0], stop).token_ids == Engine(target).generate(PROMPTS[0], stop).token_ids


def test_another_tokenizer_is_refused(tiny_targets, tmp_path):
    from ddspec.models.tiny import make_tiny_model_dir

    target = tiny_targets[("llama", "native")]
    other = make_tiny_model_dir(tmp_path / "other", "llama", vocab_size=160)  # more tokens: another vocabulary
    with pytest.raises(DdspecError, match="another tokenizer"):
        _drafter("chain@d3m", target, other)


def test_method_names_and_defaults(tiny_targets, tiny_dirs):
    target = tiny_targets[("llama", "native")]
    assert split_method("chain@d4m") == ("chain", {"depth": 4, "draft_model": True})
    with pytest.raises(ConfigError, match="--draft-model"):
        tree_config("chain@d4m")  # m without a draft model
    for bad in ("lookup@m", "eagle@m"):
        with pytest.raises(ConfigError):
            split_method(bad)
    assert _drafter("ddspec", target, tiny_dirs["llama"]).costs is not None  # its chain, priced here
    tree = TreeConfig(draft_model=str(tiny_dirs["llama"]))
    # no head for the tiny target: every tree method drafts with the draft model; a given head wins unless m
    assert uses_draft_model("eagle2", target, None, tree) and not uses_draft_model("lookup", target, None, tree)
    assert not uses_draft_model("eagle2", target, "random", tree) and uses_draft_model("eagle2@m", target, "random", tree)
    assert default_method(target, None, tree.draft_model) == "chain" and default_method(target, None) == "lookup"


def test_the_cli_drafts_with_a_draft_model(tiny_dirs, draft_dir):
    from test_cli import run_cli

    common = ["generate", "5 17 33 8 90", "--raw", "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "12"]
    plain = run_cli(*common, "--method", "vanilla")
    assert plain.returncode == 0, plain.stderr
    drafted = run_cli(*common, "--draft-model", str(draft_dir), "--method", "eagle2", "--depth", "3", "--tree-top-k",
                      "2", "--total-tokens", "6")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and "eagle2" in drafted.stderr
    missing = run_cli(*common, "--draft-model", str(draft_dir / "missing.gguf"))
    assert missing.returncode != 0 and "--draft-model" in missing.stderr and "Traceback" not in missing.stderr


def test_a_chain_goes_on_while_another_token_pays():
    """ChainCosts: before any measurement a chain of ``start`` tokens; then token k + 1 is drafted
    exactly when its reach probability P exceeds E_k (a + dV) / T_k (E_k expected tokens, T_k =
    max(k, 1) c + V(k + 1), a = c past the first token and 0 for the first (the catch-up gave it),
    dV the verification's growth per node, fitted to the sizes seen)."""
    import math

    from ddspec.draft.model import ChainCosts

    costs = ChainCosts(max_depth=8, start=3)
    assert [costs.more(0.0, k) for k in range(5)] == [True, True, True, False, False]
    costs.observe_level(10.0)
    costs.observe_verify(40.0, nodes=4)  # one size seen: verification taken as flat
    # p = 0.9 per token: P_k = 0.9^k; the first is free, then continue while P_{k+1} (40 + 10 k) > 10 E_k
    taken, e = [], 1.0
    for k in range(8):
        p = 0.9 ** (k + 1)
        want = k == 0 or p * (40 + 10 * k) > 10 * e
        assert costs.more(math.log(p), k) == want
        taken.append(want)
        if not want:
            break
        e += p
    assert taken == [True] * 6 + [False]  # 6 tokens: the 7th, 0.9^7 * 100 = 47.8 < 10 E_6 = 52.2, does not pay
    costs.observe_verify(30.0, nodes=1)  # now a line through (1, 30) and (4, 40): 10/3 ms a node more
    assert costs.verify_ms(1) == pytest.approx(30.0) and costs.verify_ms(7) == pytest.approx(50.0)
    steeper = [costs.more(math.log(0.9 ** (k + 1)), k) for k in range(8)]
    assert steeper.index(False) < 6  # rows that cost more: a shorter chain
    # the first token costs only its verified row once the draft model has caught up: drafted when
    # P_1 (c + V(1)) > dV, i.e. p > (10/3) / (10 + 30) here
    assert costs.more(math.log(0.1), 0) and not costs.more(math.log(0.05), 0)
    assert ChainCosts(max_depth=2).more(0.0, 2) is False  # never past the cap


def test_drafting_at_all_follows_what_each_kind_of_step_gave():
    """ChainCosts.draft_now: drafting first, then a plain step; afterwards whichever kind gave more
    tokens per ms, the other tried every ``explore_every`` steps, that wait doubling (to
    ``max_backoff``) while it stays the worse."""
    from ddspec.draft.model import ChainCosts

    costs = ChainCosts(max_depth=4)
    choices = []
    for _ in range(200):
        choices.append(costs.draft_now())
        costs.observe_step(2, 100.0) if costs.drafting else costs.observe_step(1, 40.0)  # plain: 1/40 > 2/100
    assert choices[:2] == [True, False]
    tries = [i for i, c in enumerate(choices) if c][1:]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:3] == [16, 32, 64] and max(gaps) == 64  # 8 x 2, 8 x 4, 8 x 8, then 8 x 8 each time
    assert sum(choices) < 12
    fast = ChainCosts(max_depth=4)
    picks = []
    for _ in range(100):
        picks.append(fast.draft_now())
        fast.observe_step(3, 100.0) if fast.drafting else fast.observe_step(1, 40.0)  # drafted: 3/100 > 1/40
    assert sum(picks) > 85


def test_a_backlog_catch_up_counts_as_one_draft_level():
    """The first drafted step feeds the draft model the whole prompt, one after plain steps every
    token they skipped: the rates count such a catch-up as one draft level, since drafting pays it
    once per switch, not once per step."""
    from ddspec.draft.model import ChainCosts

    costs = ChainCosts(max_depth=4)
    costs.draft_now()
    costs.observe_step(3, 200.0, backlog_ms=150.0)  # no level measured yet: the step as it was
    assert costs.choice.rates[:2] == [3, 200.0]
    costs.observe_level(10.0)
    costs.observe_step(3, 200.0, backlog_ms=150.0)  # 140 ms of backlog taken off
    assert costs.choice.rates[:2] == [0.9 * 3 + 3, 0.9 * 200.0 + 60.0]
    costs.observe_step(3, 200.0)
    assert costs.choice.rates[1] == 0.9 * (0.9 * 200.0 + 60.0) + 200.0


def test_plain_steps_leave_the_draft_cache_behind_and_a_catch_up_feeds_them(tiny_targets, tiny_dirs, monkeypatch):
    """The ddspec method with a draft model: a step that does not draft runs no draft forward; the
    next drafted step's catch-up feeds every skipped token; the output is plain decoding's."""
    from ddspec.draft.model import ChainCosts

    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    turn = iter(range(10**6))
    monkeypatch.setattr(ChainCosts, "draft_now", lambda self: setattr(self, "drafting", next(turn) % 3 == 0) or self.drafting)
    d = _drafter("ddspec@m", target, tiny_dirs["llama"])
    fed = []
    catch_up = d._catch_up
    monkeypatch.setattr(d, "_catch_up", lambda position: fed.append(position + 1 - d._kept) or catch_up(position))
    res = Engine(target, d).generate(PROMPTS[0], stop)
    assert res.token_ids == Engine(target).generate(PROMPTS[0], stop).token_ids
    steps = res.stats.steps
    assert sum(s.tree_size > 1 for s in steps) > 0 and sum(s.tree_size == 1 for s in steps) > len(steps) // 2
    assert len(fed) < len(steps) and max(fed[1:]) >= 2  # several tokens fed at once after plain steps
    assert fed[0] > 2  # the prompt: counted as a backlog (a drafted step leaves 1 or 2 tokens to feed)
    backlogs, fed2 = [], fed[len(fed):]  # (drafted, backlog_ms) per step; tokens each catch-up fed
    monkeypatch.setattr(d, "_catch_up", lambda position: fed2.append(position + 1 - d._kept) or catch_up(position))
    observe = d.costs.observe_step
    monkeypatch.setattr(d.costs, "observe_step", lambda t, ms, backlog_ms=None: backlogs.append(
        (d.costs.drafting, backlog_ms)) or observe(t, ms, backlog_ms))
    Engine(target, d).generate(PROMPTS[0], stop)
    drafted = [b for kind, b in backlogs if kind]
    assert drafted[0] > 0 and len(drafted) > 2  # the prompt's catch-up, then those after plain steps
    assert all((b is not None) == (n > 2) for b, n in zip(drafted, fed2))
