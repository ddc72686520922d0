"""A cost-aware draft policy: grow the tree while it pays, on the machine at hand (DESIGN §2.4).

DDD and EAGLE-2 look only at draft confidence; neither knows that on a CPU a target forward
over 32 tokens costs several times one token, or that a draft level is not free. This policy
maximises expected tokens per second of the whole step:

    rate(N, L) = (1 + E(N)) / (t_draft(L) + t_verify(N) + t_other)

where E(N) = sum of a(score_i) over the N - 1 best-scoring drafted nodes (``a`` maps a node's
score to its observed chance of being accepted), L is the number of levels drafted, and the
times come from measurements of this target + head + device (:class:`CostModel`).

- *Depth*: after each level it compares the best rate now with the best rate it expects after
  one more level (each frontier node gets a child whose log-prob is the running mean of the
  best child's log-prob), and stops when one more level is not expected to pay.
- *Size*: the verified node count N is the argmax of the rate over the reranked candidates.

Only which nodes are drafted and verified changes (depth, size, the frontier's width; the drafter
may merge a lookup chain in), so verification, and losslessness, are untouched.
With a flat verification cost it grows EAGLE-2-sized trees; with a steep one it shrinks to a
short chain; with a costly draft level it stops earlier. No model imports; the per-step
arithmetic runs on Python floats (a few dozen tiny tensor ops would cost more than a draft level).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

# score bins (log-probability of the whole path) for the acceptance map
SCORE_EDGES = (-12.0, -8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.4, -0.2, -0.05)


def monotone(verify_ms: dict[int, float]) -> dict[int, float]:
    """Verifying more tokens never costs less than fewer (one could pad), so a curve that says
    otherwise (measured while the CPU was busy, or noise between neighbours) is cut down to what
    its larger sizes show: T(n) = min over m >= n of T(m). A one-token step then never looks
    dearer than a bigger tree, which would otherwise make plain steps look worse than they are."""
    out, cheapest = {}, math.inf
    for n in sorted(verify_ms, reverse=True):
        cheapest = out[n] = min(verify_ms[n], cheapest)
    return dict(sorted(out.items()))


@dataclass
class CostModel:
    """Measured times (ms) of one step's pieces; verify_ms is interpolated between measured N."""

    verify_ms: dict[int, float]  # target forward over N new tokens -> ms
    draft_root_ms: float  # the root's draft distribution (paid on every step)
    draft_level_ms: float  # one more level: head on the frontier, log-softmax, top-k
    other_ms: float = 0.0  # per-step work that does not depend on the tree (commit, head refresh)

    def __post_init__(self) -> None:
        if not self.verify_ms or any(n < 1 or t <= 0 for n, t in self.verify_ms.items()):
            raise ValueError(f"verify_ms needs positive times for N >= 1, got {self.verify_ms}")
        self.verify_ms = monotone(self.verify_ms)
        pts = sorted(self.verify_ms.items())
        self._n = [float(p[0]) for p in pts]
        self._t = [float(p[1]) for p in pts]
        self._table: list[float] = []  # verify(1), verify(2), ... as floats (see verify_list)

    def verify_one(self, n: float) -> float:
        """ms of verifying n tokens (linear between points, linear beyond the last two, never below
        the first point's). Python floats: the policy prices sizes every step, and on a CPU the
        dozen tensor ops this took cost more than a draft level's matmuls."""
        xs, ts = self._n, self._t
        if len(xs) == 1:
            return ts[0] * n / xs[0]
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, t0, t1 = xs[i - 1], xs[i], ts[i - 1], ts[i]
        return max(t0 + (t1 - t0) * (n - x0) / (x1 - x0), ts[0])

    def verify(self, n: torch.Tensor) -> torch.Tensor:
        """:meth:`verify_one` of each of n [M] -> [M] float64."""
        return torch.tensor([self.verify_one(float(m)) for m in n.reshape(-1).tolist()],
                            dtype=torch.float64).reshape(n.shape)

    def verify_list(self, n_max: int) -> list[float]:
        """[verify(1), ..., verify(n_max)], computed once per size."""
        if len(self._table) < n_max:
            self._table = [self.verify_one(m) for m in range(1, max(n_max, 2 * len(self._table)) + 1)]
        return self._table

    def draft(self, levels: int) -> float:
        return self.draft_root_ms + max(0, levels - 1) * self.draft_level_ms


@dataclass(slots=True)
class AcceptanceModel:
    """P(a drafted node is accepted | its score), per score bin, learned online.

    Prior: a node is accepted with probability exp(score) (the draft's own belief), worth
    ``prior_weight`` observations per bin; verdicts then pull each bin to what is observed.
    A node counts as accepted when it lies on the accepted path.
    """

    prior_weight: float = 20.0
    edges: torch.Tensor = field(default_factory=lambda: torch.tensor(SCORE_EDGES, dtype=torch.float64))
    accepted: torch.Tensor = field(default_factory=lambda: torch.zeros(len(SCORE_EDGES) + 1, dtype=torch.float64))
    seen: torch.Tensor = field(default_factory=lambda: torch.zeros(len(SCORE_EDGES) + 1, dtype=torch.float64))
    _lists: tuple | None = field(default=None, repr=False, compare=False)  # (edges, accepted, seen) as lists

    def _bins(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(scores.to("cpu", torch.float64), self.edges)

    def prob(self, scores: torch.Tensor) -> torch.Tensor:
        """[M] scores -> [M] acceptance probabilities (the counts live on the host: a GPU's scores come over)."""
        s = scores.to("cpu", torch.float64)
        b = self._bins(s)
        prior = s.clamp(max=0).exp()
        w = self.prior_weight
        return (self.accepted[b] + w * prior) / (self.seen[b] + w)

    def update(self, scores: torch.Tensor | list[float], accepted: torch.Tensor | list[bool]) -> None:
        """scores [M] of the drafted nodes of a verified tree; accepted [M] bool (tensors or host lists).
        Counted on the host lists, the tensors rewritten from them (two small tensors instead of
        bucketize and two index_add_, a tenth of the time)."""
        if self._lists is None:
            self._lists = (self.edges.tolist(), self.accepted.tolist(), self.seen.tolist())
        edges, acc, seen = self._lists
        for score, ok in zip(_host(scores), _host(accepted)):
            b = bisect.bisect_left(edges, score)  # torch.bucketize's bins (right=False)
            seen[b] += 1.0
            acc[b] += 1.0 if ok else 0.0
        self.seen = torch.tensor(seen, dtype=torch.float64)
        self.accepted = torch.tensor(acc, dtype=torch.float64)

    def prob_list(self, scores: list[float]) -> list[float]:
        """:meth:`prob` on Python floats (the same bins, prior and counts; no tensor ops)."""
        if self._lists is None:
            self._lists = (self.edges.tolist(), self.accepted.tolist(), self.seen.tolist())
        edges, acc, seen = self._lists
        w = self.prior_weight
        out = []
        for s in scores:
            b = bisect.bisect_left(edges, s)  # torch.bucketize's bins (right=False)
            out.append((acc[b] + w * math.exp(min(s, 0.0))) / (seen[b] + w))
        return out

    def state(self) -> dict:
        return {"edges": self.edges.tolist(), "accepted": self.accepted.tolist(), "seen": self.seen.tolist()}


class LearnedCosts:
    """The calibrated :class:`CostModel`, corrected online by the step times actually observed.

    A calibration can be wrong (measured while another program loaded the CPU, or in a tighter
    loop than real steps run); this keeps the policy's costs honest without re-calibrating:

    - *verify phase* (target forward + acceptance + commit + head refresh) of an N-node tree:
      the calibrated ``verify(N) + other`` times a correction ``exp(r)``, where ``r`` is a decayed
      mean of log(observed / calibrated) at the calibration size nearest N; sizes not yet
      observed take ``r`` interpolated from the observed ones (flat beyond them), so one
      observation at N = 1 already rescales the whole curve;
    - *draft*: the root's cost and the per-level cost, each a decayed mean of what was observed
      (a level's cost = (draft time - root cost) / (levels - 1)); a value more than 3x the
      current estimate counts only when three such come in a row, so one slow step (a first
      call at a new shape, a context switch) cannot make the policy believe drafting is dear
      and stop drafting (it then rarely observes a level to correct itself); until a level is
      observed it scales with the root's correction when that is below 1;
    - *plain step* (verify a root alone, no draft, no head refresh) and *gap* (per-step work
      outside both phases: emitting, detokenising): decayed means, from the calibration's
      one-token forward and 0.

    ``current`` is the corrected curve as a CostModel (verify_ms = the whole verify phase,
    other_ms = the gap). ``drift`` says how far it has moved from the calibration.
    """

    jump, jumps_needed = 3.0, 3  # a draft cost this many times the estimate counts after this many in a row

    def __init__(self, base: CostModel, decay: float = 0.9) -> None:
        self.base, self.decay = base, decay
        self.sizes = sorted(base.verify_ms)
        self.log_ratio = [0.0] * len(self.sizes)
        self.seen = [0.0] * len(self.sizes)  # decayed observation counts per size
        self.root_ms, self.level_ms = base.draft_root_ms, base.draft_level_ms
        self.root_seen = self.level_seen = 0.0
        self._jumps = {"root": 0, "level": 0}  # consecutive observations > 3x the estimate
        self.plain_ms, self.gap_ms = base.verify_ms[self.sizes[0]], 0.0
        self.plain_seen = self.gap_seen = 0.0
        self.chain_ms: dict[int, tuple[float, float]] = {}  # plain steps verifying a lookup chain: size -> (mean, seen)
        self.steps = 0
        self._current: CostModel | None = None  # rebuilt when next read after an observation

    # -- estimates ------------------------------------------------------------------------
    def _ratios(self) -> list[float]:
        """Log corrections at every calibration size: observed, else interpolated."""
        known = [(i, r) for i, (r, c) in enumerate(zip(self.log_ratio, self.seen)) if c > 0]
        if not known:
            return [0.0] * len(self.sizes)
        out = []
        for i in range(len(self.sizes)):
            below = [(j, r) for j, r in known if j <= i]
            above = [(j, r) for j, r in known if j >= i]
            if not below or not above:
                out.append((below or above)[-1 if below else 0][1])
            else:
                (j0, r0), (j1, r1) = below[-1], above[0]
                out.append(r0 if j0 == j1 else r0 + (r1 - r0) * (i - j0) / (j1 - j0))
        return out

    def _rebuild(self) -> CostModel:
        base = self.base
        phase = monotone({n: (base.verify_ms[n] + base.other_ms) * math.exp(r)
                          for n, r in zip(self.sizes, self._ratios())})
        # until a level is seen, levels follow the root's correction, but only downwards: a real
        # step's root also pays the policy's own bookkeeping, which the calibration's bare root
        # distribution does not (4 ms vs 0.5 ms here), and a level believed dear is never drafted,
        # so never observed, so never corrected
        level = self.level_ms if self.level_seen else base.draft_level_ms * min(
            1.0, self.root_ms / max(base.draft_root_ms, 1e-6))
        return CostModel(verify_ms=phase, draft_root_ms=self.root_ms, draft_level_ms=level, other_ms=self.gap_ms)

    def plain_estimate(self) -> float:
        """ms of a plain step's verify phase: observed, else the calibration's one-token forward,
        but never more than the corrected curve says a drafted step's one-token phase takes (which
        adds the head's refresh): a calibration made under load is corrected by drafted steps
        even when every plain step verifies a lookup chain (those do not teach ``plain_ms``)."""
        if self.plain_seen:
            return self.plain_ms
        return min(self.plain_ms, self.current.verify_ms[self.sizes[0]])

    def plain_verify(self, n: int) -> float:
        """ms of a plain step's verify phase with ``n`` nodes (the root and a lookup chain of n - 1):
        observed at that size, else the plain step's estimate times the calibrated curve's
        T(n) / T(1) (:meth:`curve_verify`)."""
        if n <= 1:
            return self.plain_estimate()
        if n in self.chain_ms:
            return self.chain_ms[n][0]
        return self.curve_verify(n)

    def curve_verify(self, n: int) -> float:
        """The plain step's estimate times the calibrated curve's T(n) / T(1)."""
        v = self.base.verify_list(n)
        return self.plain_estimate() * v[n - 1] / v[0]

    # a chain size's learned cost starts from the curve's (counted as one step), and one step moves it
    # by at most half of the estimate: a single slow step (this VM's neighbours) at a size rarely met
    # used to set its cost outright, e.g. 27 ms for 7 nodes that take 8.7, and a size believed that
    # dear is never verified again, so never corrected (Intel Xeon family 6 model 207, int8)
    chain_step_limit = 0.5
    chain_restore_limit = 2.0  # a remembered chain cost over this many times the curve's is learnt again

    def _observe_chain(self, n: int, verify_ms: float) -> None:
        mean, seen = self.chain_ms.get(n, (self.curve_verify(n), 1.0))
        step = self.chain_step_limit * mean
        self.chain_ms[n] = self._mean(mean, seen, min(max(verify_ms, mean - step), mean + step))

    def drift(self, min_seen: float = 1.0) -> float:
        """Largest |log(learned / calibrated)| over the verify sizes and draft costs observed at
        least ``min_seen`` times (decayed counts)."""
        return max((abs(math.log(learned / calibrated)) for _, calibrated, learned in self.drifts(min_seen)), default=0.0)

    def drifts(self, min_seen: float = 1.0) -> list[tuple[str, float, float]]:
        """(what, calibrated ms, learned ms) for each estimate observed at least ``min_seen`` times,
        the largest change (as a ratio) first."""
        base = self.base
        out = [(f"verifying {n}", base.verify_ms[n] + base.other_ms, (base.verify_ms[n] + base.other_ms) * math.exp(r))
               for n, r, c in zip(self.sizes, self.log_ratio, self.seen) if c >= min_seen]
        if self.root_seen >= min_seen:
            out.append(("the draft root", max(base.draft_root_ms, 1e-6), max(self.root_ms, 1e-6)))
        if self.level_seen >= min_seen:
            out.append(("a draft level", max(base.draft_level_ms, 1e-6), max(self.level_ms, 1e-6)))
        return sorted(out, key=lambda d: -abs(math.log(d[2] / d[1])))

    def as_calibration(self) -> CostModel:
        """The learned curve in the calibration's own terms (verify without the per-step rest)."""
        other = self.base.other_ms
        cur = self.current
        return CostModel(verify_ms={n: max(t - other, 0.01) for n, t in cur.verify_ms.items()},
                         draft_root_ms=cur.draft_root_ms, draft_level_ms=cur.draft_level_ms, other_ms=other)

    # -- observations ---------------------------------------------------------------------
    def _draft_mean(self, name: str, old: float, seen: float, value: float) -> tuple[float, float]:
        if value > self.jump * old:
            self._jumps[name] += 1
            if self._jumps[name] < self.jumps_needed:
                return old, seen  # an isolated slow step: wait for confirmation
        else:
            self._jumps[name] = 0
        return self._mean(old, seen, value)

    def _mean(self, old: float, seen: float, value: float) -> tuple[float, float]:
        """Decayed running mean: the first observation replaces the prior outright."""
        seen = seen * self.decay + 1.0
        return old + (value - old) / seen, seen

    def observe(self, tree_size: int, levels: int, draft_ms: float | None, verify_ms: float, gap_ms: float,
                drafted: bool) -> None:
        """One step's measured times. ``drafted``: the head ran (root distribution and levels) and its
        cache was refreshed; False for a plain step (root only, no head work). ``draft_ms`` None: the
        draft phase did other work too (the head catching up after plain steps), learn nothing from it."""
        self.steps += 1
        self.gap_ms, self.gap_seen = self._mean(self.gap_ms, self.gap_seen, max(gap_ms, 0.0))
        if not drafted:
            if tree_size == 1:  # a plain step that verified a free (lookup) chain costs more: not this
                self.plain_ms, self.plain_seen = self._mean(self.plain_ms, self.plain_seen, verify_ms)
            else:
                self._observe_chain(tree_size, verify_ms)
            self._current = None
            return
        i = min(range(len(self.sizes)), key=lambda j: abs(math.log(self.sizes[j] / tree_size)))
        calibrated = self.base.verify_one(tree_size) + self.base.other_ms
        r = math.log(max(verify_ms, 1e-3) / calibrated)
        self.log_ratio[i], self.seen[i] = self._mean(self.log_ratio[i], self.seen[i], r)
        if draft_ms is None:
            pass
        elif levels <= 1:
            self.root_ms, self.root_seen = self._draft_mean("root", self.root_ms, self.root_seen, max(draft_ms, 1e-3))
        else:
            per_level = max((draft_ms - self.root_ms) / (levels - 1), 0.01)
            self.level_ms, self.level_seen = self._draft_mean("level", self.level_ms, self.level_seen, per_level)
        self._current = None

    # -- memory across runs ----------------------------------------------------------------
    _SNAPSHOT = ("log_ratio", "seen", "root_ms", "level_ms", "root_seen", "level_seen", "plain_ms", "gap_ms",
                 "plain_seen", "gap_seen")

    def snapshot(self) -> dict:
        """What was learned, as JSON-able data (:meth:`restore` reads it back)."""
        data = {k: getattr(self, k) for k in self._SNAPSHOT}
        data["sizes"] = self.sizes
        data["chain_ms"] = {str(n): list(v) for n, v in self.chain_ms.items()}
        return data

    def restore(self, data: dict) -> None:
        """Take up what an earlier run learned (:meth:`snapshot`); ignored when its sizes differ."""
        if data.get("sizes") != self.sizes:
            return
        for k in self._SNAPSHOT:
            v = data[k]
            setattr(self, k, [float(x) for x in v] if isinstance(v, list) else float(v))
        self._current = None
        chains = {int(n): (float(m), float(c)) for n, (m, c) in data.get("chain_ms", {}).items()}
        self.chain_ms = {n: v for n, v in chains.items() if v[0] <= self.chain_restore_limit * self.curve_verify(n)}

    @property
    def current(self) -> CostModel:
        """The costs as learned so far (calibration corrected by the observed steps)."""
        if self._current is None:
            self._current = self._rebuild()
        return self._current


class CostAwarePolicy:
    """The depth policy and size chooser described in the module docstring, plus the choice
    between drafting and a plain step (see :meth:`draft_now`).

    ``persist``: called once with the learned curve (in calibration terms) when it has drifted
    from the calibration by more than ``drift_limit`` (log ratio) after ``min_steps`` steps, so
    the cache entry is corrected for the next run. Only estimates observed ``drift_seen`` times
    (decayed counts) count: a tree size met once or twice in a run, at one slow or fast moment,
    used to rewrite the cache on most runs (and the next run, meeting another rare size, wrote
    it back).
    """

    drift_seen = 4.0

    explore_close, explore_far = 16, 64  # steps between tries of the other choice (rates close / far apart)
    max_backoff = 8  # drafting tried and still worse: the wait before the next try doubles, up to 8x
    min_drafted = 8  # drafted steps before the policy may prefer plain steps
    forecast_decay = 0.5  # the drafted rate follows the newest forecasts (made with the newest knowledge)
    # drafted steps' measured rate against their forecasts (decayed sums over about 20 steps): what
    # the forecasts leave out (the head catching up after plain steps, feeding it the accepted
    # tokens, Python between the phases) scales the drafted rate the policy compares
    bias_decay = 0.95
    bias_bounds = (0.25, 2.0)
    plain_decay = 0.9  # the plain steps' measured rate: realised tokens are noisier than forecasts
    # ... of those that verified a lookup chain (1 to 4 tokens a step): over ~10 steps its estimate
    # swung by 2x (0.17-0.37 tokens/ms in one fp32 run) and dipped below the drafted rate on 1 chain
    # step in 10, each then drafted at a loss (0.22 against 0.26 tokens/ms measured); ~50 steps
    chain_decay = 0.98

    def __init__(self, cost: CostModel, acceptance: AcceptanceModel, max_depth: int, max_tokens: int,
                 child_logprob: float = -0.7, persist=None, drift_limit: float = math.log(1.5),
                 min_steps: int = 32) -> None:
        self.acceptance = acceptance
        self.costs = LearnedCosts(cost)
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.child_logprob = child_logprob  # running mean of the best child's log-prob
        self.persist, self.drift_limit, self.min_steps = persist, drift_limit, min_steps
        self.syncs = 0
        self.levels = 0
        self.next_size = max_tokens  # verified size expected after the next level (continue_after)
        self.drafting = True  # the choice made for the current step
        self.prediction: tuple[float, float] = (1.0, 0.0)  # (expected tokens, expected ms) of the current step
        # expected rate of drafted steps (the forecasts, with the costs and acceptance learned so
        # far): decayed sums of forecast tokens and ms, and the count of drafted steps
        self._draft_tokens = self._draft_ms = self._drafted = 0.0
        # drafted steps as measured and as forecast (the size they verified): decayed sums (see bias)
        self._real_tokens = self._real_ms = self._told_tokens = self._told_ms = 0.0
        # measured, of plain steps (lookup chains included): decayed sums of tokens, ms and steps
        self._plain_tokens = self._plain_ms_sum = self._plain_weight = 0.0
        self._plain_steps = 0
        self._chain_tokens = self._chain_ms = 0.0  # ... of the plain steps that verified a lookup chain
        self._chain_steps = 0
        self._since_plain = self._since_draft = 0
        self._backoff = 1  # multiplies the wait before drafting is tried again (see draft_now)
        self._since_size_probe = 0  # drafted steps since one verified a bigger tree than the best
        self._probe_size = False
        self._probe_extra = (0.0, 0.0)  # (tokens, ms) the current step's size probe adds to the best size's forecast
        # lookup chains merged into drafted trees (EagleDrafter): their accepted nodes per step so far
        self.graft_gain, self._graft_seen = 0.0, 0.0
        # lookup chains verified: per n-gram order, how often the j-th token was offered / accepted
        self._chain_stats: dict[int, tuple[list[float], list[float]]] = {}
        self._chain_cuts = 0
        self.remember = None  # remember(snapshot) every SAVE_EVERY steps (methods.remember_policy), or None
        self.steps_seen = 0  # steps observed in this process
        self._before_memory: dict | None = None  # the state before restore(), while a memory is in use

    @property
    def cost(self) -> CostModel:
        """The costs the policy uses now (calibrated, corrected by observation)."""
        return self.costs.current

    @cost.setter
    def cost(self, cost: CostModel) -> None:  # a new calibration: start learning from it afresh
        self.costs = LearnedCosts(cost)

    # -- the rate ----------------------------------------------------------------------------
    def rates(self, scores: torch.Tensor, levels: int) -> torch.Tensor:
        """rate for N = 1 .. min(M + 1, max_tokens) verified nodes (root included) -> [N]."""
        return torch.tensor(self._rates(scores.tolist(), levels), dtype=torch.float64)

    def _gains(self, scores: list[float]) -> list[float]:
        """Expected tokens of verifying the root and the N - 1 best nodes, for N = 1, 2, ..."""
        best = sorted(scores, reverse=True)[: self.max_tokens - 1]
        gains = [1.0]
        for p in self.acceptance.prob_list(best):
            gains.append(gains[-1] + p)
        return gains

    def _step_ms(self, n: int, levels: int) -> float:
        cost = self.cost
        return cost.draft(levels) + cost.verify_list(n)[n - 1] + cost.other_ms

    def _rates(self, scores: list[float], levels: int) -> list[float]:
        """The rates on Python floats: the policy runs this a few times per level, and on a CPU a
        few dozen small tensor ops cost about a millisecond, as much as a draft level's matmuls."""
        gains = self._gains(scores)
        cost = self.cost
        verify, fixed = cost.verify_list(len(gains)), cost.draft(levels) + cost.other_ms
        return [g / (fixed + verify[i]) for i, g in enumerate(gains)]

    def best(self, scores: torch.Tensor | list[float], levels: int) -> tuple[int, float]:
        """(N, rate) of the best verified size for these scores (the first N on ties)."""
        r = self._rates(scores if isinstance(scores, list) else scores.tolist(), levels)  # host sync: a decision point
        i = max(range(len(r)), key=r.__getitem__)
        return i + 1, r[i]

    # -- drafting or a plain step ---------------------------------------------------------------
    def plain_rate(self, chain: bool | None = None) -> float:
        """Tokens per ms of the steps that leave the head out: measured (decayed sums of their tokens
        and times, lookup chains included) once there are ``min_drafted`` of them, else one token
        per plain step's cost. ``chain``: whether this step has a lookup chain to verify (None:
        not known). Without one, a plain step is one token at a plain step's cost; with one, the
        measured rate of the plain steps that had a chain (the pooled rate until there are
        ``min_drafted`` of them): the choice is made for the step at hand, not on average."""
        if chain is False:
            return 1.0 / (self.costs.plain_estimate() + self.costs.gap_ms)
        if chain and self._chain_steps >= self.min_drafted and self._chain_ms > 0:
            return self._chain_tokens / self._chain_ms
        if self._plain_steps >= self.min_drafted and self._plain_ms_sum > 0:
            return self._plain_tokens / self._plain_ms_sum
        return 1.0 / (self.costs.plain_estimate() + self.costs.gap_ms)

    def draft_rate(self) -> float | None:
        """Tokens per ms expected of recent drafted steps (None before ``min_drafted`` of them).

        The forecasts' rate times :meth:`bias`, not the realised rate: the forecasts use the costs
        and acceptance learned from every step, so they track what steps take, without the noise
        of single verdicts (one unlucky step must not switch drafting off); the slow bias adds what
        they cannot price (the head's catch-up, Python between the phases)."""
        if self._drafted < self.min_drafted:
            return None
        return self._draft_tokens / self._draft_ms * self.bias()

    def bias(self) -> float:
        """Measured over forecast tokens per ms of recent drafted steps (1.0 before ``min_drafted`` of
        them; within ``bias_bounds``). The forecasts price a step's draft levels, verification and
        the usual gap; a drafted step also pays the head's catch-up over the plain steps before it
        and its commit of the accepted tokens, which the measurement holds. Slow (``bias_decay``):
        one step's luck with acceptance hardly moves it."""
        if self._drafted < self.min_drafted or min(self._real_ms, self._told_tokens) <= 0.0:
            return 1.0
        ratio = (self._real_tokens / self._real_ms) / (self._told_tokens / self._told_ms)
        low, high = self.bias_bounds
        return min(max(ratio, low), high)

    def draft_now(self, chain: bool | None = None) -> bool:
        """Draft this step, or verify the root alone without touching the head (plain decoding's
        cost; with the lookup's chain when ``chain``, see :meth:`plain_rate`)? Whichever has the
        higher expected rate (costs and acceptance as learned so far; the first ``min_drafted``
        steps with a chain verify it, to learn what such steps yield); the
        other is tried every ``explore_close`` steps when the two are within 25%, every
        ``explore_far`` otherwise, so neither estimate goes stale. A drafted try costs a catch-up
        of the head and a tree (about two plain steps): while drafting stays the worse choice
        after each try, the wait before the next one doubles (up to ``max_backoff`` times)."""
        drafted = self.draft_rate()
        explore = False
        if chain and self._chain_steps < self.min_drafted:
            choice = False  # verifying a lookup chain costs about a plain step: learn what such steps yield
        elif drafted is None:
            choice = True
        else:
            plain = self.plain_rate(chain)
            ratio = drafted / plain
            every = self.explore_close if 0.8 <= ratio <= 1.25 else self.explore_far
            choice = ratio >= 1.0
            if choice:
                self._backoff = 1
            if choice and self._since_plain >= every or not choice and self._since_draft >= every * self._backoff:
                if not choice:
                    self._backoff = min(2 * self._backoff, self.max_backoff)
                choice, explore = not choice, True
        # a drafted step now and then verifies the next calibrated size above the best one, so
        # that costs believed too high for bigger trees get measured (and corrected) too
        self._probe_size = choice and (explore or self._since_size_probe >= self.explore_close)
        self._probe_extra = (0.0, 0.0)
        self.drafting = choice
        if not choice:
            self.levels = 0
            if self._plain_weight > 0:  # what recent plain steps (with their lookup chains) took
                self.prediction = (self._plain_tokens / self._plain_weight, self._plain_ms_sum / self._plain_weight)
            else:
                self.prediction = (1.0, self.costs.plain_estimate() + self.costs.gap_ms)
        return choice

    # -- lookup chains -------------------------------------------------------------------------
    chain_prior, chain_prior_weight = 0.5, 4.0  # before observations: the j-th token accepted with 0.5**j
    chain_explore = 16  # every so many cut chains, one more token is verified (its acceptance stays known)

    def chain_length(self, order: int, available: int) -> int:
        """How many of a lookup continuation's ``available`` tokens to verify (0: none), for a
        continuation found by an n-gram of ``order`` tokens.

        The L that maximises the expected rate (1 + sum of P(first j accepted), j <= L) /
        (plain verify phase of 1 + L nodes + gap), with those probabilities learned per order
        (:meth:`observe_chain`) and the verify phases measured on this machine's plain steps
        (:meth:`LearnedCosts.plain_verify`). A match on the context's last token alone guesses
        worse than one on its last three; where verifying a few more tokens is dear (fp32 here)
        such chains are cut, where it is nearly free (8-bit activations) they are verified."""
        if order <= 0 or available <= 0:
            return 0
        seen, accepted = self._chain_counts(order, available)
        costs, gap = self.costs, max(self.costs.gap_ms, 0.0)
        best_l, best = 0, 1.0 / (costs.plain_verify(1) + gap)
        expected, w = 0.0, self.chain_prior_weight
        for l in range(1, available + 1):
            expected += (accepted[l - 1] + w * self.chain_prior ** l) / (seen[l - 1] + w)
            rate = (1.0 + expected) / (costs.plain_verify(1 + l) + gap)
            if rate > best:
                best_l, best = l, rate
        if best_l < available:
            self._chain_cuts += 1
            if self._chain_cuts % self.chain_explore == 0:
                best_l += 1
        return best_l

    def _chain_counts(self, order: int, length: int) -> tuple[list[float], list[float]]:
        """(offered, accepted) counts of an order's continuation tokens 1 .. at least ``length``."""
        seen, accepted = self._chain_stats.setdefault(order, ([], []))
        while len(seen) < length:
            seen.append(0.0)
            accepted.append(0.0)
        return seen, accepted

    def observe_chain(self, order: int, offered: int, accepted: int) -> None:
        """A verified lookup chain: ``offered`` tokens of an ``order``-gram's continuation, the first
        ``accepted`` of them accepted."""
        if order <= 0 or offered <= 0:
            return
        seen, acc = self._chain_counts(order, offered)
        for j in range(offered):
            seen[j] += 1.0
            acc[j] += 1.0 if accepted > j else 0.0

    # -- the DepthPolicy protocol -------------------------------------------------------------
    def continue_after(self, level: int, frontier_scores: torch.Tensor | list[float],
                       candidate_scores: torch.Tensor | list[float] | None = None,
                       level_logprobs: torch.Tensor | list[float] | None = None) -> bool:
        """candidate_scores: every drafted node so far [M]; level_logprobs: the best child
        log-prob of each parent expanded at this level (updates the running estimate). Tensors or
        host lists (a CPU drafter's, tree/host.py)."""
        self.levels = level
        if level_logprobs is not None and len(level_logprobs):
            best = _host(level_logprobs)
            self.child_logprob = 0.9 * self.child_logprob + 0.1 * (sum(best) / len(best))
        if level >= self.max_depth:
            return False
        frontier = _host(frontier_scores)
        scores = frontier if candidate_scores is None else _host(candidate_scores)
        self.syncs += 1
        _, now = self.best(scores, level)
        self.next_size, after = self.best(scores + [s + self.child_logprob for s in frontier], level + 1)
        return after > now

    def frontier_keep(self, candidate_scores: torch.Tensor, frontier: torch.Tensor) -> torch.Tensor:
        """[k] bool: which frontier nodes (candidate indices) are worth running the head on.

        A child never scores above its parent, so a frontier node ranked below the best
        ``next_size`` drafted candidates (the size :meth:`continue_after` expects to verify after
        the next level, plus one node of slack; ties ranked by index) cannot have a child in that
        tree: its row would only make the level dearer. The best frontier node is always kept."""
        m = candidate_scores.numel()
        if self.next_size >= m:
            return torch.ones(frontier.shape, dtype=torch.bool, device=frontier.device)
        order = torch.argsort(candidate_scores, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(m, device=order.device)
        keep = rank[frontier] < self.next_size
        keep[rank[frontier].argmin()] = True
        return keep

    def tree_size(self, candidate_scores: torch.Tensor | list[float]) -> int:
        """Total verified nodes (root included) that maximise the rate for the drafted levels."""
        levels = max(1, self.levels)
        scores = _host(candidate_scores)
        n, _ = self.best(scores, levels)
        gains, best = self._gains(scores), n
        if self._probe_size:
            bigger = [m for m in self.costs.sizes if m > n]
            n = min(bigger[0] if bigger else n + 1, len(scores) + 1, self.max_tokens)
            self._since_size_probe = 0
        else:
            self._since_size_probe += 1
        self.prediction = (gains[n - 1], self._step_ms(n, levels))
        # a probe is a measurement, not the choice: what drafting yields is the best size's forecast
        self._probe_extra = (gains[n - 1] - gains[best - 1], self.prediction[1] - self._step_ms(best, levels))
        return n

    def observe(self, scores: torch.Tensor, accepted: torch.Tensor) -> None:
        self.acceptance.update(scores, accepted)

    def note_graft(self, size: int, added: int) -> None:
        """This step verifies ``added`` nodes of a lookup chain beyond the ``size`` chosen: its
        forecast gains what such chains have yielded per step so far, and their verify cost."""
        tokens, ms = self.prediction
        verify = self.cost.verify_list(size + added)
        self.prediction = (tokens + self.graft_gain, ms + verify[size + added - 1] - verify[size - 1])

    def observe_graft(self, accepted: int) -> None:
        """How many merged lookup nodes the step just verified accepted (decayed mean)."""
        self._graft_seen = self._graft_seen * 0.9 + 1.0
        self.graft_gain += (accepted - self.graft_gain) / self._graft_seen

    def observe_step(self, tokens: int, tree_size: int, draft_ms: float | None, verify_ms: float,
                     gap_ms: float, phase_ms: float | None = None) -> None:
        """The measured times of the step just finished (the engine's clock); ``draft_ms`` None when the
        draft phase also did other work (the head's catch-up), ``phase_ms`` then the whole phase's time."""
        self.costs.observe(tree_size, self.levels, draft_ms, verify_ms, gap_ms, self.drafting)
        if self.drafting:
            d = self.forecast_decay
            told_tokens, told_ms = self.prediction
            predicted_tokens, predicted_ms = told_tokens - self._probe_extra[0], told_ms - self._probe_extra[1]
            self._draft_tokens = self._draft_tokens * d + predicted_tokens
            self._draft_ms = self._draft_ms * d + predicted_ms
            b = self.bias_decay
            spent = (draft_ms if draft_ms is not None else phase_ms or 0.0) + verify_ms + max(gap_ms, 0.0)
            self._real_tokens = self._real_tokens * b + tokens
            self._real_ms = self._real_ms * b + spent
            self._told_tokens = self._told_tokens * b + told_tokens
            self._told_ms = self._told_ms * b + told_ms
            self._drafted += 1
            self._since_draft, self._since_plain = 0, self._since_plain + 1
        else:
            d = self.plain_decay
            self._plain_tokens = self._plain_tokens * d + tokens
            self._plain_ms_sum = self._plain_ms_sum * d + verify_ms + (draft_ms or 0.0) + max(gap_ms, 0.0)
            self._plain_weight = self._plain_weight * d + 1.0
            self._plain_steps += 1
            if tree_size > 1:  # it verified a lookup chain
                step_ms = verify_ms + (draft_ms or 0.0) + max(gap_ms, 0.0)
                c = self.chain_decay
                self._chain_tokens = self._chain_tokens * c + tokens
                self._chain_ms = self._chain_ms * c + step_ms
                self._chain_steps += 1
            self._since_plain, self._since_draft = 0, self._since_draft + 1
        self.steps_seen += 1
        if self.remember is not None and self.steps_seen % self.SAVE_EVERY == 0:
            self.remember(self.snapshot())
        if (self.persist is not None and self.costs.steps >= self.min_steps
                and self.costs.drift(self.drift_seen) > self.drift_limit):
            persist, self.persist = self.persist, None  # once per run
            why = "no estimate observed often enough"
            drifts = self.costs.drifts(self.drift_seen)
            if drifts:
                what, calibrated, learned = drifts[0]
                why = f"{what}: {calibrated:.2f} ms calibrated, {learned:.2f} ms in this run's steps"
            persist(self.costs.as_calibration(), why)

    # -- memory across runs ----------------------------------------------------------------
    # the rates, counts and decayed sums a run learns; a one-shot `ddspec generate` is a new process
    # each time, and without them every run paid for its own exploration (min_drafted head steps)
    _SNAPSHOT = ("child_logprob", "_draft_tokens", "_draft_ms", "_drafted", "_real_tokens", "_real_ms",
                 "_told_tokens", "_told_ms", "_plain_tokens", "_plain_ms_sum", "_plain_weight", "_plain_steps",
                 "_chain_tokens", "_chain_ms", "_chain_steps", "_backoff", "graft_gain", "_graft_seen")
    SAVE_EVERY = 256  # steps between saves of what was learned (and once at exit)
    memory_cap = 200.0  # restored acceptance counts are scaled down to at most this many per bin (they stay adaptive)

    def snapshot(self) -> dict:
        """What this policy learned (rates, acceptance counts, chain statistics, costs), as JSON-able
        data for :meth:`restore` in a later run on the same set-up."""
        data = {k: getattr(self, k) for k in self._SNAPSHOT}
        data["acceptance"] = self.acceptance.state()
        data["chains"] = {str(order): [list(seen), list(acc)] for order, (seen, acc) in self._chain_stats.items()}
        data["costs"] = self.costs.snapshot()
        return data

    def restore(self, data: dict, costs: bool = True) -> None:
        """Start from what an earlier run learned (:meth:`snapshot`): its rates and counts, scaled so
        that none weighs more than ``memory_cap`` observations, and (``costs``) its corrections of the
        calibrated costs; the timers between tries start afresh. :meth:`forget_memory` undoes it."""
        if self._before_memory is None:
            self._before_memory = self.snapshot()
        self._take(data, costs)

    def forget_memory(self) -> None:
        """Back to the state before :meth:`restore` (no-op without one, or once this process's own steps
        were learned from)."""
        if self._before_memory is not None and not self.steps_seen:
            self._take(self._before_memory, True)
        self._before_memory = None

    def _take(self, data: dict, costs: bool) -> None:
        for k in self._SNAPSHOT:
            setattr(self, k, type(getattr(self, k))(data[k]))
        acc = data["acceptance"]
        if acc["edges"] == self.acceptance.edges.tolist():
            seen = torch.tensor(acc["seen"], dtype=torch.float64)
            scale = min(1.0, self.memory_cap / max(float(seen.max()), 1.0))
            self.acceptance.seen = seen * scale
            self.acceptance.accepted = torch.tensor(acc["accepted"], dtype=torch.float64) * scale
            self.acceptance._lists = None
        chains = {}
        for order, (seen, accepted) in data.get("chains", {}).items():
            scale = min(1.0, self.memory_cap / max(max(seen, default=0.0), 1.0))
            chains[int(order)] = ([x * scale for x in seen], [x * scale for x in accepted])
        self._chain_stats = chains
        if costs:
            self.costs.restore(data["costs"])
        self._since_plain = self._since_draft = 0

    def __repr__(self) -> str:
        return f"CostAwarePolicy(max_depth={self.max_depth}, max_tokens={self.max_tokens})"


def _host(values: torch.Tensor | list[float]) -> list[float]:
    """Scores as a host list (a CPU drafter passes lists already; a tensor is read: a host sync)."""
    return values if isinstance(values, list) else values.tolist()


def flat_cost(ms: float = 20.0, n_max: int = 128) -> dict[int, float]:
    """A GPU-like verification cost: the same for every N up to n_max."""
    return {1: ms, n_max: ms * 1.0001}


def linear_cost(base_ms: float, per_token_ms: float, n_max: int = 128) -> dict[int, float]:
    return {n: base_ms + per_token_ms * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64, n_max)}


def expected_gain_of_chain(p: float, depth: int) -> float:
    """E(accepted) of a chain whose every link is accepted with probability p (for tests/docs)."""
    return sum(math.pow(p, d) for d in range(1, depth + 1))
