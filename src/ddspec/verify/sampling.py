"""Lossless sampling verification: recursive rejection with a deterministic draft (EAGLE).

At the current node let p be the target distribution after the sampling transforms
(``target_probs``). Try its children in tree order; accept child x with probability p(x);
on rejection set p(x) = 0 and renormalise; if no child is accepted, the bonus token is drawn
from what remains of p. Every emitted token is then distributed exactly as the target's.

Randomness, fixed so that the fast and the reference verifier agree draw for draw: first one
uniform per drafted node (``torch.rand(N - 1)``, float64, node i uses entry i - 1), then one
``ddspec.sampling.sample`` draw for the bonus from the residual p (float32, unnormalised:
the draw normalises). Acceptance tests run in float64. All draws come from the caller's
``torch.Generator``, on its device.
"""

from __future__ import annotations

import torch

from ddspec.config import SamplingConfig
from ddspec.sampling import sample, target_probs
from ddspec.tree.tree import DraftTree
from ddspec.verify.greedy import Verdict


def verify_sampling(
    tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> Verdict:
    """Fast verification: all probabilities at once, then a walk over host lists.

    logits: [N, V] the target's output at each node. Two host syncs (tree structure, then
    the probabilities and uniforms), then one draw for the bonus.
    """
    probs = target_probs(logits, cfg)  # [N, V] float32
    uniforms = _uniforms(tree, generator)  # [N-1]
    child_p = probs[tree.parents[1:], tree.tokens[1:]].double()  # [N-1] p(node's token) at its parent
    totals = probs.double().sum(dim=-1)  # [N]
    tokens, parents = torch.stack([tree.tokens, tree.parents]).tolist()  # host sync
    values = torch.cat([child_p, totals, uniforms.to(totals.device)]).tolist()  # host sync
    n = tree.size
    p_child, total, u = values[: n - 1], values[n - 1 : 2 * n - 1], values[2 * n - 1 :]
    children = _children(parents)
    path = [0]
    while True:
        node, remaining, rejected = path[-1], total[path[-1]], []
        for child in children[node]:
            if _accepts(u[child - 1], p_child[child - 1], remaining):
                path.append(child)
                break
            remaining -= p_child[child - 1]
            rejected.append(tokens[child])
        else:
            rejected_tokens = torch.tensor(rejected, dtype=torch.int64, device=probs.device)  # [r]
            residual = probs[node].index_fill(0, rejected_tokens, 0.0)  # [V]
            return _verdict(path, residual, generator, logits.device)


def verify_sampling_reference(
    tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> Verdict:
    """The obvious loop, for tests: one node at a time, zeroing p(x) on each rejection."""
    u = _uniforms(tree, generator).tolist()
    tokens, children = tree.tokens.tolist(), _children(tree.parents.tolist())
    path = [0]
    while True:
        p = target_probs(logits[path[-1]], cfg)  # [V] float32
        for child in children[path[-1]]:
            x = tokens[child]
            if _accepts(u[child - 1], p[x].item(), p.double().sum().item()):
                path.append(child)
                break
            p[x] = 0.0
        else:
            return _verdict(path, p, generator, logits.device)


def _accepts(u: float, p_x: float, remaining: float) -> bool:
    """Accept x with probability p(x) / (mass p has left), i.e. p(x) after renormalising."""
    return u * remaining < p_x


def _uniforms(tree: DraftTree, generator: torch.Generator) -> torch.Tensor:
    """[N-1] float64 uniforms in [0, 1), one per drafted node, drawn before anything else."""
    return torch.rand(tree.size - 1, generator=generator, device=generator.device, dtype=torch.float64)


def _children(parents: list[int]) -> list[list[int]]:
    """children[i]: the child nodes of node i, in tree (index) order."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    return children


def _verdict(
    path: list[int], residual: torch.Tensor, generator: torch.Generator, device: torch.device
) -> Verdict:
    """The verdict once no child of path[-1] was accepted: draw the bonus from residual [V]."""
    bonus = sample(residual.to(generator.device), generator).to(device)  # []
    return Verdict(path=torch.tensor(path, dtype=torch.int64, device=device), bonus=bonus)
