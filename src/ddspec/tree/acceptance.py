"""How likely a drafted node is to be accepted, given its draft score, learned online (docs/design.md §2.4).

The cost-aware policy (tree/cost.py) values a tree by the sum of its nodes' acceptance chances;
this map from a node's score (the draft log-probability of its whole path) to that chance starts
from the draft's own belief and is pulled, bin by bin, to what verification observes. Host lists
throughout: the policy reads it a few times per draft level, and on a CPU a handful of tiny
tensor ops (bucketize, index, exp) cost more than the whole list pass. No model imports.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from ddspec.tree.host import host_list

# score bins (log-probability of the whole path) for the acceptance map
SCORE_EDGES = (-12.0, -8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.4, -0.2, -0.05)


@dataclass(slots=True)
class AcceptanceModel:
    """P(a drafted node is accepted | its score), per score bin, learned online.

    Prior: a node is accepted with probability exp(score) (the draft's own belief), worth
    ``prior_weight`` observations per bin; verdicts then pull each bin to what is observed.
    A node counts as accepted when it lies on the accepted path. A score s falls in bin
    ``bisect_left(edges, s)`` (``torch.bucketize``'s bins, right=False).
    """

    prior_weight: float = 20.0
    edges: list[float] = field(default_factory=lambda: list(SCORE_EDGES))
    accepted: list[float] = field(default_factory=lambda: [0.0] * (len(SCORE_EDGES) + 1))  # per bin
    seen: list[float] = field(default_factory=lambda: [0.0] * (len(SCORE_EDGES) + 1))  # per bin

    def prob(self, scores: list[float]) -> list[float]:
        """[M] scores -> [M] acceptance probabilities: the bin's counts with the prior's weight."""
        edges, acc, seen, w = self.edges, self.accepted, self.seen, self.prior_weight
        out = []
        for s in scores:
            b = bisect.bisect_left(edges, s)
            out.append((acc[b] + w * math.exp(min(s, 0.0))) / (seen[b] + w))
        return out

    def update(self, scores: torch.Tensor | list[float], accepted: torch.Tensor | list[bool]) -> None:
        """scores [M] of the drafted nodes of a verified tree; accepted [M] bool (tensors or host lists)."""
        edges, acc, seen = self.edges, self.accepted, self.seen
        for score, ok in zip(host_list(scores), host_list(accepted)):
            b = bisect.bisect_left(edges, score)
            seen[b] += 1.0
            acc[b] += 1.0 if ok else 0.0

    def state(self) -> dict:
        """The bins and counts as JSON-able data (the policy's memory across runs)."""
        return {"edges": list(self.edges), "accepted": list(self.accepted), "seen": list(self.seen)}
