"""The draft tree: root + drafted nodes in topological order, and what is derived from it.

A tree of N nodes is four 1-D tensors on one device. Node 0 is the root (the newest token
already chosen from the target); every other node is a drafted token whose parent has a
smaller index (``parents[i] < i``), so the nodes are in topological order and one pass from
0 to N-1 visits parents before children. Siblings carry distinct tokens.

Host syncs: constructing a tree checks its invariants with one sync; ``leaf_paths`` and
``path_to`` read the parents to the host. ``attention_mask`` and ``positions`` never sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


_ROOT_ONLY: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # DraftTree.root_only


@dataclass(frozen=True, eq=False)  # eq on tensors is ambiguous: compare fields instead
class DraftTree:
    """Root + drafted nodes. Invariants are checked on construction (one host sync)."""

    tokens: torch.Tensor  # [N] int64, tokens[0] = the root token
    parents: torch.Tensor  # [N] int64, parents[0] = -1, 0 <= parents[i] < i for i > 0
    depths: torch.Tensor  # [N] int64, depths[0] = 0, depths[i] = depths[parents[i]] + 1
    scores: torch.Tensor  # [N] float32, sum of draft log-probs along the path, scores[0] = 0

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("tokens", "parents", "depths", "scores"):
            value = getattr(self, name)
            assert value.dim() == 1 and value.shape[0] == n and n >= 1, f"{name} must be [N], N >= 1"
        assert self.tokens.dtype == self.parents.dtype == self.depths.dtype == torch.int64
        assert self.scores.dtype == torch.float32, "scores must be float32"
        # a few dozen numbers: checked in plain Python, which beats a dozen tensor ops
        if self.tokens.device.type == "cpu":
            tokens, parents, depths = self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()
        else:  # host sync (one): the three rows read at once
            tokens, parents, depths = torch.stack([self.tokens, self.parents, self.depths]).tolist()
        for ok, what in zip(self._invariants(tokens, parents, depths), self._BROKEN):
            assert ok, what

    _BROKEN = ("node 0 must be the root: parents[0] = -1, depths[0] = 0, tokens >= 0",
               "nodes must be in topological order: 0 <= parents[i] < i for i > 0",
               "depths[i] must equal depths[parents[i]] + 1",
               "siblings must carry distinct tokens")

    @staticmethod
    def _invariants(tokens: list[int], parents: list[int], depths: list[int]) -> tuple[bool, bool, bool, bool]:
        """The four checks of ``_BROKEN``, in its order, on host lists: root, topological order,
        depths, distinct siblings."""
        root_ok = parents[0] == -1 and depths[0] == 0 and min(tokens) >= 0
        topo_ok = all(0 <= p < i for i, p in enumerate(parents) if i)
        depth_ok = all(depths[i] == depths[max(p, 0)] + 1 for i, p in enumerate(parents) if i)
        siblings_ok = len(set(zip(parents, tokens))) == len(tokens)
        return root_ok, topo_ok, depth_ok, siblings_ok

    @property
    def size(self) -> int:
        """N, the number of nodes including the root (no sync: a shape)."""
        return self.tokens.shape[0]

    @classmethod
    def _built(cls, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
               checked: bool = True) -> DraftTree:
        """A tree whose shape holds the invariants by construction (a root alone, a chain): only the
        tokens are checked (>= 0, one host sync on a GPU, as the full check; ``checked=False``: the
        caller checks). Plain decoding and lookup build one every step, and the full check's host
        conversions are per-step Python."""
        if checked:
            assert min(tokens.tolist()) >= 0, "tokens must be >= 0"
        tree = object.__new__(cls)
        for name, value in (("tokens", tokens), ("parents", parents), ("depths", depths), ("scores", scores)):
            object.__setattr__(tree, name, value)
        return tree

    @classmethod
    def root_only(cls, token: int | torch.Tensor) -> DraftTree:
        """The tree of plain decoding: the root alone. Its parents, depths and scores are shared
        constants per device (no tree is written in place): plain steps build one per sequence and
        step, and on a CPU each small tensor costs microseconds of Python."""
        tokens = torch.as_tensor(token, dtype=torch.int64).reshape(1)  # [1]
        shape = _ROOT_ONLY.get(tokens.device)
        if shape is None:
            zeros = torch.zeros(1, dtype=torch.int64, device=tokens.device)
            shape = _ROOT_ONLY[tokens.device] = (zeros - 1, zeros, torch.zeros(1, device=tokens.device))
        return cls._built(tokens, *shape)

    @classmethod
    def host_chain(cls, tokens: list[int], device: torch.device | None = None) -> DraftTree:
        """The chain of host token ids ``tokens`` (the root first), scored 0 (drafts without
        log-probs, e.g. copied from the context): :meth:`chain` from host lists, in four small tensor ops."""
        steps = torch.arange(len(tokens), dtype=torch.int64, device=device)
        return cls._built(torch.tensor(tokens, dtype=torch.int64, device=device), steps - 1, steps,
                          torch.zeros(len(tokens), device=device))

    @classmethod
    def chain(cls, root_token: int | torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> DraftTree:
        """A chain: root -> tokens[0] -> tokens[1] -> ...  tokens, logprobs: [d]."""
        if tokens.dim() != 1 or logprobs.shape != tokens.shape:
            raise ValueError(f"a chain needs tokens and logprobs of one shape [d], got {list(tokens.shape)} and "
                             f"{list(logprobs.shape)}")
        d = tokens.shape[0]
        root = torch.as_tensor(root_token, dtype=torch.int64, device=tokens.device).reshape(1)  # [1]
        steps = torch.arange(d + 1, dtype=torch.int64, device=tokens.device)  # [d+1]
        scores = torch.cat([logprobs.new_zeros(1).float(), logprobs.float().cumsum(0)])  # [d+1]
        return cls._built(torch.cat([root, tokens.long()]), steps - 1, steps, scores)

    @classmethod
    def from_host(cls, tokens: list[int], parents: list[int], depths: list[int], scores: list[float],
                  device: torch.device | None = None) -> DraftTree:
        """A tree from host lists, its invariants checked on the lists (no tensor read back)."""
        tree = cls._built(torch.tensor(tokens, dtype=torch.int64, device=device),
                          torch.tensor(parents, dtype=torch.int64, device=device),
                          torch.tensor(depths, dtype=torch.int64, device=device),
                          torch.tensor(scores, dtype=torch.float32, device=device), checked=False)
        for ok, what in zip(cls._invariants(tokens, parents, depths), cls._BROKEN):
            assert ok, what
        return tree

    @staticmethod
    def merge_chain(tokens: list[int], parents: list[int], depths: list[int], scores: list[float],
                    chain: list[int], max_depth: int | None = None) -> int:
        """Merge ``chain`` (tokens following the root) into the tree held by these host lists, in
        place, as :meth:`with_chain` describes; returns the number of nodes added."""
        if not chain:
            return 0
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
        node, added = 0, 0
        for token in chain:
            if max_depth is not None and depths[node] + 1 > max_depth:
                break
            child = children.get((node, token))
            if child is None:
                child = len(tokens)
                tokens.append(token), parents.append(node), depths.append(depths[node] + 1), scores.append(scores[node])
                added += 1
            node = child
        return added

    def with_chain(self, chain: list[int], max_depth: int | None = None) -> tuple[DraftTree, int]:
        """This tree with ``chain`` (tokens following the root) merged in as a path: the chain
        follows existing nodes while their tokens agree and continues as new nodes appended at
        the end (each scored like its parent: no draft log-prob of their own), at most
        ``max_depth`` deep. Returns (tree, nodes added). Host sync: the tree is read to lists."""
        if not chain:
            return self, 0
        tokens, parents, depths = self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()
        scores = self.scores.tolist()
        added = self.merge_chain(tokens, parents, depths, scores, chain, max_depth)
        if not added:
            return self, 0
        return DraftTree.from_host(tokens, parents, depths, scores, self.tokens.device), added

    def attention_mask(self) -> torch.Tensor:
        """[N, N] bool: row i is True exactly at i's ancestors and at i itself.

        Row i = row parents[i] | {i}, computed for all rows at once by pointer jumping:
        after r rounds each row holds the ancestors up to distance 2^r, so ceil(log2 N)
        rounds suffice whatever the depth (no sync).
        """
        n = self.size
        if self.depths.device.type == "cpu" and int(self.depths[-1]) == n - 1:
            # a chain (the last node n - 1 deep has every other node as an ancestor): the causal
            # mask, without the pointer jumping's dozen small ops (a lookup step's 4-node chain:
            # 0.07 -> 0.01 ms)
            return torch.ones(n, n, dtype=torch.bool).tril_()
        up = self.parents.clamp(min=0)  # [N], the root is its own parent here
        mask = torch.eye(n, dtype=torch.bool, device=up.device)  # [N, N]
        mask[torch.arange(n, device=up.device), up] = True  # distances 0 and 1
        for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
            mask = mask | mask[up]  # [N, N], distances 0 .. 2 * jump
            up = up[up]  # [N], ancestor at twice the distance (saturating at the root)
        return mask

    def positions(self, offset: int | torch.Tensor) -> torch.Tensor:
        """[N] int64 absolute positions: offset (the root's position) + depth."""
        return self.depths + offset

    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf node indices for every leaf, leaves in index order (host sync)."""
        parents = self.parents.tolist()  # host sync
        has_child = set(parents[1:])
        return [self._walk_up(parents, leaf) for leaf in range(len(parents)) if leaf not in has_child]

    def path_to(self, node: int) -> torch.Tensor:
        """[depth(node) + 1] int64 node indices from the root down to `node` (host sync)."""
        parents = self.parents.tolist()  # host sync
        return torch.tensor(self._walk_up(parents, node), dtype=torch.int64, device=self.parents.device)

    @staticmethod
    def _walk_up(parents: list[int], node: int) -> list[int]:
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]
