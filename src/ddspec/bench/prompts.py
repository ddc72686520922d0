"""Benchmark prompts: reading JSONL prompt files, and a small built-in set.

A prompt file holds one JSON object per line (MT-bench / Spec-Bench layout)::

    {"question_id": 81, "category": "writing", "turns": ["first user message", "second one"]}

``id`` is accepted for ``question_id``; ``category`` is optional (``"uncategorized"``); blank
lines are skipped; extra keys (``reference``, ...) are ignored. Every mistake is reported as a
:class:`DdspecError` naming the file and the line.

The built-in set (used when no file is given) was written for ddspec: three prompts per
category, some with a second turn, so that a run with no arguments exercises multi-turn chat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ddspec.errors import DdspecError

BUILTIN_SOURCE = "builtin"
DEFAULT_CATEGORY = "uncategorized"


@dataclass(frozen=True, slots=True)
class Prompt:
    source: str  # the prompt file's stem (e.g. "mt_bench"), or "builtin"
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # user messages; turn n is answered with turns 1..n-1 (and answers) in the history


# (category, turns): ours, not taken from any evaluation set
_BUILTIN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("writing", ("Write a short letter from a lighthouse keeper to the ship that brings supplies each month.",
                 "Now rewrite the letter as a four-line poem.")),
    ("writing", ("Draft a friendly note asking neighbours to keep the shared garden gate closed.",)),
    ("writing", ("Describe a rainy morning at a train station in about one hundred words.",)),
    ("reasoning", ("Anna is taller than Ben, and Ben is taller than Carl. Who is the shortest? Explain.",
                   "If Dan is shorter than Carl, list all four from tallest to shortest.")),
    ("reasoning", ("A box holds red and blue marbles. Half of them are red and there are six blue ones. "
                   "How many marbles are in the box?",)),
    ("reasoning", ("Three switches outside a closed room control one lamp inside. You may enter the room "
                   "once. How can you tell which switch controls the lamp?",)),
    ("math", ("What is 17 multiplied by 24? Show your working.",)),
    ("math", ("A bicycle wheel has a diameter of 70 cm. How far does the bicycle move in 100 turns of "
              "the wheel?", "How many turns are needed to travel one kilometre?")),
    ("math", ("Solve for x: 3x + 7 = 25.",)),
    ("coding", ("Write a Python function that returns the n-th Fibonacci number iteratively.",
                "Add a docstring and a check that n is not negative.")),
    ("coding", ("Explain the difference between a list and a tuple in Python, with a short example.",)),
    ("coding", ("Write a SQL query that lists the five customers with the highest total order value, "
                "given tables customers(id, name) and orders(customer_id, amount).",)),
    ("extraction", ("List every date mentioned in this text: 'The shop opened on 3 May 2019, closed for "
                    "repairs on 12 January 2021 and reopened on 1 March 2021.'",)),
    ("extraction", ("From the sentence 'Maria bought three apples, two pears and a melon for 6 euros', "
                    "extract the items and their quantities as JSON.",)),
    ("extraction", ("Name the cities in this sentence and the country of each: 'We flew from Lisbon to "
                    "Oslo, then took a train to Stockholm.'",
                    "Put the same information in a two-column table.")),
    ("roleplay", ("You are a museum guide. Greet a group of school children and introduce the dinosaur hall.",
                  "One child asks whether dinosaurs could swim. Answer in character.")),
    ("roleplay", ("Pretend you are a chef explaining to a beginner how to cook rice on the stove.",)),
    ("roleplay", ("Act as a ship's captain announcing to passengers that fog will delay the arrival.",)),
    ("stem", ("Why does ice float on water?",)),
    ("stem", ("Explain in simple terms how a vaccine trains the immune system.",
              "What is the difference between that and an antibiotic?")),
    ("stem", ("What happens to the boiling point of water at high altitude, and why?",)),
    ("humanities", ("Summarise the main causes of the French Revolution in a few sentences.",)),
    ("humanities", ("What is the difference between a metaphor and a simile? Give one example of each.",
                    "Write one more example of each about the sea.")),
    ("humanities", ("Why did the printing press change how ideas spread in Europe?",)),
)


def builtin_prompts() -> list[Prompt]:
    """The built-in set, categories taking turns (so that ``--limit 8`` covers all eight)."""
    prompts = [Prompt(BUILTIN_SOURCE, i, cat, turns) for i, (cat, turns) in enumerate(_BUILTIN, 1)]
    rank = {p.question_id: [q.category for q in prompts[:k]].count(p.category) for k, p in enumerate(prompts)}
    return sorted(prompts, key=lambda p: rank[p.question_id])


def _parse_line(path: Path, lineno: int, line: str) -> Prompt:
    where = f"{path}, line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DdspecError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DdspecError(f"{where}: expected a JSON object with 'question_id' and 'turns', got {type(obj).__name__}")
    qid = obj.get("question_id", obj.get("id"))
    if qid is None or isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise DdspecError(f"{where}: needs a 'question_id' (or 'id'), a number or a string")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DdspecError(f"{where}: 'turns' must be a non-empty list of non-empty strings (the user messages)")
    category = obj.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
        raise DdspecError(f"{where}: 'category' must be a non-empty string")
    return Prompt(path.stem, qid, category, tuple(turns))


def load_prompt_file(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts of a JSONL file (all when None); lines after them are not read."""
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8")
    except OSError as e:
        raise DdspecError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    prompts: list[Prompt] = []
    seen: dict[int | str, int] = {}
    with handle:
        try:
            for lineno, line in enumerate(handle, 1):
                if limit is not None and len(prompts) >= limit:
                    break
                if not line.strip():
                    continue
                prompt = _parse_line(path, lineno, line)
                if prompt.question_id in seen:
                    raise DdspecError(f"{path}, line {lineno}: question_id {prompt.question_id!r} already used "
                                      f"on line {seen[prompt.question_id]}")
                seen[prompt.question_id] = lineno
                prompts.append(prompt)
        except UnicodeDecodeError as e:
            raise DdspecError(f"{path}: not UTF-8 text ({e.reason}); prompt files are JSONL") from None
    if not prompts:
        raise DdspecError(f"prompt file {path} holds no prompts")
    return prompts


def load_prompts(paths: list[str] | None, limit: int | None = None, max_turns: int | None = None) -> list[Prompt]:
    """Prompts of every file in order (``limit`` per file), or the built-in set when none is given;
    ``max_turns`` keeps the first turns of multi-turn prompts only."""
    prompts = _load_prompts(paths, limit)
    if max_turns is not None:
        if max_turns < 1:
            raise DdspecError(f"--max-turns must be >= 1, got {max_turns}")
        prompts = [replace(p, turns=p.turns[:max_turns]) for p in prompts]
    return prompts


def _load_prompts(paths: list[str] | None, limit: int | None) -> list[Prompt]:
    from ddspec.datasets import resolve_prompt_sources

    paths = resolve_prompt_sources(paths)
    if not paths:
        return builtin_prompts()[:limit]
    stems: dict[str, str] = {}
    prompts: list[Prompt] = []
    for p in paths:
        stem = Path(p).stem
        if stem in stems:
            raise DdspecError(f"prompt files {stems[stem]} and {p} have the same name {stem!r}; records are "
                              "keyed by file name, so rename one")
        stems[stem] = p
        prompts += load_prompt_file(p, limit)
    return prompts
