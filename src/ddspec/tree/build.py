"""Building draft trees from the draft's log-probabilities: pure functions, no network calls.

A drafter runs the head and calls these between head forwards:

- **Dynamic tree (EAGLE-2)**::

      candidates, frontier = expand_root(root_logprobs, top_k)
      level = 1
      while policy.continue_after(level, candidates.scores[frontier]):
          child_logprobs = head(candidates.tokens[frontier], ...)         # [k, V]
          candidates, frontier = expand_level(candidates, frontier, child_logprobs, top_k)
          level += 1
      tree = rerank(candidates, root_token, total_tokens)

- **Static tree (EAGLE-1)**: a fixed :class:`StaticShape`; for each of its ``levels`` the head
  runs on ``level.expand`` and :func:`fill_level` picks the ranked children; ``shape.tree``
  assembles the result.
- **Chain**: one token per level, :meth:`DraftTree.chain`.

Log-probabilities are the draft's ``log_softmax`` outputs; scores are their sums along a path.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from ddspec.errors import ConfigError
from ddspec.tree.tree import DraftTree


@dataclass(frozen=True, eq=False)
class Candidates:
    """Every node produced while expanding a dynamic tree (the root is not a candidate)."""

    tokens: torch.Tensor  # [M] int64
    parents: torch.Tensor  # [M] int64 index into these candidates, -1 = the root
    depths: torch.Tensor  # [M] int64, >= 1
    scores: torch.Tensor  # [M] float32, sum of draft log-probs from the root

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def extend(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> Candidates:
        """These candidates followed by new children of existing ones.  All: [m]."""
        depths = self.depths[parents] + 1  # [m]
        return Candidates(
            torch.cat([self.tokens, tokens]),
            torch.cat([self.parents, parents]),
            torch.cat([self.depths, depths]),
            torch.cat([self.scores, scores.float()]),
        )


def expand_root(root_logprobs: torch.Tensor, top_k: int) -> tuple[Candidates, torch.Tensor]:
    """Level 1: the top-k tokens at the root.  root_logprobs: [V].

    Returns the candidates and the first frontier ([k] indices into them: all of level 1).
    """
    logprobs, tokens = root_logprobs.topk(min(top_k, root_logprobs.shape[-1]))  # [k], [k]
    k = tokens.shape[0]
    device = tokens.device
    candidates = Candidates(
        tokens,
        torch.full((k,), -1, dtype=torch.int64, device=device),
        torch.ones(k, dtype=torch.int64, device=device),
        logprobs.float(),
    )
    return candidates, torch.arange(k, device=device)


def expand_level(
    candidates: Candidates, frontier: torch.Tensor, child_logprobs: torch.Tensor, top_k: int
) -> tuple[Candidates, torch.Tensor]:
    """One more level: the top-k children of each frontier node, all kept as candidates.

    frontier: [k] candidate indices; child_logprobs: [k, V], the head's output at each of them.
    Child score = parent score + log q(child). Returns the extended candidates and the next
    frontier: [k'] indices of the k best children overall (k' = min(top_k, all children)).
    """
    logprobs, tokens = child_logprobs.topk(min(top_k, child_logprobs.shape[-1]), dim=-1)  # [k, c]
    scores = candidates.scores[frontier].unsqueeze(1) + logprobs.float()  # [k, c]
    parents = frontier.unsqueeze(1).expand_as(tokens)  # [k, c]
    best = scores.flatten().topk(min(top_k, scores.numel())).indices  # [k']
    extended = candidates.extend(tokens.flatten(), parents.flatten(), scores.flatten())
    return extended, candidates.size + best


def rerank(candidates: Candidates, root_token: int | torch.Tensor, total_tokens: int) -> DraftTree:
    """The tree of the root + the ``total_tokens - 1`` best-scoring candidates.

    Scores never rise along a path, so the best set is closed under "parent of"; exact ties
    (a child with log-prob 0) are broken towards shallower nodes, which keeps it closed.
    Nodes come out in topological order: by depth, then by score, descending.
    """
    keep = min(total_tokens - 1, candidates.size)
    by_depth = torch.argsort(candidates.depths, stable=True)  # [M]
    by_score = torch.sort(candidates.scores[by_depth], descending=True, stable=True).indices  # [M]
    chosen = by_depth[by_score[:keep]]  # [keep], score descending, ties shallower first
    order = chosen[torch.argsort(candidates.depths[chosen], stable=True)]  # [keep]
    tree_index = torch.full_like(candidates.parents, -1)  # [M], candidate -> tree node
    tree_index[order] = torch.arange(1, keep + 1, device=order.device)
    parent = candidates.parents[order]  # [keep]
    tree_parent = torch.where(parent < 0, 0, tree_index[parent.clamp(min=0)])  # [keep]
    assert bool((tree_parent >= 0).all()), "rerank kept a node without its parent"  # host sync
    root = torch.as_tensor(root_token, dtype=torch.int64, device=order.device).reshape(1)  # [1]
    return DraftTree(
        tokens=torch.cat([root, candidates.tokens[order]]),
        parents=torch.cat([root.new_full((1,), -1), tree_parent]),
        depths=torch.cat([root.new_zeros(1), candidates.depths[order]]),
        scores=torch.cat([candidates.scores.new_zeros(1), candidates.scores[order]]),
    )


Path = tuple[int, ...]


def most_probable_paths(size: int, rank_decay: float, max_depth: int) -> tuple[Path, ...]:
    """The `size` most probable child-rank paths of at most `max_depth` levels.

    Acceptance model: at every level, independently, the target's token is the draft's
    rank-r child with probability ``(1 - rank_decay) * rank_decay**r``. A node is accepted
    iff its whole path is, so a tree's expected accepted length is the sum of its nodes'
    path probabilities and the best tree of n nodes is the n most probable paths. A prefix
    is always more probable than its extensions, so the result is closed under prefixes.
    Ties (equal depth and rank sum) go to the lexicographically smaller path. Returned in
    topological order (by depth, then lexicographic).
    """
    if size < 1 or not 0 < rank_decay < 1 or max_depth < 1:
        raise ConfigError(
            f"need size >= 1, 0 < rank_decay < 1 and max_depth >= 1, got {size}, {rank_decay}, {max_depth}"
        )

    def cost(path: Path) -> float:  # -log probability, a function of (depth, rank sum) only
        return -(len(path) * math.log1p(-rank_decay) + sum(path) * math.log(rank_decay))

    heap = [(cost((0,)), (0,))]
    chosen: list[Path] = []
    while len(chosen) < size:
        _, path = heapq.heappop(heap)
        chosen.append(path)
        sibling = path[:-1] + (path[-1] + 1,)
        heapq.heappush(heap, (cost(sibling), sibling))
        if len(path) < max_depth:
            heapq.heappush(heap, (cost(path + (0,)), path + (0,)))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


# The built-in static tree: 25 drafted nodes (26 with the root), 5 levels deep. Derived with
# most_probable_paths under a top-1 acceptance of 0.7 (rank_decay 0.3, typical of EAGLE heads)
# and a cap of 5 levels (uncapped, the 25 most probable paths would reach 8 levels).
DEFAULT_STATIC_PATHS: tuple[Path, ...] = most_probable_paths(25, 0.3, 5)


@dataclass(frozen=True)
class StaticLevel:
    """What a drafter needs to fill one level (depth) of a static tree."""

    depth: int
    expand: tuple[int, ...]  # [P] nodes at depth - 1 to run the head on, in index order
    rows: tuple[int, ...]  # [n] for each node of this level, its parent's row in `expand`
    ranks: tuple[int, ...]  # [n] for each node, its rank among the parent's children (0 = best)
    first: int  # this level's nodes are first .. first + n - 1


def fill_level(
    level: StaticLevel, parent_scores: torch.Tensor, parent_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [n] and scores [n] of a level's nodes.

    parent_scores: [P] scores of ``level.expand``; parent_logprobs: [P, V] the head's output there.
    """
    width = max(level.ranks) + 1
    logprobs, tokens = parent_logprobs.topk(width, dim=-1)  # [P, width]
    rows = torch.tensor(level.rows, device=tokens.device)  # [n]
    ranks = torch.tensor(level.ranks, device=tokens.device)  # [n]
    scores = parent_scores[rows].float() + logprobs[rows, ranks].float()  # [n]
    return tokens[rows, ranks], scores


@dataclass(frozen=True)
class StaticShape:
    """A fixed tree shape (EAGLE-1): node i > 0 is the path ``paths[i - 1]`` of child ranks."""

    paths: tuple[Path, ...]  # [N-1] in topological order: by depth, then lexicographic
    parents: tuple[int, ...]  # [N] parents[0] = -1
    levels: tuple[StaticLevel, ...]  # levels[d - 1] fills depth d

    @classmethod
    def from_paths(cls, paths: object) -> StaticShape:
        """Validate index paths, e.g. ``[(0,), (1,), (0, 0)]``; every prefix must be a path too."""
        ordered = sorted(_validated(paths), key=lambda p: (len(p), p))
        index = {path: i + 1 for i, path in enumerate(ordered)}
        parents = (-1,) + tuple(index.get(path[:-1], 0) for path in ordered)
        levels = []
        for depth in range(1, len(ordered[-1]) + 1):
            nodes = [i for i, path in enumerate(ordered, start=1) if len(path) == depth]
            expand = sorted({parents[i] for i in nodes})
            levels.append(
                StaticLevel(
                    depth=depth,
                    expand=tuple(expand),
                    rows=tuple(expand.index(parents[i]) for i in nodes),
                    ranks=tuple(ordered[i - 1][-1] for i in nodes),
                    first=nodes[0],
                )
            )
        return cls(tuple(ordered), parents, tuple(levels))

    @property
    def size(self) -> int:
        """N, nodes including the root."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return len(self.levels)

    def tree(self, root_token: int | torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> DraftTree:
        """Assemble the tree from the levels' outputs concatenated in order: tokens, scores [N-1]."""
        device = tokens.device
        root = torch.as_tensor(root_token, dtype=torch.int64, device=device).reshape(1)  # [1]
        depths = [0] + [len(path) for path in self.paths]
        return DraftTree(
            tokens=torch.cat([root, tokens.long()]),
            parents=torch.tensor(self.parents, dtype=torch.int64, device=device),
            depths=torch.tensor(depths, dtype=torch.int64, device=device),
            scores=torch.cat([scores.new_zeros(1), scores]).float(),
        )


def _validated(paths: object) -> list[Path]:
    """Paths as tuples, each a non-empty sequence of ranks >= 0, unique, prefixes present."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ConfigError(f"a static tree needs a non-empty list of index paths, got {paths!r}")
    result: list[Path] = []
    for path in paths:
        if (
            not isinstance(path, (list, tuple))
            or not path
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path)
        ):
            raise ConfigError(f"static tree path {path!r} must be a non-empty list of child ranks >= 0")
        result.append(tuple(path))
    known = set(result)
    if len(known) != len(result):
        duplicates = sorted({p for p in result if result.count(p) > 1})
        raise ConfigError(f"static tree paths {duplicates} appear more than once; list each path once")
    for path in result:
        if len(path) > 1 and path[:-1] not in known:
            raise ConfigError(
                f"static tree path {path} needs its prefix {path[:-1]}, which is missing; add it to the paths"
            )
    return result
