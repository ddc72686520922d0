"""The fused head's extra input feature (shared by the head, its packed drafting copy and training)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fusion_input(states: list[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """The fused head's extra input: the listed residual streams, each RMS-normalised (no weight), concatenated."""
    return torch.cat([F.rms_norm(s.float(), (s.shape[-1],), None, eps) for s in states], dim=-1)
