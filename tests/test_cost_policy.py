"""The cost-aware policy on synthetic cost curves (no model): it grows big trees when
verification is flat (GPU-like), short chains when it is steep, and stops earlier when a
draft level is dear."""

from __future__ import annotations

import math

import torch

from ddspec.tree import expand_level, expand_root
from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, flat_cost, linear_cost

VOCAB = 50
K = 10


def synthetic_logprobs(rows: int) -> torch.Tensor:
    """A confident draft: child probabilities 0.8, 0.1, 0.05, ... for every node."""
    p = torch.full((VOCAB,), 0.05 / (VOCAB - 2))
    p[0], p[1] = 0.8, 0.1
    p = p / p.sum()
    return torch.log(p).expand(rows, VOCAB).clone()


def grow(policy: CostAwarePolicy) -> tuple[int, int]:
    """Run the drafter's loop with synthetic draft outputs; return (levels, verified nodes)."""
    candidates, frontier = expand_root(synthetic_logprobs(1)[0], K)
    level = 1
    best_child = candidates.scores[:1]
    while policy.continue_after(level, candidates.scores[frontier], candidates.scores, best_child):
        logprobs = synthetic_logprobs(frontier.numel())
        best_child = logprobs.max(-1).values
        candidates, frontier = expand_level(candidates, frontier, logprobs, K)
        level += 1
    return level, policy.tree_size(candidates.scores)


def policy(verify: dict[int, float], level_ms: float = 1.0, max_depth: int = 11, max_tokens: int = 60):
    cost = CostModel(verify_ms=verify, draft_root_ms=level_ms, draft_level_ms=level_ms, other_ms=1.0)
    return CostAwarePolicy(cost, AcceptanceModel(), max_depth=max_depth, max_tokens=max_tokens)


def test_flat_verification_grows_eagle2_sized_trees():
    levels, size = grow(policy(flat_cost(20.0)))
    assert levels >= 6 and size >= 40  # verification is free: draft deep and verify a lot


def test_steep_verification_shrinks_to_a_short_chain():
    levels, size = grow(policy(linear_cost(10.0, 10.0)))  # each extra token costs as much as the first
    assert size <= 5
    assert levels <= 5


def test_costly_draft_level_stops_earlier():
    cheap_levels, _ = grow(policy(flat_cost(20.0), level_ms=0.5))
    dear_levels, _ = grow(policy(flat_cost(20.0), level_ms=15.0))
    assert dear_levels < cheap_levels


def test_size_is_the_argmax_of_the_rate():
    p = policy(linear_cost(20.0, 1.0))
    scores = torch.log(torch.tensor([0.9, 0.8, 0.7, 0.3, 0.1, 0.05, 0.01]))
    rates = p.rates(scores.tolist(), levels=3)
    n, best = p.best(scores, levels=3)
    assert n == rates.index(max(rates)) + 1 and math.isclose(best, max(rates))
    assert 1 < n <= 8


def test_acceptance_model_learns_from_verdicts():
    model = AcceptanceModel(prior_weight=5.0)
    scores = torch.full((200,), -0.1)  # the draft believes 90%
    assert abs(model.prob([-0.1])[0] - math.exp(-0.1)) < 1e-6
    model.update(scores, torch.zeros(200, dtype=torch.bool))  # ... but nothing is ever accepted
    assert model.prob([-0.1])[0] < 0.05
    assert abs(model.prob([-3.0])[0] - math.exp(-3.0)) < 1e-6  # other bins keep their prior


def test_acceptance_bins_are_torch_bucketize_bins():
    """A score falls in bin bisect_left(edges, score): torch.bucketize's bins (right=False), edges included."""
    model = AcceptanceModel()
    scores = [-20.0, -12.0, -11.9, -3.0, -2.75, -0.05, -0.01, 0.0, 0.5] + [-5.0 + 0.37 * i for i in range(14)]
    bins = torch.bucketize(torch.tensor(scores, dtype=torch.float64), torch.tensor(model.edges, dtype=torch.float64))
    for score, b in zip(scores, bins.tolist()):
        model.update([score], [True])
        assert model.seen[b] == model.accepted[b] and model.seen[b] >= 1.0, score
    assert sum(model.seen) == len(scores)


def test_verify_interpolation():
    cost = CostModel(verify_ms={1: 10.0, 4: 16.0, 16: 40.0}, draft_root_ms=0, draft_level_ms=0)
    got = cost.verify(torch.tensor([1, 2, 4, 10, 16, 32]))
    assert torch.allclose(got, torch.tensor([10.0, 12.0, 16.0, 28.0, 40.0, 72.0], dtype=torch.float64))


def test_frontier_keeps_only_nodes_whose_children_could_be_verified():
    """After continue_after, the head runs on the frontier nodes ranked within the size the policy
    expects to verify (+1 of slack): a steep verify curve leaves a few rows of ten; a flat one
    keeps them all; the best frontier node always stays."""
    for verify in (linear_cost(10.0, 1.0), linear_cost(10.0, 0.5), flat_cost()):
        p = policy(verify)
        candidates, frontier = expand_root(synthetic_logprobs(1)[0], K)
        assert p.continue_after(1, candidates.scores[frontier], candidates.scores, candidates.scores[:1])
        kept = frontier[p.frontier_rows(candidates.scores.tolist(), frontier.tolist())]
        assert kept.numel() == min(p.next_size, K) and 0 in kept.tolist()  # the best root child stays
        if verify != flat_cost():
            assert kept.numel() < K
        dropped = [i for i in frontier.tolist() if i not in kept.tolist()]
        if dropped:  # every dropped node scores no better than the kept ones
            assert candidates.scores[dropped].max() <= candidates.scores[kept].min()
    p = policy(linear_cost(10.0, 1.0))
    p.next_size = 1  # even when nothing more is expected to fit, the best node stays
    scores = [-2.0, -0.1, -3.0]
    assert p.frontier_rows(scores, [0, 1, 2]) == [1]
    assert p.frontier_rows(scores, [2, 0]) == [1]


def test_a_size_probe_does_not_lower_the_forecast_rate_of_drafting():
    """Now and then a drafted step verifies a bigger tree than the best one, to measure its cost.
    Such a step is a measurement: the drafted rate the policy compares with plain steps is made
    of the best size's forecasts, so probes do not talk it out of drafting (its measured-over-forecast
    bias compares each step with the probed size's own forecast). The step's own prediction (what the
    engine reports) stays the probed size's."""
    scores = torch.log(torch.tensor([0.9, 0.5, 0.3, 0.1, 0.05]))
    p = policy(linear_cost(10.0, 6.0), max_tokens=8)
    tokens = ms = 0.0
    for step in range(p.min_drafted):
        p.draft_now(chain=None)
        p.levels = 2
        p._probe_size = step % 2 == 1  # every other step a probe
        n = p.tree_size(scores)
        best, _ = p.best(scores, 2)
        assert n > best if p._probe_size else n == best
        gains = p._gains(scores.tolist())
        assert math.isclose(p.prediction[0], gains[n - 1])  # the probed tree's own forecast
        d = p.forecast_decay
        tokens, ms = tokens * d + gains[best - 1], ms * d + p._step_ms(2, best)[best - 1]  # the best tree's
        p.observe_step(tokens=2, tree_size=n, draft_ms=2.0, verify_ms=20.0, gap_ms=0.0)
    assert math.isclose(p.draft_rate() / p.bias(), tokens / ms, rel_tol=1e-9)  # the forecasts' part of the rate


def test_lookup_chains_are_cut_where_verifying_them_does_not_pay():
    """chain_length: a continuation's tokens are verified while their learned acceptance pays for the
    plain steps' measured verify costs; a weak n-gram order is cut on a steep curve, kept on a flat one."""
    flat = policy(flat_cost(10.0))
    assert flat.chain_length(1, 3) == 3  # verifying more costs nothing: every token is worth a try
    assert flat.chain_length(2, 0) == 0 and flat.chain_length(0, 3) == 0
    steep = policy(linear_cost(10.0, 5.0))  # each verified token costs half a plain step more
    for _ in range(50):  # order-1 chains: their first token accepted 1 time in 10
        steep.observe_chain(1, 1, 0)
    for _ in range(5):
        steep.observe_chain(1, 1, 1)
    for _ in range(50):  # order-3 chains: almost always accepted
        steep.observe_chain(3, 3, 3)
    assert steep.chain_length(3, 3) == 3
    lengths = [steep.chain_length(1, 3) for _ in range(steep.chain_explore)]
    assert lengths[:-1] == [0] * (steep.chain_explore - 1) and lengths[-1] == 1  # cut, with a probe now and then
    # the plain steps' own times replace the calibrated curve where they were measured: the curve's
    # estimate counts as one step, and each step moves the estimate by at most half of it
    curve = steep.costs.plain_verify(3)
    assert math.isclose(curve, steep.costs.plain_verify(1) * 20.0 / 10.0)
    steep.costs.observe(3, 0, 0.0, 11.0, 0.0, drafted=False)  # a plain step verifying a 2-token chain: 11 ms
    assert 11.0 < steep.costs.plain_verify(3) < curve
    for _ in range(40):
        steep.costs.observe(3, 0, 0.0, 11.0, 0.0, drafted=False)
    assert math.isclose(steep.costs.plain_verify(3), 11.0, rel_tol=1e-2)
    assert math.isclose(steep.costs.plain_verify(2), steep.costs.plain_verify(1) * 15.0 / 10.0)


def test_one_slow_step_does_not_price_a_chain_size_out():
    """A single slow step at a chain size met rarely (another program's burst) used to become that
    size's cost outright, and a size believed that dear was never verified again, so never corrected.
    Now a step moves the estimate by at most half of it, a lasting change still gets through, and a
    remembered cost far above the curve's is learnt again."""
    steep = policy(linear_cost(10.0, 5.0))
    curve = steep.costs.plain_verify(7)
    steep.costs.observe(7, 0, 0.0, 10 * curve, 0.0, drafted=False)
    assert steep.costs.plain_verify(7) <= curve * (1 + steep.costs.chain_step_limit)
    for _ in range(30):  # the machine really got slower: the estimate follows
        steep.costs.observe(7, 0, 0.0, 1.5 * curve, 0.0, drafted=False)
    assert math.isclose(steep.costs.plain_verify(7), 1.5 * curve, rel_tol=1e-2)
    remembered = steep.costs.snapshot()
    remembered["chain_ms"]["6"] = [3 * steep.costs.plain_verify(6), 5.0]  # a poisoned memory
    again = policy(linear_cost(10.0, 5.0))
    again.costs.restore(remembered)
    assert 6 not in again.costs.chain_ms and 7 in again.costs.chain_ms  # over 2x the curve's cost: dropped
    assert again.costs.plain_verify(6) == again.costs.curve_verify(6)


def test_beside_a_batch_a_tree_that_cannot_pay_is_neither_drafted_nor_tried():
    """Beside 15 other sequences, where each row costs the whole batch as much as a token is worth
    (a forward's cost linear in its rows), no chain the head usually drafts can beat plain decoding:
    the slot takes plain steps without trying a drafted one (a try would cost every sequence), even
    before it has any measured drafted step. Where a forward costs the same whatever its rows and
    drafting costs little, a tree may pay and is drafted; alone, the single-stream choice is untouched."""
    steep = policy(linear_cost(2.0, 2.0, n_max=256))
    steep.batch = (15, 15.0, 0.0)
    assert not steep.may_pay()
    assert [steep.draft_now() for _ in range(100)] == [False] * 100
    steep.batch = (0, 0.0, 0.0)
    assert steep.may_pay() and steep.draft_now()  # alone: no drafted step measured yet, so it drafts
    flat = policy(flat_cost(20.0, n_max=256), level_ms=0.01)
    flat.batch = (15, 15.0, 0.0)
    assert flat.may_pay() and flat.draft_now()


def test_a_step_held_back_by_the_batch_teaches_nothing_and_its_forecast_is_kept():
    """Held back by the batch worker (plain_only), a slot's step is its root's row among the others':
    its time is no plain step's alone nor a tree's, so nothing it measured moves the learned costs or
    the plain rate a lone sequence uses, and nothing is saved; its forecast is the batch's plain step,
    priced once per pricing (every sequence holds every step) and as priced afresh."""
    steep = policy(linear_cost(2.0, 2.0, n_max=256))
    steep.batch = (15, 15.0, 0.0)
    steep.plain_only = True
    saved = []
    steep.remember = saved.append
    before = steep.snapshot()
    costs = steep.costs.snapshot()
    for _ in range(40):
        assert not steep.hold()
        steep.observe_step(16, 1, 0.1, 50.0, 0.5)
    assert steep.snapshot() == before and steep.costs.snapshot() == costs and steep.steps_seen == 40
    steep.steps_seen = steep.SAVE_EVERY - 1
    steep.observe_step(16, 1, 0.1, 50.0, 0.5)
    assert not saved  # nothing learned, nothing written
    assert steep.prediction == (16.0, steep._batch_plain_ms())
    steep.batch = (3, 3.0, 0.0)
    steep.hold()
    assert steep.prediction == (4.0, steep._batch_plain_ms())
    steep.plain_only = False  # allowed to draft, a plain step beside the batch counts as before
    steep.hold()
    steep.observe_step(4, 1, 0.1, 20.0, 0.5)
    assert steep.snapshot() != before


def test_beside_a_batch_the_table_is_not_searched_where_no_chain_of_its_orders_could_pay():
    """chains_may_pay: beside 15 sequences on a forward whose every row costs the batch, a table
    match whose first token is accepted 1 time in 50 cannot pay for its row, so the lookup is told
    not to search the table, except every chain_explore-th time (its acceptance stays measured); an
    order accepted almost always still may; alone the question is chain_length's: always yes."""
    steep = policy(linear_cost(10.0, 0.5, n_max=256))  # a row costs the batch half a ms
    for _ in range(50):
        steep.observe_chain(102, 1, 0)  # a table order: rarely accepted
        steep.observe_chain(3, 3, 3)  # a three-token context match: almost always
    steep.observe_chain(102, 1, 1)
    steep.batch = (15, 15.0, 0.0)
    answers = [steep.chains_may_pay((102,), 3) for _ in range(2 * steep.chain_explore)]
    assert answers.count(True) == 2 and answers[steep.chain_explore - 1] and answers[-1]
    assert steep.chains_may_pay((102, 3), 3)  # any order that pays
    assert steep.chains_pay((102, 3), 3) and not any(steep.chains_pay((102,), 3) for _ in range(40))  # no tries
    assert steep.chain_length(3, 3) == 3
    steep.plain_only = True  # held back by the batch: no chain at all
    assert not steep.chains_may_pay((3,), 3) and steep.chain_length(3, 3) == 0
    steep.plain_only, steep.batch = False, (0, 0.0, 0.0)
    assert all(steep.chains_may_pay((102,), 3) for _ in range(20))


def test_a_step_beside_another_sequences_prompt_chunk_teaches_no_time():
    """A forward that also ran another sequence's prompt chunk (a batch's new request) is no
    verification of the rows it held: the step's time changes neither the learned costs nor the
    measured rates; the step still counts as taken."""
    p = policy(linear_cost(2.0, 2.0, n_max=64))
    p.batch, p.verified_beside, p.drafting, p.levels = (15, 15.0, 0.0), 271, True, 2
    p.prediction = (17.0, 40.0)
    before = (p.costs.snapshot(), p._real_ms, p._plain_ms_sum)
    p.beside_prefill = True
    p.observe_step(2, 3, 1.0, 190.0, 0.1)
    p.drafting = False
    p.observe_step(1, 1, 0.0, 190.0, 0.1)
    assert (p.costs.snapshot(), p._real_ms, p._plain_ms_sum) == before and p.steps_seen == 2
    p.beside_prefill, p.drafting = False, True
    p.observe_step(2, 3, 1.0, 190.0, 0.1)
    assert p.costs.snapshot() != before[0] and p._real_ms > before[1]
