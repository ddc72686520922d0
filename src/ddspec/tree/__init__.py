"""Draft trees: the tree itself, how to build it, and when to stop growing it.

Imports no model code: only torch, the standard library and ddspec's config/errors.
"""

from ddspec.tree.build import (
    DEFAULT_STATIC_PATHS,
    Candidates,
    StaticLevel,
    StaticShape,
    expand_level,
    expand_root,
    fill_level,
    most_probable_paths,
    rerank,
)
from ddspec.tree.policy import DepthPolicy, DynamicDepth, FixedDepth, make_depth_policy
from ddspec.tree.tree import DraftTree

__all__ = [
    "DEFAULT_STATIC_PATHS",
    "Candidates",
    "DepthPolicy",
    "DraftTree",
    "DynamicDepth",
    "FixedDepth",
    "StaticLevel",
    "StaticShape",
    "expand_level",
    "expand_root",
    "fill_level",
    "make_depth_policy",
    "most_probable_paths",
    "rerank",
]
