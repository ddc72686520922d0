"""`ddspec ngrams`: an n-gram table of the target's own answers, for drafts where the context has none.

    ddspec ngrams --out runs/ngrams --activations int8     # answer training prompts, then build the table
    ddspec generate "..." --method lookup --ngram-table runs/ngrams/ngrams.safetensors

The target answers a seeded sample of the training prompts greedily (``--per-source`` of each
source, ``--cap`` for some), written to OUT/answers.jsonl as they finish; a rerun with the same
OUT resumes after the answers already there, and ``--build-only`` builds from what a stopped run
wrote. Then the table (draft/ngram_table.py) is built from the answers and written to
OUT/ngrams.safetensors. ``--exclude`` keeps prompts out (those you measure on). Never give it the
evaluation files. ``--temperature`` samples the answers instead (new text for prompts a greedy run
answered; in its own OUT), and ``--also`` adds another run's answers to the table:

    ddspec ngrams --out runs/ngrams-t07 --activations int8 --temperature 0.7 --also runs/ngrams/answers.jsonl

The answers are decoded one prompt at a time with the ``lookup`` method (drafts from the
context and the shipped table, verified by the target): greedy speculative decoding gives plain
greedy decoding's tokens, sooner: on 2 cores of an Intel Xeon (family 6 model 167, 8-bit
activations, 2 x 16 training prompts) 424-425 tokens/s, against 294-306 for the batched decoder
it replaced (16 rows through torch's per-layer path) and 278-283 for plain decoding. The batched
decoder's answers also left the engine's greedy path after a few tokens in 16 of 16 prompts (its
batched arithmetic is not the engine's); these are the very tokens plain decoding writes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

from ddspec.datasets import open_text
from ddspec.errors import DdspecError
from ddspec.train.cli import default_prompts

CHUNK = 16  # answers written together (a rerun resumes after the last whole chunk written)


def add_parser(sub) -> None:
    from ddspec.args import add_model_args

    p = sub.add_parser("ngrams", help="build an n-gram draft table from the target's own answers (resumable)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for answers.jsonl and ngrams.safetensors")
    p.add_argument("--prompts", default=default_prompts(),
                   help="training prompts JSONL, plain or .gz (id, source, turns); default: the training prompts "
                        "shipped with ddspec (ddspec/data/README.md)")
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
    p.add_argument("--build-only", action="store_true",
                   help="answer nothing more: build the table from the answers OUT holds (e.g. after stopping a run)")
    p.add_argument("--min-count", type=int, default=3,
                   help="keep an ending seen at least this many times (default 3)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the answers at this temperature (default 0: greedy). A sampled pass writes "
                        "new text for prompts already answered greedily; give it its own --out")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the sampled answers (default 0)")
    p.add_argument("--also", action="append", default=[], metavar="ANSWERS.jsonl",
                   help="answers another run wrote (e.g. runs/ngrams/answers.jsonl) that join the table "
                        "(repeatable)")
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
        with open_text(Path(path)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise DdspecError(f"cannot read {what} {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise DdspecError(f"{what} {path} is not JSONL: {e}") from e


def _read_answers(path: Path) -> list[dict]:
    """The answers a run wrote ([] before the first). A last line cut short (the process was killed
    while writing) is dropped from the file, so that a rerun answers those prompts again."""
    if not path.exists():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        path.write_text(text)
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DdspecError(f"answers file {path} is not JSONL ({e}): move it away to answer again") from e


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
    from ddspec.config import SamplingConfig, StopConfig
    from ddspec.engine import Engine
    from ddspec.methods import make_drafter

    if min(args.per_source, args.max_new_tokens, args.min_count, args.max_prompts or 1) < 1:
        raise DdspecError("--per-source, --max-new-tokens, --min-count and --max-prompts must be >= 1")
    sampling = SamplingConfig(temperature=args.temperature, seed=args.sample_seed)  # checks the temperature
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
    answered = _read_answers(answers)  # and, below, each answer as it is written: the file is read once
    mixed = {r.get("temperature", 0.0) for r in answered} - {args.temperature}
    if mixed:
        raise DdspecError(f"{answers} holds answers at temperature {sorted(mixed)[0]:g}, not "
                          f"{args.temperature:g}: give this run its own --out (and --also {answers} to build "
                          "one table from both)")
    also = []
    for path in args.also:
        if Path(path).resolve() == answers.resolve():
            raise DdspecError(f"--also {path} is this run's own answers file: it is read already")
        also += [r["output_ids"] for r in _read_jsonl(path, "--also answers file") if r.get("output_ids")]
    done = {r["id"] for r in answered}
    todo = [] if args.build_only else [r for r in picked if r["id"] not in done]
    setup_torch(args)
    target = target_from_args(args)
    print(f"ddspec: {len(picked)} prompts picked, {len(done)} answered already, {len(todo)} to answer",
          file=sys.stderr)
    start = time.perf_counter()
    engine = Engine(target, make_drafter("lookup", target, None), sampling) if todo else None
    stop = StopConfig(max_new_tokens=args.max_new_tokens)
    tokens = 0
    with tqdm(total=len(picked), initial=len(picked) - len(todo), desc="answers", unit="prompt",
              file=sys.stderr, disable=not todo) as bar:
        for i in range(0, len(todo), CHUNK):
            lines = []
            for r in todo[i:i + CHUNK]:
                x = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": r["turns"][0]}])
                if len(x) <= args.max_prompt_tokens:
                    out_ids = engine.generate(x, stop).token_ids
                    tokens += len(out_ids)
                    answered.append({"id": r["id"], "source": r.get("source"), "prompt_ids": x, "output_ids": out_ids})
                    if args.temperature:
                        answered[-1].update(temperature=args.temperature, seed=args.sample_seed)
                    lines.append(json.dumps(answered[-1]) + "\n")
                bar.update(1)
            with open(answers, "a") as f:  # whole chunks: a rerun resumes after the last one
                f.write("".join(lines))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tokens/s")
    wanted = {r["id"] for r in picked}  # answers of prompts past --max-prompts (an earlier, longer run) stay out
    sequences = [r["output_ids"] for r in answered if r["id"] in wanted] + also
    if not sequences:
        raise DdspecError(f"no answers in {answers}: nothing to build a table from")
    meta = {"target": target.info.name, "vocab_size": target.info.vocab_size, "answers": len(sequences),
            "answer_tokens": sum(map(len, sequences)), "activations": getattr(args, "activations", "fp32"),
            "prompts": Path(args.prompts).name, "max_new_tokens": args.max_new_tokens}
    if args.temperature:
        meta.update(temperature=args.temperature, sample_seed=args.sample_seed)
    if also:
        meta["also"] = [str(p) for p in args.also]
        meta["also_answers"] = len(also)
    table = NgramTable.build(sequences, meta, min_count=args.min_count)
    path = out / "ngrams.safetensors"
    table.save(path)
    print(f"ddspec: {len(table)} endings from {len(sequences)} answers ({meta['answer_tokens']} tokens) -> {path} "
          f"({path.stat().st_size / 1e6:.1f} MB; generation {time.perf_counter() - start:.0f} s this run)",
          file=sys.stderr)
    return 0
