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

Only the tree's depth and size change, so verification, and losslessness, are untouched.
With a flat verification cost it grows EAGLE-2-sized trees; with a steep one it shrinks to a
short chain; with a costly draft level it stops earlier. Pure tensor code: no model imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# score bins (log-probability of the whole path) for the acceptance map
SCORE_EDGES = (-12.0, -8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.4, -0.2, -0.05)


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
        pts = sorted(self.verify_ms.items())
        self._n = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        self._t = torch.tensor([p[1] for p in pts], dtype=torch.float64)

    def verify(self, n: torch.Tensor) -> torch.Tensor:
        """ms of verifying n tokens, n [M] -> [M] (linear between points, linear beyond the last two)."""
        n = n.to(torch.float64)
        xs, ts = self._n, self._t
        if xs.numel() == 1:
            return ts[0] * n / xs[0]
        idx = torch.searchsorted(xs, n).clamp(1, xs.numel() - 1)
        x0, x1, t0, t1 = xs[idx - 1], xs[idx], ts[idx - 1], ts[idx]
        return (t0 + (t1 - t0) * (n - x0) / (x1 - x0)).clamp(min=float(ts[0]))

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

    def _bins(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(scores.to(torch.float64), self.edges)

    def prob(self, scores: torch.Tensor) -> torch.Tensor:
        """[M] scores -> [M] acceptance probabilities."""
        s = scores.to(torch.float64)
        b = self._bins(s)
        prior = s.clamp(max=0).exp()
        w = self.prior_weight
        return (self.accepted[b] + w * prior) / (self.seen[b] + w)

    def update(self, scores: torch.Tensor, accepted: torch.Tensor) -> None:
        """scores [M] of the drafted nodes of a verified tree; accepted [M] bool."""
        b = self._bins(scores)
        self.seen.index_add_(0, b, torch.ones_like(b, dtype=torch.float64))
        self.accepted.index_add_(0, b, accepted.to(torch.float64))

    def state(self) -> dict:
        return {"edges": self.edges.tolist(), "accepted": self.accepted.tolist(), "seen": self.seen.tolist()}


class CostAwarePolicy:
    """The depth policy and size chooser described in the module docstring."""

    def __init__(self, cost: CostModel, acceptance: AcceptanceModel, max_depth: int, max_tokens: int,
                 child_logprob: float = -0.7) -> None:
        self.cost, self.acceptance = cost, acceptance
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.child_logprob = child_logprob  # running mean of the best child's log-prob
        self.syncs = 0
        self.levels = 0

    # -- the rate ----------------------------------------------------------------------------
    def rates(self, scores: torch.Tensor, levels: int) -> torch.Tensor:
        """rate for N = 1 .. min(M + 1, max_tokens) verified nodes (root included) -> [N]."""
        best = torch.sort(scores.to(torch.float64), descending=True).values[: self.max_tokens - 1]
        gain = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.acceptance.prob(best), 0)])
        n = torch.arange(1, gain.numel() + 1)
        return (1 + gain) / (self.cost.draft(levels) + self.cost.verify(n) + self.cost.other_ms)

    def best(self, scores: torch.Tensor, levels: int) -> tuple[int, float]:
        r = self.rates(scores, levels)
        i = int(torch.argmax(r))  # host sync: the policy's named decision point
        return i + 1, float(r[i])

    # -- the DepthPolicy protocol -------------------------------------------------------------
    def continue_after(self, level: int, frontier_scores: torch.Tensor, candidate_scores: torch.Tensor | None = None,
                       level_logprobs: torch.Tensor | None = None) -> bool:
        """candidate_scores: every drafted node so far [M]; level_logprobs: the best child
        log-prob of each parent expanded at this level (updates the running estimate)."""
        self.levels = level
        if level_logprobs is not None and level_logprobs.numel():
            self.child_logprob = 0.9 * self.child_logprob + 0.1 * float(level_logprobs.mean())
        if level >= self.max_depth:
            return False
        scores = frontier_scores if candidate_scores is None else candidate_scores
        self.syncs += 1
        _, now = self.best(scores, level)
        projected = torch.cat([scores, frontier_scores + self.child_logprob])
        _, after = self.best(projected, level + 1)
        return after > now

    def tree_size(self, candidate_scores: torch.Tensor) -> int:
        """Total verified nodes (root included) that maximise the rate for the drafted levels."""
        n, _ = self.best(candidate_scores, max(1, self.levels))
        return n

    def observe(self, scores: torch.Tensor, accepted: torch.Tensor) -> None:
        self.acceptance.update(scores, accepted)

    def __repr__(self) -> str:
        return f"CostAwarePolicy(max_depth={self.max_depth}, max_tokens={self.max_tokens})"


def flat_cost(ms: float = 20.0, n_max: int = 128) -> dict[int, float]:
    """A GPU-like verification cost: the same for every N up to n_max."""
    return {1: ms, n_max: ms * 1.0001}


def linear_cost(base_ms: float, per_token_ms: float, n_max: int = 128) -> dict[int, float]:
    return {n: base_ms + per_token_ms * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64, n_max)}


def expected_gain_of_chain(p: float, depth: int) -> float:
    """E(accepted) of a chain whose every link is accepted with probability p (for tests/docs)."""
    return sum(math.pow(p, d) for d in range(1, depth + 1))
