"""Prompt lookup: draft the tokens that followed the last time the context's ending appeared.

No draft model at all (Saxena, "Prompt Lookup Decoding", 2023; HF's ``prompt_lookup_num_tokens``):
when the last n tokens (n = ``max_ngram`` down to ``min_ngram``) occurred earlier in the prompt or
the answer, the tokens that followed that occurrence become a chain of up to ``depth`` drafts.
Answers that quote or repeat their input (code edits, summaries, step-by-step arithmetic) get
several tokens per verification; otherwise the step is plain decoding. Drafting costs a dict
lookup, so on a CPU, where verifying a short chain costs little more than one token and a draft
head's level is dear, it can pay where a head does not. Lossless like every method: the target
verifies the chain (greedy or sampling, the draft is deterministic).

The n-grams ending at each committed position are indexed once, so a step costs O(max_ngram).
Where the context has no match, an :class:`~ddspec.draft.ngram_table.NgramTable` of the target's
own earlier answers, when given, offers what the target usually writes after the context's ending.
"""

from __future__ import annotations

import torch

from ddspec.draft.base import Drafter
from ddspec.models.base import TargetOutput
from ddspec.tree import DraftTree
from ddspec.verify import Verdict

DEPTH = 3  # chain length when the method name does not set one (lookup@d<depth>): 2-5 measured alike, 6 slower
COPY_DEPTH = 6  # ... after a match of the context's last max_ngram (3) tokens: a copy tends to go on (see LookupDrafter)
TABLE_ORDER = 100  # ``order`` of a table match: TABLE_ORDER + n for an n-token ending (kept apart from context matches)


class LookupDrafter(Drafter):
    def __init__(self, depth: int = DEPTH, max_ngram: int = 3, min_ngram: int = 2,
                 max_position: int | None = None, table=None, copy_depth: int | None = None) -> None:
        """max_position: the target's context window (drafts never go past it). table: an
        NgramTable asked when the context has no match (None: the context alone). copy_depth: the
        chain length after a match of the context's last ``max_ngram`` tokens (None: COPY_DEPTH
        when ``depth`` is the default, else ``depth``).

        Why longer chains there: a 3-token repeat of the context is usually a copy (code edits,
        quoted names, a list's pattern) that goes on. Replaying 240 held-out answers of the target
        (training prompts, the shipped table), 6 tokens after such a match instead of 3 raised τ
        1.99 -> 2.13 and tokens per unit of verification cost by 2.4%, under this Intel Xeon's
        measured forward costs (T(7) = 1.61 T(1)) and under steeper ones (T(7) = 1.85 T(1): +0.3%);
        in the engine, on 48 held-out prompts, lookup gained 1.0-1.3% (int8 and fp32, two runs each)."""
        copy_depth = (COPY_DEPTH if depth == DEPTH else depth) if copy_depth is None else copy_depth
        if depth < 1 or copy_depth < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup needs depth, copy_depth >= 1 and 1 <= min_ngram <= max_ngram, got {depth}, "
                             f"{copy_depth}, {min_ngram}, {max_ngram}")
        self.depth, self.max_ngram, self.min_ngram, self.max_position = depth, max_ngram, min_ngram, max_position
        self.copy_depth = copy_depth
        self.table = table
        self.tokens: list[int] = []  # committed tokens by position, then the current root
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the last position it ended at
        self._indexed = 0  # n-grams ending before this position are in the index
        self.order = 0  # n of the n-gram the latest continuation() matched (0: none)

    @property
    def max_drafts(self) -> int:
        """The longest chain a continuation can hold."""
        return max(self.depth, self.copy_depth)

    @property
    def max_tree_size(self) -> int:
        return self.max_drafts + 1

    def reset(self, max_length: int) -> None:
        self.tokens, self._index, self._indexed = [], {}, 0

    def resume(self, max_length: int, length: int) -> None:
        self.tokens, self._index, self._indexed = self.tokens[:length], {}, 0

    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        self.tokens += prompt.tolist() + [int(root)]

    def _update_index(self) -> None:
        """Index the n-grams ending at every position that has a successor (all but the root)."""
        t = self.tokens
        for end in range(self._indexed, len(t) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._index[tuple(t[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, len(t) - 1)

    def continuation(self, table: bool = True) -> list[int]:
        """The drafts for the current context: what followed the latest earlier occurrence of its
        longest indexed ending (at most ``depth`` tokens; ``copy_depth`` after a ``max_ngram``-token
        ending). A table, when given, is asked before a
        match on the context's last token alone: a 2-4 token ending of the target's usual text
        guesses better than one token (``order`` = TABLE_ORDER + n). [] when nothing matches.
        table=False: the context alone (a caller that knows no table chain would be verified)."""
        self._update_index()
        t = self.tokens
        for n in range(min(self.max_ngram, len(t)), self.min_ngram - 1, -1):
            if n == 1 and table and (drafts := self._from_table()):
                return drafts
            end = self._index.get(tuple(t[-n:]))
            if end is not None:
                self.order = n
                return t[end + 1:end + 1 + (self.copy_depth if n == self.max_ngram else self.depth)]
        if self.min_ngram > 1 and table and (drafts := self._from_table()):
            return drafts
        self.order = 0
        return []

    @property
    def orders(self) -> tuple[int, ...]:
        """The ``order`` values a continuation can have: the context's n-grams, then the table's."""
        return tuple(range(self.min_ngram, self.max_ngram + 1)) + self.table_orders

    @property
    def table_orders(self) -> tuple[int, ...]:
        """The ``order`` values a table match can have (none without a table)."""
        return () if self.table is None else tuple(TABLE_ORDER + n for n in self.table.orders)

    def _from_table(self) -> list[int]:
        if self.table is None:
            return []
        n, drafts = self.table.continuation(self.tokens)
        if drafts:
            self.order = TABLE_ORDER + n
        return drafts[:self.depth]

    def propose(self, root: torch.Tensor, position: int, drafts: list[int] | None = None) -> DraftTree:
        """A chain of the continuation's tokens (``drafts``: these instead, e.g. a continuation cut short)."""
        drafts = self.continuation() if drafts is None else drafts
        if self.max_position is not None:  # a draft at depth d sits at position + d
            drafts = drafts[:max(0, self.max_position - 1 - position)]
        if not drafts:
            return DraftTree.root_only(root)
        device = root.device if isinstance(root, torch.Tensor) else None  # the tree lives where the root does
        return DraftTree.host_chain([int(root)] + list(drafts), device)

    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        if tree.size > 1:  # (a plain step's tree is its root alone: no tensor op for it)
            self.tokens += tree.tokens[verdict.path[1:]].tolist()
        self.tokens.append(int(verdict.bonus))
