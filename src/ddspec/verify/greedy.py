"""Greedy verification (temperature 0) and the verdict every verifier returns.

Glossary (docs/design.md §1): **accepted** nodes are drafted tokens the target agrees with in
this step; the **bonus** token is the target's own next token after the last accepted node
and becomes the next root. A step emits ``accepted + 1`` tokens.

Greedy rule: walk from the root; at each accepted node take the target's argmax; if a child
carries it, accept that child and go on, else stop; the argmax at the last accepted node is
the bonus. Siblings carry distinct tokens (a DraftTree invariant), so the walk is unique.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from ddspec.sampling import argmax
from ddspec.tree.tree import DraftTree

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Verdict:
    """The outcome of verifying one tree."""

    path: torch.Tensor  # [a+1] int64 node indices: path[0] = 0 (the root), then accepted nodes by depth
    bonus: torch.Tensor  # [] int64 the target's next token after path[-1]; the next root

    @property
    def accepted(self) -> int:
        """a, the number of accepted drafted tokens (no sync: a shape)."""
        return self.path.shape[0] - 1

    def emitted(self, tree: DraftTree) -> torch.Tensor:
        """[a+1] int64 tokens this step emits: the accepted nodes' tokens, then the bonus."""
        return torch.cat([tree.tokens[self.path[1:]], self.bonus.reshape(1)])


def verify_greedy(tree: DraftTree, logits: torch.Tensor, best: torch.Tensor | None = None) -> Verdict:
    """Vectorised greedy verification.  logits: [N, V], the target's output at each node; best:
    their argmax [N] when the forward took it already (TargetOutput.argmax), else taken here.

    Node i matches when its token is the argmax at its parent; it is accepted when it and
    all its non-root ancestors match. The deepest accepted node ends the path. One host sync.
    """
    target = argmax(logits) if best is None else best  # [N] the target's own next token after each node
    if tree.size == 1:  # plain decoding's step: the root alone, its argmax the bonus
        return Verdict(path=torch.zeros(1, dtype=torch.int64, device=target.device), bonus=target[0])
    if target.device.type == "cpu":  # small trees on a CPU: one walk over host lists beats a dozen tensor ops
        return _walk(tree, target)
    return _vectorised(tree, target)


def _vectorised(tree: DraftTree, target: torch.Tensor) -> Verdict:
    """verify_greedy as tensor ops on the device, one host sync. target: [N] argmax at each node."""
    match = tree.tokens == target[tree.parents.clamp(min=0)]  # [N]
    match[0] = True  # the root is not a drafted token
    ancestors = tree.attention_mask()  # [N, N] row i: i's ancestors and i
    accepted = ~(ancestors & ~match).any(dim=-1)  # [N] every node on the path matches
    last = torch.where(accepted, tree.depths, -1).argmax()  # [] deepest accepted node
    path = ancestors[last].nonzero().squeeze(1)  # [a+1] host sync; ancestors ascend in index
    return Verdict(path=path, bonus=target[last])


def walk(tree: DraftTree, token_at: Callable[[int], T]) -> tuple[list[int], T]:
    """From the root, step to the child carrying ``token_at(node)`` (the target's token there:
    its argmax, or its sample) until no child does, on host lists. Returns the path of node
    indices and the target's token at its last node (the bonus)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}  # siblings are distinct
    path = [0]
    while True:
        token = token_at(path[-1])
        nxt = child.get((path[-1], int(token)))
        if nxt is None:
            return path, token
        path.append(nxt)


def _walk(tree: DraftTree, target: torch.Tensor) -> Verdict:
    """verify_greedy on host lists."""
    path, _ = walk(tree, target.tolist().__getitem__)
    return Verdict(path=torch.tensor(path, dtype=torch.int64), bonus=target[path[-1]])


def walk_reference(tree: DraftTree, token_at: Callable[[int], int], device: torch.device) -> Verdict:
    """The obvious loop, for tests: walk down from the root while a child carries ``token_at(node)``,
    scanning every node for the children."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path = [0]
    while True:
        token = token_at(path[-1])
        children = [c for c in range(len(tokens)) if parents[c] == path[-1] and tokens[c] == token]
        if not children:
            return Verdict(
                path=torch.tensor(path, dtype=torch.int64, device=device),
                bonus=torch.tensor(token, dtype=torch.int64, device=device),
            )
        path.append(children[0])


def verify_greedy_reference(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """The obvious loop, for tests: walk down from the root while a child is the argmax."""
    return walk_reference(tree, lambda node: int(logits[node].argmax()), logits.device)
