"""The measured cost of a speculative step's pieces on this machine (docs/design.md §2.4).

:class:`CostModel` holds what calibrate.py measured: the target's forward over N new tokens
(interpolated between the measured N), the draft's root distribution and one more draft level.
The cost-aware policy (tree/cost.py) prices every candidate tree with it; :class:`~ddspec.tree.
learned_costs.LearnedCosts` corrects it from the step times a run observes. No model imports.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch


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
        self._table: list[float] = []  # verify_one(1), verify_one(2), ... (see verify_list)

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
        """:meth:`verify_one` of each of n [M] -> [M] float64: the same formula, lifted to a tensor
        of sizes for callers that hold one (calibrate.py's policy timing, tests)."""
        return torch.tensor([self.verify_one(float(m)) for m in n.reshape(-1).tolist()],
                            dtype=torch.float64).reshape(n.shape)

    def verify_list(self, n_max: int) -> list[float]:
        """[verify_one(1), ..., verify_one(n_max)] (or longer): a table kept between calls, rebuilt
        (at least twice as long) only when a larger size is asked; what the policy reads every step."""
        if len(self._table) < n_max:
            self._table = [self.verify_one(m) for m in range(1, max(n_max, 2 * len(self._table)) + 1)]
        return self._table

    def draft(self, levels: int) -> float:
        """ms of drafting ``levels`` levels: the root's distribution, then each further level."""
        return self.draft_root_ms + max(0, levels - 1) * self.draft_level_ms


def flat_cost(ms: float = 20.0, n_max: int = 128) -> dict[int, float]:
    """A GPU-like verification cost: the same for every N up to n_max."""
    return {1: ms, n_max: ms * 1.0001}


def linear_cost(base_ms: float, per_token_ms: float, n_max: int = 128) -> dict[int, float]:
    """A CPU-like verification cost: ``base_ms`` for one token and ``per_token_ms`` for each more."""
    return {n: base_ms + per_token_ms * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64, n_max)}
