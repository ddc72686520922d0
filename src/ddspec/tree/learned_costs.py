"""The calibrated step costs, corrected online by the step times a run observes (docs/design.md §2.4).

A calibration (calibrate.py) can be wrong: measured while another program loaded the CPU, or in a
tighter loop than real steps run. :class:`LearnedCosts` keeps the cost-aware policy's prices
honest without calibrating again, and says how far they drifted so that the cache entry can be
rewritten. Python floats throughout (one observation per step). No model imports.
"""

from __future__ import annotations

import math

from ddspec.tree.cost_model import CostModel, monotone


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

    def _phase_ms(self, n: int, log_ratio: float = 0.0) -> float:
        """The calibrated verify phase at calibration size ``n`` (verify + the per-step rest), times
        the correction ``exp(log_ratio)``."""
        base = self.base
        return (base.verify_ms[n] + base.other_ms) * math.exp(log_ratio)

    def _rebuild(self) -> CostModel:
        base = self.base
        phase = monotone({n: self._phase_ms(n, r) for n, r in zip(self.sizes, self._ratios())})
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
        out = [(f"verifying {n}", self._phase_ms(n), self._phase_ms(n, r))
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
