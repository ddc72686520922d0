"""Greedy τ without verification forwards: a head's trees checked against a recorded greedy answer.

Under greedy decoding the target's answer is known before any tree is drafted: plain decoding
gives it. A tree node is accepted exactly when its path from the root spells the answer's next
tokens, and a node's features are those of the same position in one pass over prompt + answer
(each row of a forward depends only on its own path: docs/kernels.md). :class:`ReplayTarget`
answers the engine's forwards from such a pass, so :class:`~ddspec.engine.Engine` runs a drafter
step by step as it would on the target (the same trees, paths, τ and tokens) while the only target
forwards are the plain decoding and one pass over its answer. On a CPU that is the difference
between hours and minutes for a 60-node tree on a 1.5B target, whose verification costs 10-20x a
token. It measures acceptance only: the verification's time and the equality of the outputs with
plain decoding (which the replay reproduces by construction) are the bench's to show.
"""

from __future__ import annotations

import torch

from ddspec.engine import Engine
from ddspec.models.base import TargetOutput


class ReplayTarget:
    """A target whose forwards are answered from one recorded pass over ``tokens`` (prompt + greedy
    answer): a row whose path (its mask's ancestors, or every earlier row without a mask) spells
    ``tokens`` at its positions gets that position's recorded features and hidden states and, as its
    argmax, the next token of ``tokens``; any other row gets zeros and argmax -1, which no token
    matches (its children are never accepted, as on the target, whose argmax there is the answer's
    token, not the node's). Everything else (the tokenizer, embeddings, ...) is the target's."""

    def __init__(self, target, tokens: list[int], features: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self._target = target
        self._tokens = torch.tensor(tokens, dtype=torch.long)
        self._features, self._hidden = features, hidden
        self._length, self._start = 0, 0

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    @property
    def cache_length(self) -> int:
        return self._length

    def reset(self, max_length: int) -> None:
        self._length = 0

    def reserve(self, max_length: int) -> None:
        pass

    def truncate(self, length: int) -> None:
        self._length = length

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the rows ``keep`` of the last forward (its accepted path, in order)."""
        self._length = self._start + int(keep.numel())

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                hidden_layers=(), last_logits: bool = False) -> TargetOutput:
        n, total = tokens.numel(), self._tokens.numel()
        tokens, positions = tokens.reshape(-1).cpu(), positions.reshape(-1).cpu()
        inside = positions < total
        at = positions.clamp(max=total - 1)
        ok = inside & (tokens == self._tokens[at])
        if mask is None:  # causal rows: each sees every earlier one
            on_path = torch.cumprod(ok.long(), 0).bool()
        else:  # mask[i, j]: j is i or an ancestor of i
            on_path = ~(mask.reshape(n, n).cpu() & ~ok.unsqueeze(0)).any(dim=-1)
        nxt = torch.where(positions + 1 < total, self._tokens[(positions + 1).clamp(max=total - 1)], -1)
        argmax = torch.where(on_path, nxt, torch.full_like(nxt, -1))
        keep = on_path.unsqueeze(1)
        features = torch.where(keep, self._features[at], torch.zeros((), dtype=self._features.dtype))
        hidden = {k: torch.where(keep, self._hidden[k][at], torch.zeros((), dtype=self._hidden[k].dtype))
                  for k in hidden_layers}
        self._start, self._length = self._length, self._length + n
        rows = 1 if last_logits else n
        return TargetOutput(logits=torch.zeros(rows, 1), features=features, hidden_states=hidden, argmax=argmax)


def recorded_pass(target, tokens: list[int], hidden_layers) -> tuple[torch.Tensor, dict]:
    """The target's features and ``hidden_layers`` at every position of ``tokens``, from one pass run as
    the engine prefills a prompt (its chunks: the same bits as one forward)."""
    target.reset(len(tokens) + 1)
    chunks = Engine(target)._prefill(torch.tensor(tokens, dtype=torch.long), 0, tuple(hidden_layers))
    try:
        forward = next(chunks)
        while True:
            forward = chunks.send(forward.run(target))
    except StopIteration as done:
        out = done.value
    target.reset(1)
    return out.features.detach().cpu(), {k: out.hidden_states[k].detach().cpu() for k in hidden_layers}
