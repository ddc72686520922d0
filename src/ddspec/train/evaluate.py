"""Stage 4: measure a head through the real engine (greedy, EAGLE-2 defaults unless told).

Reports, per eval file: τ (mean accepted length), the acceptance rate at each depth
(P(accepted >= d | accepted >= d-1) over steps), tokens/s, draft ms per step, and whether
every greedy output equals plain decoding (it must).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ddspec.config import StopConfig, TreeConfig
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine, RunStats
from ddspec.errors import DdspecError
from ddspec.methods import tree_config
from ddspec.prompts import chat_prompt_ids
from ddspec.train.replay import ReplayTarget, recorded_pass


def first_turns(path: Path, limit: int) -> list[str]:
    return [text for _, text in first_turn_records(path, limit)]


def first_turn_records(path: Path, limit: int) -> list[tuple[str, str]]:
    """(category, first user turn) of the first ``limit`` records of an eval JSONL."""
    return [(cat, turns[0]) for cat, turns in turn_records(path, limit, 1)]


def turn_records(path: Path, limit: int, turns: int) -> list[tuple[str, list[str]]]:
    """(category, its first ``turns`` user turns) of the first ``limit`` records of an eval JSONL."""
    if not path.is_file():
        raise DdspecError(f"eval file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            said = row["turns"][:turns]
            if not said or not all(isinstance(t, str) for t in said):
                raise ValueError("'turns' must hold at least one text")
            out.append((str(row.get("category", "")), said))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise DdspecError(f"{path}, line {n}: not a prompt record ({e})") from e
        if len(out) >= limit:
            break
    return out


def parse_eval_sets(spec: str, default_limit: int, known: tuple[str, ...]) -> dict[str, int]:
    """``mt_bench:80,humaneval,gsm8k:20`` -> {name: prompts}; a bare name takes ``default_limit``."""
    sets: dict[str, int] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if name not in known:
            raise DdspecError(f"--eval-sets: unknown eval set {name!r}; choose from {', '.join(known)}")
        try:
            sets[name] = int(count) if count else default_limit
        except ValueError:
            raise DdspecError(f"--eval-sets: {item!r}: the count after ':' must be a whole number") from None
        if sets[name] < 1:
            raise DdspecError(f"--eval-sets: {item!r}: the count must be at least 1")
    if not sets:
        raise DdspecError(f"--eval-sets is empty; choose from {', '.join(known)}")
    return sets


def depth_acceptance(stats: list[RunStats]) -> list[float]:
    """P(accepted >= d | accepted >= d - 1) for d = 1, 2, ... over all steps."""
    accepted = [s.accepted for st in stats for s in st.steps]
    rates, prev = [], len(accepted)
    for d in range(1, (max(accepted) if accepted else 0) + 1):
        cur = sum(a >= d for a in accepted)
        rates.append(cur / prev if prev else 0.0)
        prev = cur
    return rates


def _tau_by(keys: list, runs: list[RunStats]) -> dict:
    """τ of the runs grouped by ``keys`` (one key per run), in first-seen order."""
    groups: dict = {}
    for key, run in zip(keys, runs):
        entry = groups.setdefault(key, {"turns": 0, "tokens": 0, "steps": 0})
        entry["turns"] += 1
        entry["tokens"] += sum(s.accepted + 1 for s in run.steps)
        entry["steps"] += len(run.steps)
    return {k: {**e, "tau": e["tokens"] / max(1, e["steps"])} for k, e in groups.items()}


def evaluate_head(target, head, prompts: list[str] | list[list[str]], new_tokens: int, tree: TreeConfig = TreeConfig(),
                  method: str = "eagle2", progress=None, categories: list[str] | None = None,
                  replay: bool = False) -> dict:
    """τ, acceptance by depth and draft cost of ``head`` with ``method``'s trees, each turn also
    decoded plainly to check the output. A prompt is one user turn, or a conversation (a list of
    user turns): turn k then follows turns 1..k-1 and plain decoding's answers to them.

    replay: check the trees against plain decoding's answer instead of verifying them on the target
    (train/replay.py: the same trees and τ, without a target forward per step); the tokens/s and
    verification times then mean nothing, and the outputs equal plain decoding's by construction."""
    config = tree_config(method, tree)
    drafter = EagleDrafter(head, target, config)
    stop = StopConfig(max_new_tokens=new_tokens)
    # a replayed step may look past the answer's last token by as many levels as a tree has
    longer = StopConfig(max_new_tokens=new_tokens + max(config.depth, config.max_depth) + 1)
    runs, same, wall, plain_wall, tokens, turn_categories, turn_numbers = [], 0, 0.0, 0.0, 0, [], []
    for i, prompt in enumerate(prompts):
        messages: list[dict[str, str]] = []
        for turn, text in enumerate([prompt] if isinstance(prompt, str) else prompt, start=1):
            messages.append({"role": "user", "content": text})
            ids = chat_prompt_ids(target.tokenizer, messages)
            t0 = time.perf_counter()
            ref = Engine(target).generate(ids, longer if replay else stop)
            answer = ref.token_ids[:new_tokens]
            t1 = time.perf_counter()
            if replay:
                features, hidden = recorded_pass(target, ids + ref.token_ids, drafter.hidden_layers)
                res = Engine(ReplayTarget(target, ids + ref.token_ids, features, hidden), drafter).generate(ids, stop)
            else:
                res = Engine(target, drafter).generate(ids, stop)
            t2 = time.perf_counter()
            same += res.token_ids == answer
            runs.append(res.stats)
            turn_categories.append(categories[i] if categories else "")
            turn_numbers.append(turn)
            plain_wall, wall, tokens = plain_wall + t1 - t0, wall + t2 - t1, tokens + res.stats.new_tokens
            messages.append({"role": "assistant", "content": target.tokenizer.decode(answer, skip_special_tokens=True)})
            if progress:
                progress.update(1)
    steps = [s for r in runs for s in r.steps]
    return {
        "by_category": _tau_by(turn_categories if categories else [], runs),
        "by_turn": _tau_by(turn_numbers, runs),
        "prompts": len(prompts),
        "turns": len(runs),
        "tau": sum(s.accepted + 1 for s in steps) / max(1, len(steps)),
        "tau_tokens": sum(s.accepted + 1 for s in steps),
        "tau_steps": len(steps),
        "depth_acceptance": depth_acceptance(runs),
        "tokens_per_s": tokens / wall if wall else 0.0,
        "plain_tokens_per_s": tokens / plain_wall if plain_wall else 0.0,
        "draft_ms_per_step": sum(s.draft_ms for s in steps) / max(1, len(steps)),
        "verify_ms_per_step": sum(s.verify_ms for s in steps) / max(1, len(steps)),
        "identical_to_plain": f"{same}/{len(runs)}",
        "method": method,
        "replay": replay,
        "tree": {"top_k": tree.top_k, "depth": tree.depth, "total_tokens": tree.total_tokens},
    }
