"""The drafter interface: propose a tree for the current state, observe the verdict.

The engine owns the target; a drafter owns whatever it needs to guess ahead (an EAGLE head
and its KV cache, an oracle, a random generator). Plain decoding uses no drafter at all.

Optional: ``score_for(sampling)``, called by the engine before each generation, for a drafter
whose tree scores depend on how tokens are chosen (the EAGLE drafter's greedy draft temperature).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ddspec.models.base import TargetOutput
from ddspec.tree import DraftTree
from ddspec.verify import Verdict


@runtime_checkable
class Drafter(Protocol):
    # HF hidden_states indices the drafter needs from every target forward (EAGLE-3); () for none
    hidden_layers: tuple[int, ...]

    @property
    def max_tree_size(self) -> int:
        """The largest tree propose() can return, root included (sizes the KV caches)."""

    def reset(self, max_length: int) -> None:
        """Start a new sequence with room for ``max_length`` positions."""

    def resume(self, max_length: int, length: int) -> None:
        """Continue a sequence whose first ``length`` committed positions stay (prefix reuse), with
        room for ``max_length`` positions; prefill() then takes in the prompt from ``length`` on."""

    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        """Take in the prompt [P] (from the first position not kept), the target's prefill output
        over it, and the first root token."""

    def propose(self, root: torch.Tensor, position: int) -> DraftTree:
        """A draft tree whose node 0 is ``root`` (at absolute ``position``)."""

    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        """Commit: learn which path was accepted, with the verification forward's outputs."""
