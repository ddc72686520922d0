"""What one arm's generation of one prompt returns (every arm of ddspec bench, llama.cpp's included)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddspec.engine import StepStats


@dataclass(slots=True)
class Generation:
    output_ids: list[int]  # new tokens, EOS included when generation stopped on it
    wall_s: float  # the whole call, prefill included
    finish_reason: str  # eos | length
    steps: list[StepStats] | None  # None: the arm does not expose its decoding steps
    # an arm without steps that reports its decoding time alone (llama.cpp's server): (tokens, seconds)
    decoding: tuple[int, float] | None = None
