"""Drafts from the target's own earlier answers: an n-gram table of what it tends to write next.

Prompt lookup (lookup.py) drafts only where the current context repeats itself. A small model
also repeats itself *across* answers: the same openings, list markers, code idioms and closing
phrases. This table holds, for the 4-, 3- and 2-token endings seen at least ``min_count`` times
in the target's greedy answers to training prompts, the continuation it most often wrote after
them (up to ``depth`` tokens): the first token is the most frequent next token, each further one
the most frequent after that prefix. Each token carries its share: the fraction of the ending's
occurrences that went on with the whole prefix up to it, and the continuation is cut where the
share falls below ``min_share``.

Drafting from it costs a dict lookup. The target verifies every draft, so the output is exactly
plain decoding's whatever the table holds (a table from another model only guesses worse; one
for another vocabulary is refused). In the spirit of REST (He et al., 2023, "REST: Retrieval-Based
Speculative Decoding"), with the datastore made of the target's own greedy text.

File: safetensors with ``grams`` [M, 4] (the ending, left-padded), ``orders`` int8 [M], ``tokens``
[M, depth] (padded) and ``shares`` uint8 [M, depth] (share x 255), plus metadata (the target's name
and vocabulary size, how the table was built). Token ids are uint16 padded with 65535 when every id
is below that (half the bytes), else int32 padded with -1.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from ddspec.errors import DdspecError

ORDERS = (4, 3, 2)  # endings looked up, longest first
DEPTH = 6  # tokens kept per continuation
U16_PAD = 65535  # padding of uint16 token ids
LOOKUP_SHARE = 0.3  # lookups cut a continuation below this share (or the share the table was built with, if higher)
TABLES_DIR = Path(__file__).resolve().parent.parent / "tables"
SHIPPED_TABLES = {"SmolLM2-135M-Instruct": TABLES_DIR / "smollm2-135m-instruct.ngrams.safetensors"}


class NgramTable:
    def __init__(self, entries: Mapping[tuple[int, ...], tuple[list[int], list[float]]], meta: dict,
                 min_share: float = LOOKUP_SHARE) -> None:
        """entries: ending -> (continuation tokens, their shares). min_share: where lookups cut a
        continuation (at least the share it was built with)."""
        self.entries, self.meta, self.min_share = entries, meta, min_share
        lengths = set(entries.orders.tolist()) if isinstance(entries, SortedEntries) else {len(k) for k in entries}
        self.orders = tuple(sorted(lengths, reverse=True)) or ORDERS

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def build(cls, sequences: Iterable[list[int]], meta: dict, orders: tuple[int, ...] = ORDERS, depth: int = DEPTH,
              min_count: int = 3, min_share: float = 0.25) -> "NgramTable":
        """The table of these token sequences (the target's answers)."""
        if not orders or min(orders) < 1 or max(orders) > 4 or depth < 1 or min_count < 1:
            raise ValueError(f"bad table settings: orders {orders}, depth {depth}, min_count {min_count}")
        after: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
        for seq in sequences:
            seq = list(seq)
            for n in orders:
                for i in range(n, len(seq)):
                    after[tuple(seq[i - n:i])].append(tuple(seq[i:i + depth]))
        entries = {}
        for ending, conts in after.items():
            total = len(conts)
            if total < min_count:
                continue
            tokens, shares = [], []
            for d in range(depth):  # walk down the most frequent branch
                counts = Counter(c[d] for c in conts if len(c) > d)
                if not counts:
                    break
                token, count = counts.most_common(1)[0]
                if count / total < min_share:
                    break
                tokens.append(token)
                shares.append(count / total)
                conts = [c for c in conts if len(c) > d and c[d] == token]
            if tokens:
                entries[ending] = (tokens, shares)
        meta = dict(meta, orders=list(orders), depth=depth, min_count=min_count, min_share=min_share)
        return cls(entries, meta, max(min_share, LOOKUP_SHARE))

    def continuation(self, tokens: list[int]) -> tuple[int, list[int]]:
        """(n, drafts): the continuation stored for the longest ending of ``tokens`` in the table,
        cut where its share falls below ``min_share``; (0, []) when no ending is in it."""
        for n in self.orders:
            if n > len(tokens):
                continue
            entry = self.entries.get(tuple(tokens[-n:]))
            if entry is None:
                continue
            out = []
            for token, share in zip(*entry):
                if share < self.min_share:
                    break
                out.append(token)
            if out:
                return n, out
        return 0, []

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        keys = list(self.entries)
        depth = max((len(v[0]) for v in self.entries.values()), default=1)
        grams = torch.full((len(keys), 4), -1, dtype=torch.int32)
        tokens = torch.full((len(keys), depth), -1, dtype=torch.int32)
        shares = torch.zeros(len(keys), depth, dtype=torch.uint8)
        orders = torch.zeros(len(keys), dtype=torch.int8)
        for i, k in enumerate(keys):
            grams[i, 4 - len(k):] = torch.tensor(k, dtype=torch.int32)
            orders[i] = len(k)
            t, s = self.entries[k]
            tokens[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            shares[i, :len(s)] = torch.tensor([round(x * 255) for x in s], dtype=torch.uint8)
        if max([int(x.max()) for x in (grams, tokens) if x.numel()] + [0]) < U16_PAD:  # (a table may be empty)
            grams, tokens = (x.masked_fill(x < 0, U16_PAD).to(torch.uint16) for x in (grams, tokens))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"grams": grams, "orders": orders, "tokens": tokens, "shares": shares}, str(tmp),
                  metadata={"ddspec_ngrams": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "NgramTable":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise DdspecError(f"no n-gram table at {path}: give a file written by `ddspec ngrams`, or "
                              "--ngram-table none")
        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("ddspec_ngrams", "null"))
                t = {k: f.get_tensor(k) for k in ("grams", "orders", "tokens", "shares")}
        except Exception as e:  # a file of another kind, or truncated
            raise DdspecError(f"{path} is not an n-gram table written by `ddspec ngrams` ({e})") from e
        if not isinstance(meta, dict):
            raise DdspecError(f"{path} is not an n-gram table written by `ddspec ngrams` (no ddspec_ngrams metadata)")
        for key in ("grams", "tokens"):
            if t[key].dtype == torch.uint16:
                x = t[key].to(torch.int32)
                t[key] = x.masked_fill(x == U16_PAD, -1)
        entries = SortedEntries(*(t[k].numpy() for k in ("grams", "orders", "tokens", "shares")))
        return cls(entries, meta, max(float(meta.get("min_share", LOOKUP_SHARE)), LOOKUP_SHARE))

    def check_target(self, target) -> None:
        """Refuse a table made for another vocabulary (its token ids would mean other tokens)."""
        vocab = self.meta.get("vocab_size")
        if vocab is not None and vocab != target.info.vocab_size:
            raise DdspecError(f"the n-gram table was made for a vocabulary of {vocab} tokens "
                              f"({self.meta.get('target', '?')}), but {target.info.name} has {target.info.vocab_size}: "
                              "make one for this model with `ddspec ngrams`, or pass --ngram-table none")


_MASK64 = (1 << 64) - 1


def ending_key(ending: tuple[int, ...]) -> int:
    """A 64-bit key of an ending of up to 4 tokens: (id + 1) in 16 bits each, left-padded with 0,
    so distinct for ids below 65535 (a larger vocabulary's keys may coincide: lookups compare the
    ending itself)."""
    key = 0
    for x in (-1,) * (4 - len(ending)) + tuple(ending):
        key = ((key << 16) + x + 1) & _MASK64
    return key


class SortedEntries(Mapping):
    """A loaded table's entries (ending -> (continuation, shares)), kept in the file's arrays sorted
    by :func:`ending_key` and found by binary search: no Python object per ending. Opened as a
    dict, the shipped table of 314,063 endings took 1.3-2.0 s (94,473 endings: 0.47 s), which every
    one-shot ``ddspec generate`` paid; this takes 0.07-0.14 s (0.02 s), and a lookup a few
    microseconds against a dict's fraction of one (Intel Xeon family 6 model 167, idle)."""

    def __init__(self, grams: np.ndarray, orders: np.ndarray, tokens: np.ndarray, shares: np.ndarray) -> None:
        """grams [M, 4] (endings left-padded with -1), orders [M], tokens [M, depth] (padded with -1),
        shares uint8 [M, depth] (share x 255)."""
        grams, tokens = grams.astype(np.int64), tokens.astype(np.int64)
        keys = np.zeros(len(grams), dtype=np.uint64)
        for j in range(4):
            keys = (keys << np.uint64(16)) + (grams[:, j] + 1).astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        self.keys, self.grams, self.tokens = keys[order], grams[order], tokens[order]
        self.orders = orders.astype(np.int64)[order]
        self.shares = shares[order].astype(np.float32) / np.float32(255)
        self.lengths = (self.tokens >= 0).sum(axis=1)

    def _row(self, ending: tuple[int, ...]) -> int:
        if not 1 <= len(ending) <= 4:
            return -1
        key = np.uint64(ending_key(ending))
        i = int(np.searchsorted(self.keys, key))
        while i < len(self.keys) and self.keys[i] == key:
            if self.orders[i] == len(ending) and tuple(self.grams[i, 4 - len(ending):].tolist()) == ending:
                return i
            i += 1
        return -1

    def __getitem__(self, ending: tuple[int, ...]) -> tuple[list[int], list[float]]:
        i = self._row(tuple(ending))
        if i < 0:
            raise KeyError(ending)
        n = int(self.lengths[i])
        return self.tokens[i, :n].tolist(), self.shares[i, :n].tolist()

    def __contains__(self, ending) -> bool:
        return self._row(tuple(ending)) >= 0

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        for g, n in zip(self.grams.tolist(), self.orders.tolist()):
            yield tuple(g[4 - n:])

    def __len__(self) -> int:
        return len(self.keys)


def table_path(spec: str | None, target) -> Path | None:
    """The file --ngram-table names: 'auto' = the one shipped for this target (None if none ships),
    'none' = None, else the path given."""
    if spec in (None, "none"):
        return None
    if spec == "auto":
        path = SHIPPED_TABLES.get(target.info.name)
        return path if path is not None and path.is_file() else None
    return Path(spec)


def resolve_table(spec: str | None, target) -> NgramTable | None:
    """The table for --ngram-table (see :func:`table_path`). A file is read once per process (the
    bench and the server build several drafters)."""
    path = table_path(spec, target)
    if path is None:
        return None
    stamp = path.stat().st_mtime_ns if path.is_file() else None
    table = _load_cached(str(path.resolve()), stamp)
    table.check_target(target)
    return table


@lru_cache(maxsize=4)
def _load_cached(path: str, stamp: int | None) -> NgramTable:  # stamp: a rewritten file is read again
    return NgramTable.load(path)


def table_description(spec: str, target) -> str:
    """What --ngram-table names, for reports: the file and its size, or none."""
    path = table_path(spec, target)
    if path is None or not path.is_file():
        return "none" + (" (none ships for this model)" if spec == "auto" else "")
    return f"{path} ({path.stat().st_size / 1e6:.1f} MB; methods named ...@g0 run without it)"
