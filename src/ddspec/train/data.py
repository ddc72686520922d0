"""Stage 1 input: the training prompt mix.

The shipped training prompts (``ddspec.datasets.TRAIN_PROMPTS``) are 48% GSM8K and 29% code; heads trained on such a mix
draft chat and writing poorly. We cap each over-represented source and interleave sources so
that any prefix of the mix (a run stopped early) is itself balanced. Evaluation files are
never read here.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ddspec.datasets import open_text
from ddspec.errors import DdspecError

# per-source caps: GSM8K (math) and GPTeacher codegen dominate the file
DEFAULT_CAPS = {"gsm8k_train": 1500, "gpteacher_codegen": 1500}


@dataclass(frozen=True, slots=True)
class PromptRecord:
    id: str
    source: str
    text: str  # the user turn to answer
    history: tuple[tuple[str, str], ...] = ()  # earlier (role, content) messages of the chat, if any


@dataclass(slots=True)
class PromptFileReport:
    total_lines: int = 0
    bad_lines: list[int] | None = None  # 1-based line numbers skipped

    def describe(self) -> str:
        bad = self.bad_lines or []
        head = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        return f"{self.total_lines} lines, {len(bad)} skipped" + (f" (lines {head})" if bad else "")


def read_prompts(path: Path) -> tuple[list[PromptRecord], PromptFileReport]:
    """Parse a prompts JSONL; malformed lines are skipped and counted (with line numbers)."""
    if not path.is_file():
        raise DdspecError(f"prompt file not found: {path}")
    report = PromptFileReport(bad_lines=[])
    records: list[PromptRecord] = []
    with open_text(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            report.total_lines += 1
            try:
                row = json.loads(line)
                turns = row["turns"]
                text = turns[0] if isinstance(turns, list) else None
                if not isinstance(text, str) or not text.strip():
                    raise ValueError("no first turn")
                rid = str(row.get("id", row.get("question_id", n)))
                records.append(PromptRecord(rid, str(row.get("source", row.get("category", "unknown"))), text))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
                report.bad_lines.append(n)
    if not records:
        raise DdspecError(f"no usable prompts in {path} ({report.describe()})")
    return records, report


def balanced_mix(records: list[PromptRecord], caps: dict[str, int] = DEFAULT_CAPS, seed: int = 0) -> list[PromptRecord]:
    """Cap sources, shuffle within each, then interleave sources round-robin weighted by size."""
    rng = random.Random(seed)
    by_source: dict[str, list[PromptRecord]] = {}
    for r in records:
        by_source.setdefault(r.source, []).append(r)
    pools = []
    for source in sorted(by_source):
        rows = by_source[source][:]
        rng.shuffle(rows)
        pools.append(rows[: caps.get(source, len(rows))])
    total = sum(len(p) for p in pools)
    # each record gets a fractional "due time" i / len(pool); sorting by it interleaves sources
    keyed = [((i + rng.random()) / len(pool), r) for pool in pools for i, r in enumerate(pool)]
    keyed.sort(key=lambda kr: kr[0])
    mix = [r for _, r in keyed]
    assert len(mix) == total
    return mix


def length_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped by length for left- or right-padded batches: shortest first, each group as
    many as fit in ``budget`` padded tokens (its longest length x its size), at least one each."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
