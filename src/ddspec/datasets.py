"""The prompt sets that ship with ddspec: three evaluation sets and the training prompts.

Evaluation sets (for measuring only; never trained on), each a JSONL file of
``{"question_id", "category", "turns": [...]}`` records, named on the command line as
``--prompts mt-bench,humaneval,gsm8k``:

- ``mt-bench``: 80 two-turn chat prompts in 8 categories (lm-sys/FastChat, Apache-2.0)
- ``humaneval``: 80 code-completion prompts (openai/human-eval via SafeAILab/EAGLE, MIT / Apache-2.0)
- ``gsm8k``: 80 grade-school maths problems (GSM8K test via SafeAILab/EAGLE, MIT / Apache-2.0)

The training prompts (15,586 single-turn prompts, gzip-compressed JSONL, every exact match of an
evaluation prompt removed) are what ``ddspec train`` and ``ddspec train-ngrams`` answer with the
target by default. Provenance and licences: ``ddspec/data/README.md``.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO

from ddspec.errors import DdspecError

DATA = Path(__file__).with_name("data")
# name on the command line -> file (the file's stem names the set in reports: "mt_bench", ...)
EVAL_SETS = {"mt-bench": "mt_bench.jsonl", "humaneval": "humaneval.jsonl", "gsm8k": "gsm8k.jsonl"}
TRAIN_PROMPTS = DATA / "train_prompts.jsonl.gz"


def eval_set(name: str) -> Path:
    """The shipped file of an evaluation set (``mt-bench``; ``mt_bench`` is accepted too)."""
    key = name.strip().lower().replace("_", "-")
    if key not in EVAL_SETS:
        raise DdspecError(f"unknown prompt set {name!r}: the shipped sets are {', '.join(EVAL_SETS)} "
                          "(or give a JSONL file)")
    return DATA / EVAL_SETS[key]


def is_set_name(name: str) -> bool:
    return name.strip().lower().replace("_", "-") in EVAL_SETS


def resolve_prompt_sources(specs: list[str] | None) -> list[str] | None:
    """``--prompts`` values -> prompt files: each value is a JSONL file, or a comma-separated list
    of shipped set names (``mt-bench,humaneval,gsm8k``); None stays None (the caller's default)."""
    if not specs:
        return specs
    paths: list[str] = []
    for spec in specs:
        names = [n for n in spec.split(",") if n.strip()]
        if Path(spec).exists():
            paths.append(spec)
        elif all(is_set_name(n) for n in names):
            paths += [str(eval_set(n)) for n in names]
        else:
            raise DdspecError(f"--prompts {spec!r}: no such file, and not a shipped prompt set "
                              f"({', '.join(EVAL_SETS)}; comma-separated for several)")
    return paths


def open_text(path: Path) -> IO[str]:
    """A JSONL file for reading as UTF-8 text, gzip-compressed when its name ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")
