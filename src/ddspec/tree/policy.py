"""Depth policies: when to stop expanding the draft tree.

Level convention: level d is the set of nodes at depth d. Level 1 is the root's top-k
children (produced from the head's output at the root), so a tree expanded to level L is L
tokens deep. ``continue_after(level, frontier_scores)`` is called once each level has been
produced, with that level's frontier scores ([k] log-probabilities); True means "run the
head on the frontier and produce level + 1". A policy that answers False after level L
yields a tree of depth L. DDD's check levels (5, 7, 9) and max depth (11) use this
convention, the same as ``TreeConfig``.

Host syncs: the fixed policy never syncs; DDD syncs once per check (``logsumexp(...).item()``)
and counts it in ``syncs``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ddspec.config import TreeConfig
from ddspec.errors import ConfigError
from ddspec.tree.build import DEFAULT_STATIC_PATHS, StaticShape


class DepthPolicy(Protocol):
    """Decides, after each level, whether to draft one more."""

    syncs: int  # host-device syncs forced so far

    def continue_after(self, level: int, frontier_scores: torch.Tensor) -> bool: ...


class FixedDepth:
    """Draft exactly `depth` levels."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ConfigError(f"a fixed draft depth must be >= 1, got {depth}")
        self.depth = depth
        self.syncs = 0

    def continue_after(self, level: int, frontier_scores: torch.Tensor) -> bool:
        return level < self.depth

    def __repr__(self) -> str:
        return f"FixedDepth(depth={self.depth})"


class DynamicDepth:
    """Dynamic Depth Decoding (arXiv 2409.00142).

    After each level in `check_depths`, stop when the beam's total draft probability
    ``H = logsumexp(frontier scores)`` is below `threshold`; never go past `max_depth`.
    Between checks it continues without looking at the scores (no sync).
    """

    def __init__(self, threshold: float, check_depths: tuple[int, ...], max_depth: int) -> None:
        if max_depth < 1 or any(level < 1 for level in check_depths):
            raise ConfigError(f"DDD levels must be >= 1, got checks {check_depths}, max_depth {max_depth}")
        self.threshold = threshold
        self.check_depths = frozenset(check_depths)
        self.max_depth = max_depth
        self.syncs = 0

    def continue_after(self, level: int, frontier_scores: torch.Tensor) -> bool:
        if level >= self.max_depth:
            return False
        if level not in self.check_depths:
            return True
        self.syncs += 1
        if isinstance(frontier_scores, list):  # a CPU drafter's host list (tree/host.py)
            frontier_scores = torch.tensor(frontier_scores)
        mass = torch.logsumexp(frontier_scores.float(), dim=0).item()  # host sync, counted
        return mass >= self.threshold

    def __repr__(self) -> str:
        checks = tuple(sorted(self.check_depths))
        return f"DynamicDepth(threshold={self.threshold}, check_depths={checks}, max_depth={self.max_depth})"


def make_depth_policy(cfg: TreeConfig) -> DepthPolicy:
    """The policy a TreeConfig asks for.

    Dynamic trees use `depth_policy` (fixed: cfg.depth levels; ddd: threshold, check levels,
    max_depth). A chain is cfg.depth long and a static tree is as deep as its paths; DDD does
    not apply to them.
    """
    if cfg.shape != "dynamic" and cfg.depth_policy == "ddd":
        raise ConfigError(
            f"depth policy 'ddd' needs a dynamic tree, but the tree shape is {cfg.shape!r}; "
            "use shape 'dynamic' or depth policy 'fixed'"
        )
    if cfg.shape == "static":
        return FixedDepth(StaticShape.from_paths(cfg.static_paths or DEFAULT_STATIC_PATHS).depth)
    if cfg.depth_policy == "ddd":
        return DynamicDepth(cfg.ddd_threshold, cfg.ddd_check_depths, cfg.max_depth)
    if cfg.depth_policy == "cost":
        raise ConfigError("the cost-aware policy needs measured costs: build it with ddspec.calibrate")
    return FixedDepth(cfg.depth)
