"""Lossless sampling verification: the target's own sample at each node, matched like greedy.

At a node at depth d the target's next token is ``sample(target_probs(logits[node]), u(d))``:
the inverse-CDF draw of the target's distribution (after the sampling transforms) with the
uniform of the position after that node. Walk from the root: if a child carries that token,
accept it and go on; otherwise that token is the bonus. This is greedy verification with the
argmax replaced by the target's sample.

Why this rule (rather than recursive rejection over the children): the uniform belongs to the
position, not to the tree (``ddspec.sampling.PositionNoise``), so every emitted token is the
token plain decoding would have sampled at that position with the same seed, whatever tree the
drafter proposed. Seeded output is then the same for every method and every tree size, and so
independent of the step timings the cost-aware method sizes its trees from. It is lossless for
any draft that does not see the uniforms: each position's token is a draw of the target's
distribution given the prefix, with a uniform no earlier choice depended on. It also accepts
exactly as often: with a deterministic draft, recursive rejection accepts child x with
probability p(x) and emits its bonus from what remains of p; here the target's token is x with
probability p(x) and otherwise another token with the same residual distribution, so the
(accepted path, bonus) pair has the same distribution under both rules (and τ is unchanged).

Randomness: ``uniform(d)``, a callable from a node's depth to a float in [0, 1); the engine
passes ``PositionNoise.after(root position)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from ddspec.config import SamplingConfig
from ddspec.sampling import sample, target_probs
from ddspec.tree.tree import DraftTree
from ddspec.verify.greedy import Verdict, verify_greedy, walk, walk_reference


def verify_sampling(
    tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, uniform: Callable[[int], float]
) -> Verdict:
    """Fast verification.  logits: [N, V] the target's output at each node.

    On a CPU the walk computes the target's distribution only at the nodes it visits (accepted
    + 1 rows of the vocabulary, not N). Elsewhere every node's sample is taken in one batch and
    the walk is greedy's, one host sync.
    """
    if logits.device.type == "cpu":
        return _walk(tree, logits, cfg, uniform)
    return _vectorised(tree, logits, cfg, uniform)


def _walk(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, uniform: Callable[[int], float]) -> Verdict:
    """verify_sampling on host lists, sampling at the visited nodes alone."""
    depths = tree.depths.tolist()
    path, drawn = walk(tree, lambda node: sample(target_probs(logits[node], cfg), uniform(depths[node])))
    return Verdict(path=torch.tensor(path, dtype=torch.int64), bonus=drawn)


def _vectorised(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, uniform: Callable[[int], float]) -> Verdict:
    """verify_sampling as tensor ops: every node's sample in one batch, then greedy's rule."""
    deepest = int(tree.depths.max())
    per_depth = torch.tensor([uniform(d) for d in range(deepest + 1)], dtype=torch.float64, device=logits.device)
    drawn = sample(target_probs(logits, cfg), per_depth[tree.depths.to(logits.device)])  # [N]
    return verify_greedy(tree, logits, drawn)


def verify_sampling_reference(
    tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, uniform: Callable[[int], float]
) -> Verdict:
    """The obvious loop, for tests: at each node, the target's token by a plain scan of its
    cumulative mass, then the children scanned for it."""
    depths = tree.depths.tolist()

    def drawn(node: int) -> int:
        p = target_probs(logits[node], cfg).tolist()
        threshold, mass = uniform(depths[node]) * sum(p), 0.0
        for token, q in enumerate(p):
            mass += q
            if q > 0 and mass > threshold:
                return token
        return max(t for t, q in enumerate(p) if q > 0)  # when rounding leaves the threshold at the total

    return walk_reference(tree, drawn, logits.device)
