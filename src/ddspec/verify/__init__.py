"""Verification: which drafted tokens the target accepts, and its bonus token.

Imports no model code: only torch, the standard library, ddspec's config/sampling and the
tree it verifies.
"""

from __future__ import annotations

from typing import Callable

import torch

from ddspec.config import SamplingConfig
from ddspec.tree.tree import DraftTree
from ddspec.verify.greedy import Verdict, verify_greedy, verify_greedy_reference
from ddspec.verify.sampling import verify_sampling, verify_sampling_reference


def verify(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig,
           uniform: Callable[[int], float] | None = None) -> Verdict:
    """Greedy verification at temperature 0, lossless sampling verification otherwise.

    logits: [N, V] the target's output at each node of `tree`; uniform: depth -> the uniform of
    the token after a node at that depth (sampling only; ``PositionNoise.after``).
    """
    if cfg.greedy:
        return verify_greedy(tree, logits)
    assert uniform is not None, "sampling verification needs the positions' uniforms"
    return verify_sampling(tree, logits, cfg, uniform)


__all__ = [
    "Verdict",
    "verify",
    "verify_greedy",
    "verify_greedy_reference",
    "verify_sampling",
    "verify_sampling_reference",
]
