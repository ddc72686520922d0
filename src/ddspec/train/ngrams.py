"""`ddspec ngrams`: an n-gram table of the target's own answers, for drafts where the context has none.

    ddspec ngrams --out runs/ngrams --activations int8     # answer training prompts, then build the table
    ddspec generate "..." --method lookup --ngram-table runs/ngrams/ngrams.safetensors

The target answers a seeded sample of the training prompts greedily (``--per-source`` of each
source, ``--cap`` for some), written to OUT/answers.jsonl as they finish; a rerun with the same
OUT resumes after the answers already there. Then the table (draft/ngram_table.py) is built from
the answers and written to OUT/ngrams.safetensors. ``--exclude`` keeps prompts out (those you
measure on). Never give it the evaluation files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

from ddspec.errors import DdspecError
from ddspec.train.cli import default_prompts

CHUNK = 48  # prompts per batch of generation (a rerun resumes after the last whole chunk written)


def add_parser(sub) -> None:
    from ddspec.args import add_model_args

    p = sub.add_parser("ngrams", help="build an n-gram draft table from the target's own answers (resumable)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for answers.jsonl and ngrams.safetensors")
    p.add_argument("--prompts", default=default_prompts(),
                   help="training prompts JSONL (id, source, turns); default ../shared/data/train/prompts.jsonl")
    p.add_argument("--exclude", action="append", default=[], metavar="FILE.jsonl",
                   help="leave out the prompts whose id is in this JSONL file (repeatable)")
    p.add_argument("--per-source", type=int, default=600, help="prompts answered per source (default 600)")
    p.add_argument("--cap", default="gsm8k_train:900,gpteacher_codegen:900", metavar="SRC:N,...",
                   help="other counts for some sources (default gsm8k_train:900,gpteacher_codegen:900)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the prompt sample (default 1234)")
    p.add_argument("--max-prompts", type=int, default=None, metavar="K",
                   help="answer only the first K prompts of the sample (default: all of it)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer (default 256)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts (default 384)")
    p.add_argument("--batch-size", type=int, default=16, help="answers decoded together (default 16)")
    p.add_argument("--min-count", type=int, default=3,
                   help="keep an ending seen at least this many times (default 3)")
    add_model_args(p)
    p.set_defaults(handler=run)


def _caps(spec: str) -> dict[str, int]:
    caps = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, n = part.rpartition(":")
        if not sep or not name or not n.isdigit():
            raise DdspecError(f"--cap {spec!r}: give SOURCE:COUNT pairs, comma-separated (e.g. gsm8k_train:900)")
        caps[name] = int(n)
    return caps


def _read_jsonl(path: str, what: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise DdspecError(f"cannot read {what} {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise DdspecError(f"{what} {path} is not JSONL: {e}") from e


def pick_prompts(rows: list[dict], exclude: set[str], per_source: int, caps: dict[str, int], seed: int) -> list[dict]:
    """A seeded sample: each source's prompts shuffled and cut to its count, then all shuffled together."""
    rng = random.Random(seed)
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["id"] not in exclude:
            by_source[r.get("source") or r.get("category") or "?"].append(r)
    picked = []
    for source, rs in by_source.items():
        rng.shuffle(rs)
        picked += rs[:caps.get(source, per_source)]
    rng.shuffle(picked)
    return picked


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ddspec.args import setup_torch, target_from_args
    from ddspec.draft.ngram_table import NgramTable
    from ddspec.prompts import chat_prompt_ids
    from ddspec.train.generate import generate_batch

    if min(args.per_source, args.batch_size, args.max_new_tokens, args.min_count, args.max_prompts or 1) < 1:
        raise DdspecError("--per-source, --batch-size, --max-new-tokens, --min-count and --max-prompts must be >= 1")
    rows = _read_jsonl(args.prompts, "prompts file")
    for r in rows:
        r.setdefault("id", r.get("question_id"))
        if r["id"] is None or not r.get("turns"):
            raise DdspecError(f"{args.prompts}: every line needs an id (or question_id) and turns")
    exclude = {str(r.get("id", r.get("question_id"))) for f in args.exclude for r in _read_jsonl(f, "--exclude file")}
    picked = pick_prompts(rows, exclude, args.per_source, _caps(args.cap), args.seed)[:args.max_prompts]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    answers = out / "answers.jsonl"
    done = {r["id"] for r in _read_jsonl(str(answers), "answers file")} if answers.exists() else set()
    todo = [r for r in picked if r["id"] not in done]
    setup_torch(args)
    target = target_from_args(args)
    from ddspec.models.llama import NativeLlama

    if not isinstance(target, NativeLlama):
        raise DdspecError("`ddspec ngrams` answers with the native implementation: drop --impl hf")
    print(f"ddspec: {len(picked)} prompts picked, {len(done)} answered already, {len(todo)} to answer",
          file=sys.stderr)
    start = time.perf_counter()
    with tqdm(total=len(picked), initial=len(picked) - len(todo), desc="answers", unit="prompt",
              file=sys.stderr) as bar:
        for i in range(0, len(todo), CHUNK):
            chunk = todo[i:i + CHUNK]
            ids = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in chunk]
            keep = [(r, x) for r, x in zip(chunk, ids) if len(x) <= args.max_prompt_tokens]
            results = generate_batch(target, [x for _, x in keep], args.max_new_tokens, rows=args.batch_size) if keep else []
            lines = [json.dumps({"id": r["id"], "source": r.get("source"), "prompt_ids": x, "output_ids": o}) + "\n"
                     for (r, x), (o, _, _) in zip(keep, results)]
            with open(answers, "a") as f:  # whole chunks: a rerun resumes after the last one
                f.write("".join(lines))
            bar.update(len(chunk))
    wanted = {r["id"] for r in picked}  # answers of prompts past --max-prompts (an earlier, longer run) stay out
    sequences = [r["output_ids"] for r in _read_jsonl(str(answers), "answers file") if r["id"] in wanted]
    if not sequences:
        raise DdspecError(f"no answers in {answers}: nothing to build a table from")
    meta = {"target": target.info.name, "vocab_size": target.info.vocab_size, "answers": len(sequences),
            "answer_tokens": sum(map(len, sequences)), "activations": getattr(args, "activations", "fp32"),
            "prompts": Path(args.prompts).name, "max_new_tokens": args.max_new_tokens}
    table = NgramTable.build(sequences, meta, min_count=args.min_count)
    path = out / "ngrams.safetensors"
    table.save(path)
    print(f"ddspec: {len(table)} endings from {len(sequences)} answers ({meta['answer_tokens']} tokens) -> {path} "
          f"({path.stat().st_size / 1e6:.1f} MB; generation {time.perf_counter() - start:.0f} s this run)",
          file=sys.stderr)
    return 0
