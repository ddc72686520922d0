"""A dynamic (EAGLE-2) tree's bookkeeping on host lists, for drafters that run on a CPU.

:func:`~ddspec.tree.build.expand_root`, :func:`~ddspec.tree.build.expand_level` and
:func:`~ddspec.tree.build.rerank` keep the candidates in tensors, so that a GPU drafter never
waits on the host. On a CPU every tensor op costs a few microseconds of dispatch whatever its
size, and a tree of a few dozen nodes took about 0.5 ms of such ops per drafted step (rerank
alone 0.29 ms, Intel Xeon family 6 model 207): as much as the head's own matmuls. Here the same
three steps run on Python lists, and the tree becomes tensors once, at the end. Given the same top-k inputs they choose the same nodes in the same order
(tests/test_tree_host.py), except among exactly equal scores, where ``torch.topk`` leaves the
order open and these take the earlier candidate.

Scores stay float32 values, as in the tensor version: a child's score is its parent's plus its
own log-prob, rounded to float32 (the double sum of two floats rounds to the float sum exactly).
"""

from __future__ import annotations

from array import array

import torch

from ddspec.tree.tree import DraftTree


class HostCandidates:
    """Every node produced while expanding a dynamic tree (the root is not a candidate), as lists;
    ``scores`` float32 values (sums of draft log-probs from the root)."""

    __slots__ = ("tokens", "parents", "depths", "scores")

    def __init__(self, tokens: list[int], logprobs: list[float]) -> None:
        """Level 1: the root's top-k children ``tokens`` [k] with their log-probs [k] (float32 values, descending)."""
        self.tokens = list(tokens)
        self.parents = [-1] * len(tokens)
        self.depths = [1] * len(tokens)
        self.scores = list(logprobs)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def expand(self, frontier: list[int], logprobs: list[list[float]], tokens: list[list[int]], top_k: int) -> list[int]:
        """One more level (:func:`~ddspec.tree.build.expand_level`): the children ``tokens`` [f][c] of
        the frontier nodes (candidate indices [f]) with their log-probs [f][c] join the candidates;
        returns the next frontier, the indices of the ``top_k`` best children overall."""
        scores = array("f", [self.scores[p] + lp for p, row in zip(frontier, logprobs) for lp in row]).tolist()
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_k]
        base = len(self.tokens)
        width = len(tokens[0]) if tokens else 0
        for parent, row in zip(frontier, tokens):
            self.tokens += row
            self.parents += [parent] * width
            self.depths += [self.depths[parent] + 1] * width
        self.scores += scores
        return [base + i for i in best]

    def tree(self, root_token: int, total_tokens: int, token_ids=None, chain: list[int] | None = None,
             max_depth: int | None = None, device: torch.device | None = None) -> tuple[DraftTree, int]:
        """The root + the ``total_tokens - 1`` best-scoring candidates (:func:`~ddspec.tree.build.rerank`:
        by depth, then by score descending, ties to the earlier candidate), then ``chain`` merged in
        as :meth:`DraftTree.with_chain` does. token_ids(list of draft ids) -> list of target ids, or
        None (draft ids are target ids). Returns (tree, chain nodes added)."""
        scores = self.scores
        keep = min(total_tokens - 1, len(scores))
        chosen = sorted(range(len(scores)), key=lambda i: (-scores[i], self.depths[i]))[:keep]
        order = sorted(chosen, key=lambda i: (self.depths[i], -scores[i]))
        node_of = {c: j for j, c in enumerate(order, start=1)}
        parents = [-1]
        for c in order:
            p = self.parents[c]
            assert p < 0 or p in node_of, "rerank kept a node without its parent"
            parents.append(0 if p < 0 else node_of[p])
        drafted = [self.tokens[c] for c in order]
        tokens = [int(root_token)] + (drafted if token_ids is None or not drafted else token_ids(drafted))
        depths = [0] + [self.depths[c] for c in order]
        node_scores = [0.0] + [scores[c] for c in order]
        added = DraftTree.merge_chain(tokens, parents, depths, node_scores, chain or [], max_depth)
        return DraftTree.from_host(tokens, parents, depths, node_scores, device), added


def host_list(values: torch.Tensor | list) -> list:
    """Values as a host list: a CPU drafter's lists pass as they are, a tensor is read (a host sync
    on a GPU). Where the cost-aware policy and its acceptance map take a drafter's scores and verdicts."""
    return values if isinstance(values, list) else values.tolist()
