"""Context tokens beside a reduced draft vocabulary.

A head with a reduced draft vocabulary (``d2t``: the most frequent tokens of its training
answers) can never draft a token outside it, and answers keep repeating rare tokens of their own
context: a name, a term, a word of the question. On MT-bench's 160 plain-decoded turns 6.5% of
the tokens lie outside the shipped head's 8,192, and 72% of those had already appeared in the
prompt or earlier in the answer (measured 2026-12-03 on the records of a `ddspec bench` run on AMD EPYC family 23).

When the head's logits come from the target's own lm_head (an EAGLE-1/2 head: its hidden state
is a predicted target feature), the rows for those tokens exist. :class:`ContextVocab` keeps the
context's tokens that the draft vocabulary lacks, up to ``capacity`` of them (the oldest give way
to the newest), with their lm_head rows, and the drafter scores them with the same hidden state
as an extension of the draft vocabulary: draft id ``Vd + j`` is the ``j``-th context token. The
draft stays a deterministic function of the context, so verification and losslessness are
untouched; only which tokens are drafted changes.
"""

from __future__ import annotations

import torch


class ContextVocab:
    def __init__(self, draft_ids: torch.Tensor, lm_head_oi: torch.Tensor, capacity: int) -> None:
        """draft_ids: [Vd] target ids of the reduced draft vocabulary; lm_head_oi: the target's lm_head
        [V, H] (a view is fine: only the added rows are copied); capacity: most tokens added (>= 1)."""
        self.base = draft_ids
        self.lm_head_oi = lm_head_oi
        self.capacity = capacity
        self.in_base = torch.zeros(lm_head_oi.shape[0], dtype=torch.bool, device=draft_ids.device)
        self.in_base[draft_ids] = True
        self.clear()

    def clear(self) -> None:
        """Forget the context (a new generation)."""
        self.in_set = self.in_base.clone()  # base or added
        self.seen: list[torch.Tensor] = []  # every context token taken in, position after position
        self.ids = self.base.new_zeros(0)  # [E] added target ids, oldest first
        self.weight = self.lm_head_oi.new_zeros(0, self.lm_head_oi.shape[1], dtype=torch.float32)  # [E, H]
        self.all_ids = self.base  # [Vd + E] target id of each draft id

    @property
    def size(self) -> int:
        return self.ids.numel()

    def add(self, tokens: torch.Tensor) -> None:
        """Take in context tokens [n] (target ids); those outside the draft vocabulary join it."""
        tokens = tokens.view(-1).to(self.in_set.device)
        self.seen.append(tokens)
        new = tokens[~self.in_set[tokens]]
        if new.numel() == 0:
            return
        new = _first_occurrences(new)
        self.in_set[new] = True
        ids = torch.cat([self.ids, new])
        rows = torch.cat([self.weight, self.lm_head_oi[new].float()])
        if ids.numel() > self.capacity:  # the oldest give way
            self.in_set[ids[: ids.numel() - self.capacity]] = False
            ids, rows = ids[-self.capacity:], rows[-self.capacity:]
        self.ids, self.weight = ids, rows.contiguous()
        self.all_ids = torch.cat([self.base, self.ids])

    def keep(self, length: int) -> None:
        """Keep the context's first ``length`` tokens only (a reused prefix: not the answer it dropped)."""
        kept = torch.cat(self.seen)[:length] if self.seen else self.base.new_zeros(0)
        self.clear()
        self.add(kept)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The added tokens' logits: hidden [n, H] -> [n, E]."""
        return hidden.float() @ self.weight.t()


def _first_occurrences(tokens: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``tokens`` in order of first occurrence."""
    uniq, inverse = torch.unique(tokens, return_inverse=True)
    first = torch.full((uniq.numel(),), tokens.numel(), dtype=torch.long, device=tokens.device)
    first.scatter_reduce_(0, inverse, torch.arange(tokens.numel(), device=tokens.device), reduce="amin")
    return uniq[torch.argsort(first)]
