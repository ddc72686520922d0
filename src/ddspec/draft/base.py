"""The drafter interface: propose a tree for the current state, observe the verdict.

The engine owns the target; a drafter owns whatever it needs to guess ahead (an EAGLE head
and its KV cache, an oracle, a random generator). Plain decoding uses no drafter at all.

Every drafter subclasses :class:`Drafter` and implements its abstract methods. The engine also
calls three optional hooks on every drafter, declared here with defaults that do nothing, so a
drafter overrides only those it needs:

- ``score_for(sampling)``, before each generation: for a drafter whose tree scores depend on how
  tokens are chosen (the EAGLE drafter's greedy draft temperature);
- ``observe_step(...)`` after each step, and ``prediction``: for a drafter that learns from the
  step times the engine measures and forecasts its steps (the cost-aware EAGLE drafter).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ddspec.config import SamplingConfig
from ddspec.models.base import TargetOutput
from ddspec.tree import DraftTree
from ddspec.verify import Verdict


class Drafter(ABC):
    # HF hidden_states indices the drafter needs from every target forward (EAGLE-3); () for none
    hidden_layers: tuple[int, ...] = ()

    @property
    @abstractmethod
    def max_tree_size(self) -> int:
        """The largest tree propose() can return, root included (sizes the KV caches)."""

    @abstractmethod
    def reset(self, max_length: int) -> None:
        """Start a new sequence with room for ``max_length`` positions."""

    @abstractmethod
    def resume(self, max_length: int, length: int) -> None:
        """Continue a sequence whose first ``length`` committed positions stay (prefix reuse), with
        room for ``max_length`` positions; prefill() then takes in the prompt from ``length`` on."""

    @abstractmethod
    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        """Take in the prompt [P] (from the first position not kept), the target's prefill output
        over it, and the first root token."""

    @abstractmethod
    def propose(self, root: torch.Tensor, position: int) -> DraftTree:
        """A draft tree whose node 0 is ``root`` (at absolute ``position``)."""

    @abstractmethod
    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        """Commit: learn which path was accepted, with the verification forward's outputs."""

    # -- optional hooks: the defaults do nothing ------------------------------------------
    def score_for(self, sampling: SamplingConfig) -> None:
        """How the coming generation chooses its tokens (the engine calls it once, before the
        prefill). A drafter whose tree scores forecast acceptance differently under greedy
        decoding and sampling sets its scores up here. Default: scores do not depend on it."""

    def observe_step(self, tokens: int, tree_size: int, draft_ms: float, verify_ms: float, gap_ms: float) -> None:
        """The engine's measurement of the step just finished (after observe()): ``tokens`` emitted,
        ``tree_size`` nodes verified, and the ms of its draft phase, its verify phase (forward,
        acceptance, commit) and the gap since the previous step outside both. Called under seeded
        sampling too: its tokens do not depend on the trees (docs/design.md §2.5). Default: nothing learned."""

    @property
    def prediction(self) -> tuple[float, float] | None:
        """(expected tokens, expected ms) of the step last proposed, which the engine records in the
        step's stats before observe_step(); None: this drafter makes no forecast (the default)."""
        return None
