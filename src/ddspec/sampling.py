"""Turning target logits into a distribution and drawing from it.

Pure tensor functions, shared by plain decoding and by lossless verification so that both
apply exactly the same transforms (temperature, then top-k, then top-p).
"""

from __future__ import annotations

import torch

from ddspec.config import SamplingConfig


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p.  logits: [..., V] -> [..., V] fp32.

    Must not be called with a greedy config (temperature 0): greedy uses argmax directly.
    """
    assert cfg.temperature > 0, "target_probs is for sampling; greedy uses argmax"
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is below top_p (the first one always stays)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each row of probs [..., V] -> [...] int64 (rows need not sum to 1).

    Inverse-CDF with one uniform per row: ~25x cheaper than torch.multinomial at V = 49k on
    our CPU. ``right=True`` makes a zero-probability token unreachable.
    """
    flat = probs.reshape(-1, probs.shape[-1]).double()  # [R, V]
    cdf = torch.cumsum(flat, dim=-1)  # [R, V]
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=flat.shape[-1] - 1)
    return idx.reshape(probs.shape[:-1])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] int64, the first index of each row's maximum (as torch.argmax).

    On a CPU, fp32: numpy's argmax, a tenth of torch's time over a 49k vocabulary (5 vs 61 us a
    row on our 2-core AMD EPYC), and every greedy step takes one per verified node."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() >= 1 and logits.shape[-1]:
        return torch.as_tensor(logits.detach().contiguous().numpy().argmax(axis=-1), dtype=torch.int64)
    return logits.argmax(dim=-1)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a sample, for logits [..., V] -> [...] int64."""
    if cfg.greedy:
        return argmax(logits)
    return sample(target_probs(logits, cfg), generator)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with `seed`, or from the OS entropy when seed is None."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
