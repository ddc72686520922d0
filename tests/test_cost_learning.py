"""Costs that heal: the cost-aware method corrects a wrong calibration from the step times it
observes, chooses plain steps when drafting does not pay, and the calibration cache survives
bad files and unwritable folders. Deterministic: clocks are injected, never read."""

from __future__ import annotations

import io
import json
import math
import statistics
import sys

import pytest
import torch

from ddspec.calibrate import CostStore, Measurement, drafter_cost_key, load_or_measure, relative_spread
from ddspec.config import StopConfig, TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.tree import expand_level, expand_root
from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, LearnedCosts, linear_cost

VOCAB, K = 50, 10


SMALL = TreeConfig(top_k=4, depth=4, total_tokens=14, ddd_check_depths=(2, 4), max_depth=5)


def synthetic_logprobs(rows: int) -> torch.Tensor:
    """A confident draft: child probabilities 0.8, 0.1, then the rest spread thin."""
    p = torch.full((VOCAB,), 0.1 / (VOCAB - 2))
    p[0], p[1] = 0.8, 0.1
    return torch.log(p / p.sum()).expand(rows, VOCAB).clone()


def draft(policy: CostAwarePolicy):
    """The drafter's loop on synthetic outputs -> (levels, chosen node scores [N-1])."""
    candidates, frontier = expand_root(synthetic_logprobs(1)[0], K)
    level, best_child = 1, candidates.scores[:1]
    while policy.continue_after(level, candidates.scores[frontier], candidates.scores, best_child):
        logprobs = synthetic_logprobs(frontier.numel())
        best_child = logprobs.max(-1).values
        candidates, frontier = expand_level(candidates, frontier, logprobs, K)
        level += 1
    n = policy.tree_size(candidates.scores)
    return level, torch.sort(candidates.scores, descending=True).values[: n - 1]


def simulate(policy: CostAwarePolicy, true: CostModel, steps: int, seed: int = 0) -> list[tuple[int, int, float]]:
    """Steps whose times come from ``true`` (an injected clock) and whose nodes are accepted with
    probability exp(score) along the best path; returns (verified nodes, tokens, ms) per step,
    0 nodes for a plain step (no head work)."""
    gen = torch.Generator().manual_seed(seed)
    steps_done = []
    for _ in range(steps):
        if not policy.draft_now():
            ms = true.verify(torch.tensor([1])).item()
            policy.observe_step(1, 1, 0.0, ms, 0.5)
            steps_done.append((0, 1, ms + 0.5))
            continue
        levels, scores = draft(policy)
        n = scores.numel() + 1
        # nodes sorted by score; the chain of best children is accepted link by link
        accepted = torch.zeros(n - 1, dtype=torch.bool)
        for i in range(n - 1):
            if float(torch.rand((), generator=gen)) < math.exp(float(scores[i] - (scores[i - 1] if i else 0.0))):
                accepted[i] = True
            else:
                break
        policy.observe(scores, accepted)
        step_ms = true.verify(torch.tensor([n])).item() + true.other_ms
        tokens = int(accepted.sum()) + 1
        policy.observe_step(tokens, n, true.draft(levels), step_ms, 0.5)
        steps_done.append((n, tokens, true.draft(levels) + step_ms + 0.5))
    return steps_done


def sizes(steps) -> list[int]:
    return [n for n, _, _ in steps]


def rate(steps) -> float:
    return sum(t for _, t, _ in steps) / sum(ms for _, _, ms in steps)


TRUE = CostModel(verify_ms=linear_cost(10.0, 0.6), draft_root_ms=0.5, draft_level_ms=0.8, other_ms=1.0)


def planted_wrong(true: CostModel) -> CostModel:
    """What a calibration under load cached: one-token forwards 3x, bigger ones and the draft 10x too slow."""
    return CostModel(verify_ms={n: t * (3 if n == 1 else 10) for n, t in true.verify_ms.items()},
                     draft_root_ms=true.draft_root_ms * 10, draft_level_ms=true.draft_level_ms * 10,
                     other_ms=true.other_ms)


def test_a_wrong_calibration_stops_mattering_within_bounded_steps():
    right = CostAwarePolicy(TRUE, AcceptanceModel(), max_depth=11, max_tokens=60)
    informed = simulate(right, TRUE, 300)[-100:]
    target_size = statistics.median(sizes(informed))
    assert target_size >= 4  # the true costs pay for a real tree

    fooled = CostAwarePolicy(planted_wrong(TRUE), AcceptanceModel(), max_depth=11, max_tokens=60)
    first = simulate(fooled, TRUE, 8)
    assert statistics.median(sizes(first)) < target_size / 2  # it starts out believing big trees are dear
    later = simulate(fooled, TRUE, 300, seed=1)[-100:]  # within 200 steps it sizes as the truth says
    assert abs(statistics.median(sizes(later)) - target_size) <= 2  # (the rate is flat near its peak)
    assert rate(later) >= 0.95 * rate(informed)
    learned = fooled.cost
    for n in (1, 4, 8):
        truth = TRUE.verify(torch.tensor([n])).item() + TRUE.other_ms
        assert learned.verify(torch.tensor([n])).item() == pytest.approx(truth, rel=0.25)


def test_learned_costs_rescale_unobserved_sizes_from_observed_ones():
    costs = LearnedCosts(CostModel(verify_ms={1: 100.0, 4: 200.0, 16: 400.0}, draft_root_ms=10, draft_level_ms=20))
    costs.observe(1, 1, draft_ms=1.0, verify_ms=10.0, gap_ms=0.0, drafted=True)  # 10x faster than calibrated
    cur = costs.current
    assert cur.verify(torch.tensor([16])).item() == pytest.approx(40.0, rel=1e-6)  # no observation there yet
    assert cur.draft_level_ms == pytest.approx(2.0)  # levels scale with the root until one is observed
    assert costs.drift() == pytest.approx(math.log(10))


def test_the_cache_is_rewritten_for_a_lasting_drift_not_for_a_rare_size():
    base = CostModel(verify_ms={1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}, draft_root_ms=1.0, draft_level_ms=2.0)
    written = []
    policy = CostAwarePolicy(base, AcceptanceModel(), max_depth=4, max_tokens=8,
                             persist=lambda learned, why: written.append((learned, why)))

    def step(size: int, verify_ms: float) -> None:
        policy.drafting, policy.levels, policy.prediction = True, 2, (1.0, 10.0)  # root + one level: 1 + 2 ms
        policy.observe_step(1, size, draft_ms=3.0, verify_ms=verify_ms, gap_ms=0.0)

    for i in range(60):  # as calibrated, but twice a size met once at 2.5x its cost (a context switch)
        step(8, 60.0) if i % 30 == 5 else step(4, 16.0)
    assert policy.costs.drift() > math.log(2)  # it was seen, and is learned for this run
    assert written == []  # but two observations do not rewrite the cache
    for _ in range(10):
        step(4, 32.0)  # size 4 now costs twice the calibration, step after step
    assert len(written) == 1
    learned, why = written[0]
    assert learned.verify(torch.tensor([4])).item() > 24.0
    assert why.startswith("verifying 4: 16.00 ms calibrated")


def never_accepted(policy: CostAwarePolicy, steps: int, verify_extra_ms: float,
                   plain: tuple[int, int, float]) -> list[bool]:
    """Steps whose drafts are never accepted (drafting only adds cost); a plain step yields
    ``plain`` = (tokens, verified nodes, verify ms). Returns whether each step drafted."""
    def drafted(levels: int, scores: torch.Tensor) -> None:
        policy.observe(scores, torch.zeros(scores.numel(), dtype=torch.bool))
        n = scores.numel() + 1
        policy.observe_step(1, n, TRUE.draft(levels), TRUE.verify(torch.tensor([n])).item() + verify_extra_ms, 0.0)

    return play(policy, steps, drafted, lambda: policy.observe_step(plain[0], plain[1], 0.0, plain[2], 0.0))


def play(policy: CostAwarePolicy, steps: int, drafted, plain) -> list[bool]:
    """``steps`` steps as the policy chooses them: ``drafted(levels, scores)`` after drafting a tree
    with :func:`draft`, ``plain()`` otherwise. Whether each step drafted."""
    choices = []
    for _ in range(steps):
        drafting = policy.draft_now()
        choices.append(drafting)
        if drafting:
            drafted(*draft(policy))
        else:
            plain()
    return choices


def test_a_curve_that_says_one_token_costs_more_than_four_is_cut_down():
    """A calibration (or write-back) made while the CPU was busy can say verifying one token costs
    more than four; the policy uses what the larger sizes show instead, for drafted trees and for
    the plain step it compares them with."""
    poisoned = CostModel(verify_ms={1: 50.0, 2: 50.0, 3: 30.0, 4: 17.0, 8: 28.0}, draft_root_ms=1.0,
                         draft_level_ms=2.0, other_ms=2.0)
    assert poisoned.verify(torch.tensor([1, 3, 6])).tolist() == [17.0, 17.0, 22.5]
    costs = LearnedCosts(poisoned)
    assert [costs.current.verify_ms[n] for n in (1, 2, 3, 4, 8)] == [19.0, 19.0, 19.0, 19.0, 30.0]
    assert costs.plain_estimate() == 17.0  # not the calibration's 50 ms: no plain step observed yet
    costs.observe(4, 1, draft_ms=1.0, verify_ms=9.5, gap_ms=0.0, drafted=True)  # drafted steps run 2x faster
    assert costs.plain_estimate() == pytest.approx(9.5)  # a one-token step cannot cost more than that
    costs.observe(1, 0, draft_ms=0.0, verify_ms=8.0, gap_ms=0.0, drafted=False)
    assert costs.plain_estimate() == 8.0  # observed


def test_a_poisoned_calibration_does_not_hide_better_plain_steps():
    """The calibration says a one-token step costs 10x the truth; plain steps verify lookup chains
    (two tokens a step, which never teach the one-token cost) and drafting does not pay. The
    policy still finds out within a few hundred steps and settles on plain steps."""
    poisoned = CostModel(verify_ms={n: t * (10 if n <= 2 else 1) for n, t in TRUE.verify_ms.items()},
                         draft_root_ms=TRUE.draft_root_ms, draft_level_ms=TRUE.draft_level_ms, other_ms=TRUE.other_ms)
    policy = CostAwarePolicy(poisoned, AcceptanceModel(), max_depth=11, max_tokens=60)
    lookup_step = (2, 3, TRUE.verify(torch.tensor([3])).item())  # a lookup chain of 3 nodes, two accepted
    choices = never_accepted(policy, 300, verify_extra_ms=TRUE.other_ms, plain=lookup_step)
    assert sum(choices[-100:]) <= 100 / policy.explore_close + 2  # plain steps, but for exploration


def test_plain_steps_when_drafting_does_not_pay():
    # a draft that is never accepted: drafting only adds cost, so the policy settles on plain
    # steps, and still tries drafting now and then so that a better draft would be noticed
    policy = CostAwarePolicy(TRUE, AcceptanceModel(), max_depth=11, max_tokens=60)
    choices = never_accepted(policy, 500, verify_extra_ms=5.0, plain=(1, 1, TRUE.verify(torch.tensor([1])).item()))
    assert sum(choices[-200:]) <= 200 / policy.explore_close + 2  # plain steps, but for exploration
    assert any(choices[-200:])  # exploration continues
    first_plain = choices.index(False)
    tries = [i for i, c in enumerate(choices) if c and i > first_plain]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[-1] >= 1.9 * gaps[0]  # each confirming try waits ~2x longer


class FakeClock:
    """Time that moves only when the patched pieces of work say so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, ms: float) -> None:
        self.now += ms / 1e3


def test_engine_learns_from_an_injected_clock_and_rewrites_a_bad_cache_entry(tiny_targets, tmp_path, monkeypatch):
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    from ddspec.methods import make_drafter

    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    probe = EagleDrafter(head, target, SMALL)
    store = CostStore(drafter_cost_key(target, probe))
    assert store.write(Measurement(planted_wrong(TRUE), spread=0.5))
    drafter = make_drafter("ddspec", target, head, SMALL)
    assert drafter.cost_policy.cost.verify(torch.tensor([1])).item() == pytest.approx(31.0)  # the planted entry

    clock = FakeClock()
    forward, run, logprobs = target.forward, drafter._run, drafter.logprobs
    monkeypatch.setattr(target, "forward", lambda tokens, *a, **k: (
        clock.spend(TRUE.verify(torch.tensor([tokens.numel()])).item()), forward(tokens, *a, **k))[1])
    monkeypatch.setattr(drafter, "_run", lambda *a, **k: (clock.spend(TRUE.draft_level_ms), run(*a, **k))[1])
    monkeypatch.setattr(drafter, "logprobs", lambda hidden: (  # the root's distribution: one row
        clock.spend(TRUE.draft_root_ms if hidden.shape[0] == 1 else 0.0), logprobs(hidden))[1])
    engine = Engine(target, drafter, clock=clock)
    ref = Engine(target).generate([5, 17, 33], StopConfig(max_new_tokens=80, stop_on_eos=False)).token_ids
    res = engine.generate([5, 17, 33], StopConfig(max_new_tokens=80, stop_on_eos=False))
    assert res.token_ids == ref
    assert any(s.draft_ms == 0.0 for s in res.stats.steps)  # plain steps: no head work (a lookup chain at most)
    entry = json.loads(store.path.read_text())
    assert entry["source"] == "learned"  # the planted entry was corrected for the next run
    assert entry["verify_ms"]["1"] == pytest.approx(TRUE.verify_ms[1], rel=0.3)
    assert probe.hidden_layers == ()


def test_costs_learned_while_other_programs_load_the_cpu_are_not_saved(tiny_targets, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    from ddspec.machine import OtherLoad
    from ddspec.methods import make_drafter

    monkeypatch.setattr(OtherLoad, "share", lambda self: 0.9)
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    store = CostStore(drafter_cost_key(target, EagleDrafter(head, target, SMALL)))
    assert store.write(Measurement(planted_wrong(TRUE), spread=0.0))
    before = store.path.read_text()
    drafter = make_drafter("ddspec", target, head, SMALL)
    drafter.cost_policy.drift_limit, drafter.cost_policy.min_steps = -1.0, 1  # a write-back is due at once
    Engine(target, drafter).generate([5, 17, 33], StopConfig(max_new_tokens=12, stop_on_eos=False))
    err = capsys.readouterr().err
    assert "other programs used 90% of the CPU" in err and "not saved" in err
    assert store.path.read_text() == before


def test_a_calibration_measured_while_other_programs_load_the_cpu_is_used_but_not_cached(
        tiny_targets, tmp_path, monkeypatch, capsys):
    """A first run beside a busy program measures its step costs under that load: they steer this run
    (and are corrected as it goes), and the next run measures them again on its own machine."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    from ddspec.machine import OtherLoad

    target = tiny_targets[("llama", "native")]
    drafter = EagleDrafter(random_head(target.hf_config, seed=4).eval().requires_grad_(False), target, SMALL)
    monkeypatch.setattr(OtherLoad, "share", lambda self: 0.8)
    m, store = load_or_measure(target, drafter, progress=False)
    assert m.source == "calibrated" and m.cost.verify_one(1) > 0
    assert "the step costs: not cached (other programs used 80% of the CPU" in capsys.readouterr().err
    assert not store.path.exists()
    monkeypatch.setattr(OtherLoad, "share", lambda self: 0.0)
    load_or_measure(target, drafter, progress=False)
    assert store.read() is not None


def test_other_programs_share_of_the_cpu_is_measured(monkeypatch):
    from ddspec.machine import OtherLoad, cpu_busy_seconds

    monkeypatch.undo()  # the real measurement, not conftest's quiet machine
    if cpu_busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    probe = OtherLoad()
    x = 0
    for i in range(2_000_000):  # this process's own work is not counted as others'
        x += i
    share = probe.share()
    assert share is not None and 0.0 <= share <= 1.0


def test_corrupt_cost_entry_is_measured_again_with_a_notice(tiny_targets, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    drafter = EagleDrafter(head, target, SMALL)
    store = CostStore(drafter_cost_key(target, drafter))
    store.path.parent.mkdir(parents=True)
    store.path.write_text('{"key": {"format": 3}, "verify_ms": {"1": 4')  # cut off mid-write
    m, _ = load_or_measure(target, drafter, progress=False)
    assert "unreadable" in capsys.readouterr().err
    assert m.source == "calibrated" and json.loads(store.path.read_text())["key"] == store.key


def test_unwritable_cache_still_generates_and_says_so_once(tiny_targets, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("DDSPEC_CACHE", str(blocker))
    from ddspec.methods import make_drafter

    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    drafter = make_drafter("ddspec", target, head, SMALL)
    drafter.cost_policy.drift_limit, drafter.cost_policy.min_steps = 0.0, 1  # force a write-back attempt too
    res = Engine(target, drafter).generate([5, 17, 33], StopConfig(max_new_tokens=20, stop_on_eos=False))
    assert len(res.token_ids) == 20
    err = capsys.readouterr().err
    assert err.count("the step costs: not cached (cannot write the cache") == 1 and "DDSPEC_CACHE" in err


def test_relative_spread():
    assert relative_spread({1: [10.0, 10.0, 10.0], 2: [20.0, 20.0]}) == 0.0
    assert relative_spread({1: [10.0, 11.0, 12.0, 13.0, 30.0]}) == pytest.approx((13 - 11) / 12)


def test_a_head_reading_layers_the_target_lacks_is_refused(tiny_targets):
    from ddspec.errors import ConfigError

    target = tiny_targets[("llama", "native")]
    layers = target.info.num_layers
    cfg = {**target.hf_config, "fuse_layers": [1, layers + 3]}
    from ddspec.draft.head import EagleHead

    head = EagleHead(cfg).eval()
    with pytest.raises(ConfigError, match=f"layer {layers + 3}.*{layers} layers"):
        EagleDrafter(head, target, SMALL)


@pytest.mark.parametrize("command, stdin", [("generate", ""), ("chat", "Hello!\nAgain.\n/exit\n")])
def test_the_cache_update_notice_waits_until_the_answer_is_written(tiny_dirs, tmp_path, monkeypatch, command, stdin):
    """The entry is rewritten during the answer, but the notice saying so comes after the answer and
    its summary: on a terminal a line on stderr would land in the middle of the streamed text."""
    from ddspec.cli import main
    from ddspec.tree import cost

    class EagerPolicy(CostAwarePolicy):  # finds the cached entry off after its first step
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs, drift_limit=-1.0, min_steps=1)

    monkeypatch.setattr(cost, "CostAwarePolicy", EagerPolicy)
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    terminal = io.StringIO()  # stdout and stderr in the order they were written, as a terminal shows them
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    args = [command, "--model", str(tiny_dirs["llama"]), "--head", "random:4", "--method", "ddspec",
            "--max-new-tokens", "8", "--threads", "2"] + (["hello"] if command == "generate" else [])
    assert main(args) == 0
    out = terminal.getvalue()
    notice = "differ from the cached calibration"
    assert out.count(notice) == 1  # once per run, after the first answer
    assert out.index("[ddspec] tau") < out.index(notice)  # after the answer and both summary lines
    entries = [json.loads(p.read_text()) for p in (tmp_path / "costs").glob("*.json")]
    assert [e["source"] for e in entries] == ["learned"]


def test_the_choice_follows_whether_this_step_has_a_lookup_chain():
    """Where the context's ending occurred before, a plain step verifies the lookup's chain and
    yields several tokens; elsewhere it yields one. Drafting pays against the second, not the
    first: the policy decides per step, from the rate of plain steps like the one at hand."""
    policy = CostAwarePolicy(TRUE, AcceptanceModel(), max_depth=11, max_tokens=60)
    lookup_ms, plain_ms = TRUE.verify(torch.tensor([4])).item(), TRUE.verify(torch.tensor([1])).item()
    choices = {True: [], False: []}
    for step in range(400):
        chain = step % 3 == 0  # one step in three has a chain
        drafting = policy.draft_now(chain)
        choices[chain].append(drafting)
        if drafting:  # the best path's first two nodes accepted: 3 tokens
            levels, scores = draft(policy)
            accepted = torch.zeros(scores.numel(), dtype=torch.bool)
            accepted[:2] = True
            policy.observe(scores, accepted)
            n = scores.numel() + 1
            policy.observe_step(3, n, TRUE.draft(levels), TRUE.verify(torch.tensor([n])).item() + TRUE.other_ms, 0.0)
        elif chain:  # a 3-token chain, all accepted: 4 tokens
            policy.observe_step(4, 4, 0.0, lookup_ms, 0.0)
        else:
            policy.observe_step(1, 1, 0.0, plain_ms, 0.0)
    assert policy.plain_rate(True) > policy.draft_rate() > policy.plain_rate(False)
    late = {c: v[-60:] for c, v in choices.items()}
    assert sum(late[True]) <= 60 / policy.explore_close + 2  # chain steps stay plain, but for exploration
    assert sum(late[False]) >= 60 - (60 / policy.explore_close + 2)  # the others draft


def test_the_cost_key_tells_the_draft_weights_apart(tiny_targets, monkeypatch):
    """A head drafting on other kernels has other draft costs: its own cache entry, named by the
    weights the drafter was built with (not by the setting read later). Q8_0's keys (made
    before the field existed) stay as they were."""
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    drafters = {}
    for weights in ("q8_0", "q4_1a8", "exact"):
        monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", weights)
        drafters[weights] = EagleDrafter(head, target, SMALL)
    monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", "q8_0a8")  # changed after the drafters were built
    keys = {w: drafter_cost_key(target, d) for w, d in drafters.items()}
    assert "draft_weights" not in keys["q8_0"]
    assert keys["q4_1a8"]["draft_weights"] == "q4_1a8" and keys["exact"]["draft_weights"] == "exact"
    assert len({json.dumps(k, sort_keys=True) for k in keys.values()}) == 3


def as_forecast_but_slower(policy: CostAwarePolicy, steps: int, hidden_ms: float) -> list[bool]:
    """Drafted steps that yield the tokens their forecast says and take its time plus ``hidden_ms``
    the forecasts do not see (the draft phase's catch-up, reported as a whole-phase time); plain
    steps one token at TRUE's one-token cost plus its other costs. Whether each step drafted."""
    plain_ms = TRUE.verify(torch.tensor([1])).item() + TRUE.other_ms

    def drafted(levels: int, scores: torch.Tensor) -> None:
        policy.observe(scores, torch.rand(scores.numel()) < scores.exp())
        tokens, ms = policy.prediction
        draft_ms = TRUE.draft(levels)
        policy.observe_step(round(tokens), scores.numel() + 1, None, ms - draft_ms, 0.0, phase_ms=draft_ms + hidden_ms)

    return play(policy, steps, drafted, lambda: policy.observe_step(1, 1, 0.0, plain_ms, 0.0))


def test_what_the_forecasts_leave_out_is_measured_and_counted():
    """Drafted steps that cost more than their forecasts say (work outside the priced phases, e.g. the
    head catching up) lower the drafted rate the policy compares with plain steps: with 30 ms a step
    unseen the policy settles on plain steps; with none it keeps drafting."""
    torch.manual_seed(0)
    honest = CostAwarePolicy(TRUE, AcceptanceModel(), max_depth=11, max_tokens=60)
    assert sum(as_forecast_but_slower(honest, 300, hidden_ms=0.0)[-100:]) >= 80
    assert honest.bias() == pytest.approx(1.0, abs=0.25)
    torch.manual_seed(0)
    unseen = CostAwarePolicy(TRUE, AcceptanceModel(), max_depth=11, max_tokens=60)
    assert sum(as_forecast_but_slower(unseen, 300, hidden_ms=30.0)[-100:]) <= 100 / unseen.explore_close + 2
    assert unseen.bias() < 0.8


def test_the_calibration_times_small_sizes_as_decoding_meets_them(tiny_targets, monkeypatch):
    """The forwards right after a large one can be slower than in decoding: the calibration times
    the sizes largest first, each after SETTLE untimed one-token forwards, so the small sizes' costs
    are not inflated by the large ones timed before them."""
    import time

    from ddspec.calibrate import measure_once

    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    drafter = EagleDrafter(head, target, SMALL)
    forward, since = target.forward, {"large": 99}

    def slow_after_large(tokens, *a, **k):  # 2 ms + 0.5 ms a token, 30 ms more for the 2 forwards after a 64-token one
        time.sleep(0.002 + 0.0005 * tokens.numel() + (0.030 if since["large"] < 2 else 0.0))
        since["large"] = 0 if tokens.numel() >= 64 else since["large"] + 1
        return forward(tokens, *a, **k)

    monkeypatch.setattr(target, "forward", slow_after_large)
    cost = measure_once(target, drafter, sizes=(1, 2, 64), reps=3).cost
    assert cost.verify_ms[1] < 10 and cost.verify_ms[2] < 10  # the 30 ms penalty landed on no timed small size


def test_what_a_policy_learned_survives_a_new_process():
    """snapshot / restore carry the rates, acceptance counts, chain statistics and learned costs
    (through JSON), the acceptance counts scaled down to ``memory_cap`` per bin."""
    base = CostModel(verify_ms={1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}, draft_root_ms=1.0, draft_level_ms=2.0)
    policy = CostAwarePolicy(base, AcceptanceModel(), max_depth=4, max_tokens=8)
    never_accepted(policy, 120, verify_extra_ms=5.0, plain=(2, 3, 11.0))
    for _ in range(300):
        policy.observe(torch.tensor([-0.1, -2.0]), torch.tensor([True, False]))
    policy.observe_chain(3, 3, 2)
    fresh = CostAwarePolicy(base, AcceptanceModel(), max_depth=4, max_tokens=8)
    assert fresh.draft_rate() is None  # a new policy must try drafting before it can judge it
    fresh.restore(json.loads(json.dumps(policy.snapshot())))
    assert fresh.draft_rate() == pytest.approx(policy.draft_rate())
    assert fresh.plain_rate(True) == pytest.approx(policy.plain_rate(True))
    assert fresh.plain_rate(False) == pytest.approx(policy.plain_rate(False))
    assert fresh.costs.current.verify_ms == pytest.approx(policy.costs.current.verify_ms)
    assert max(fresh.acceptance.seen) == pytest.approx(fresh.memory_cap)
    assert fresh.acceptance.prob([-0.1, -2.0]) == pytest.approx(policy.acceptance.prob([-0.1, -2.0]), abs=0.02)
    assert fresh._chain_stats[3] == policy._chain_stats[3]
    assert fresh.draft_now() == policy.draft_now()


def test_the_ddspec_method_starts_from_the_last_runs_memory(tiny_targets, tmp_path, monkeypatch):
    """With DDSPEC_POLICY_MEMORY on, a new ddspec drafter (a new `ddspec generate`) takes up what
    the last one saved for the same set-up, and nothing from another set-up's file."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("DDSPEC_POLICY_MEMORY", "1")
    from ddspec.calibrate import PolicyMemory
    from ddspec.methods import make_drafter

    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    first = make_drafter("ddspec", target, head, SMALL)
    Engine(target, first).generate([5, 17, 33], StopConfig(max_new_tokens=40, stop_on_eos=False))
    learned = first.cost_policy
    assert learned.steps_seen > 0 and learned.remember is not None
    learned.remember(learned.snapshot())  # what the exit handler does
    files = list((tmp_path / "costs").glob("*.policy.json"))
    assert len(files) == 1
    second = make_drafter("ddspec", target, head, SMALL).cost_policy
    assert second._drafted == learned._drafted and second._plain_steps == learned._plain_steps
    assert second.steps_seen == 0
    assert second.costs.plain_seen == learned.costs.plain_seen  # the cost corrections too (same calibration)
    store = CostStore(drafter_cost_key(target, EagleDrafter(head, target, SMALL)))
    assert store.write(Measurement(planted_wrong(TRUE), spread=0.0, measured="2030-01-01 00:00:00"))
    third = make_drafter("ddspec", target, head, SMALL).cost_policy  # a new calibration (as after --refresh)
    assert third._drafted == learned._drafted  # the rates are remembered ...
    assert third.costs.plain_seen == 0  # ... the corrections of the old calibration are not
    memory = PolicyMemory(store)
    assert "plain steps" in memory.describe() and "drafted" in memory.describe()
    memory.forget()  # what `ddspec calibrate --refresh` does
    assert "none yet" in memory.describe()
    assert make_drafter("ddspec", target, head, SMALL).cost_policy._drafted == 0
    learned.remember(learned.snapshot())
    other = make_drafter("ddspec", target, random_head(target.hf_config, seed=5).eval().requires_grad_(False), SMALL)
    assert other.cost_policy._drafted == 0  # another head: another set-up, nothing remembered
    broken = learned.snapshot()
    del broken["acceptance"]["seen"]  # a layout it cannot read, after some fields were taken up
    learned.remember(broken)
    half = make_drafter("ddspec", target, head, SMALL).cost_policy
    assert half._drafted == 0 and half._plain_steps == 0  # not half taken up: afresh
    monkeypatch.setenv("DDSPEC_POLICY_MEMORY", "0")
    assert make_drafter("ddspec", target, head, SMALL).cost_policy._drafted == 0


def test_seeded_sampling_does_not_depend_on_the_memory(tiny_targets, tmp_path, monkeypatch):
    """A seeded sample is the same run after run: the policy keeps what it took up from earlier
    runs (their timings) and sizes other trees from it, and the tokens stay the same (each one is
    drawn with its position's uniform, docs/design.md §2.5)."""
    from ddspec.config import SamplingConfig
    from ddspec.methods import make_drafter

    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("DDSPEC_POLICY_MEMORY", "1")
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    seeded = SamplingConfig(temperature=0.8, seed=3)
    stop = StopConfig(max_new_tokens=40, stop_on_eos=False)
    learner = make_drafter("ddspec", target, head, SMALL)
    for _ in range(3):
        Engine(target, learner).generate([5, 17, 33], stop)  # greedy runs learn (and would pass it on)
    state = learner.cost_policy.snapshot()
    state["_drafted"], state["_draft_tokens"], state["_draft_ms"] = 50.0, 1.0, 1000.0  # drafting looks hopeless
    learner.cost_policy.remember(state)
    monkeypatch.setenv("DDSPEC_POLICY_MEMORY", "0")  # the same calibration entry, no memory
    fresh = Engine(target, make_drafter("ddspec", target, head, SMALL), seeded).generate([5, 17, 33], stop).token_ids
    monkeypatch.setenv("DDSPEC_POLICY_MEMORY", "1")
    remembering = make_drafter("ddspec", target, head, SMALL)
    assert remembering.cost_policy._drafted == 50.0  # the memory was taken up ...
    again = Engine(target, remembering, seeded).generate([5, 17, 33], stop)
    assert remembering.cost_policy.steps_seen > 0  # ... kept, and learned from under the seed
    assert again.token_ids == fresh


def test_the_cost_key_tells_the_kv_cache_apart(tiny_targets, monkeypatch):
    """An fp16 KV cache (the int8 model's default) reads half the bytes in attention: other costs,
    its own cache entry; an fp32 cache keeps the key it always had."""
    import torch

    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    drafter = EagleDrafter(head, target, SMALL)
    plain = drafter_cost_key(target, drafter)
    monkeypatch.setattr(target, "kv_dtype", torch.float16)
    half = drafter_cost_key(target, drafter)
    assert "kv_cache" not in plain and half["kv_cache"] == "float16"
    assert {k: v for k, v in half.items() if k != "kv_cache"} == plain
