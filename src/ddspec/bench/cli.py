"""`ddspec bench`: every method side by side on the same prompts, with reports and plots.

    ddspec bench --prompts mt-bench,gsm8k \\
        --methods vanilla,hf,hf-lookup,chain,eagle,eagle2,ddd --max-new-tokens 128 \\
        --repeats 3 --limit 10 --out runs/bench

writes ``records.jsonl`` (one line per prompt x turn x method, appended as they finish),
``summary.md``, ``summary.json`` and PNG plots into ``--out``; ``--resume`` continues an
interrupted run in the same folder. See :mod:`ddspec.bench.runner` for the fairness rules and
:mod:`ddspec.bench.report` for the definitions of every number.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime
from functools import partial
from pathlib import Path

from ddspec.errors import DdspecError

DEFAULT_OUT = "bench-results"


def add_parser(sub) -> None:
    from ddspec.bench.runner import method_names
    from ddspec.args import add_model_args, add_sampling_args, add_tree_args

    p = sub.add_parser(
        "bench", allow_abbrev=False, help="benchmark every method side by side (tokens/s, speedup, τ, losslessness, plots)",
        description="Run each method on the same prompts, interleaved, after one warm-up each; write "
                    "records.jsonl, summary.md, summary.json and PNG plots to --out. Speedup is measured "
                    "against vanilla (plain decoding) in the same run.")
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", action="append", metavar="SETS|FILE.jsonl",
                   help="shipped prompt sets, comma-separated (mt-bench, humaneval, gsm8k: 80 prompts "
                        "each), or a JSONL prompt file (question_id or id, category, turns); repeatable. "
                        "Default: a small built-in set (3 prompts per category)")
    g.add_argument("--methods", default=",".join(method_names()),
                   help="comma-separated methods to compare (default: all, %(default)s). A tree method may "
                        "carry its own sizes, e.g. eagle2@d3k4n8 (depth 3, top_k 4, 8 tokens): the "
                        "form `ddspec tune` prints for its best static setting; with --draft-model, a trailing m "
                        "(chain@d4m, eagle2@d3k2n8m) drafts with that model instead of the head. "
                        "llama.cpp@draft / llama.cpp@ngram: llama-server's own draft-model speculation (with "
                        "--draft-model) / n-gram lookup")
    g.add_argument("--limit", type=int, default=None, metavar="K", help="use the first K prompts of each file")
    g.add_argument("--max-turns", type=int, default=None, metavar="T",
                   help="answer only the first T turns of multi-turn prompts (default: all turns)")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary the llama.cpp arm runs (default: $DDSPEC_LLAMA_SERVER, else "
                        "llama-server on the PATH, else llama-cpp-python's Python loop, which understates "
                        "llama.cpp; see docs/benchmarks.md)")
    g.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="timed runs of each generation; the median wall time is reported (default 1)")
    g.add_argument("--out", default=None, metavar="DIR",
                   help=f"results folder (default: {DEFAULT_OUT}/DATE-TIME)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out: skip the generations already in its records.jsonl")
    add_sampling_args(p, stop_strings=False,
                      title="decoding (the same stop rules for every method: --max-new-tokens and EOS)")
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(handler=partial(run, parser=p))


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The effective command: every option with the value it had (defaults included)."""
    parts = ["ddspec", "bench"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        flag, value = max(action.option_strings, key=len), getattr(args, action.dest, None)
        if action.nargs == 0:
            parts += [flag] if value else []
        elif isinstance(value, list):
            for v in value:
                parts += [flag, str(v)]
        elif isinstance(value, tuple):
            parts += [flag, ",".join(map(str, value))]
        elif value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run_settings(args: argparse.Namespace) -> dict:
    """Settings that must not change when a run is resumed (they change outputs or timings)."""
    keys = ("model", "impl", "device", "dtype", "threads", "head", "max_new_tokens", "max_turns", "temperature", "top_p",
            "sample_top_k", "seed", "tree_top_k", "depth", "total_tokens", "ddd_threshold", "max_depth")
    settings = {k: getattr(args, k) for k in keys}
    settings["ddd_check_depths"] = list(args.ddd_check_depths)
    if getattr(args, "activations", "fp32") != "fp32":  # absent from runs made before the option
        settings["activations"] = args.activations
    if getattr(args, "draft_temperature", None) is not None:  # likewise
        settings["draft_temperature"] = args.draft_temperature
    if getattr(args, "context_vocab", None) is not None:  # likewise
        settings["context_vocab"] = args.context_vocab
    if getattr(args, "ngram_table", "auto") != "auto":  # likewise
        settings["ngram_table"] = args.ngram_table
    return settings


def _check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--repeats", args.repeats), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise DdspecError(f"{flag} must be >= 1, got {value}")
    if args.resume and args.out is None:
        raise DdspecError("--resume continues the run in a results folder: give it with --out DIR")


def _hf_model(args: argparse.Namespace, target):
    """The HF transformers model for the hf arms: the target's own when it is an HF target."""
    from ddspec.args import target_from_args
    from ddspec.models.hf_adapter import HFTarget

    if isinstance(target, HFTarget):
        return target.model
    return target_from_args(args, impl="hf").model


def _meta(args, parser, methods: list[str], target) -> dict:
    import torch

    from ddspec.bench.report import machine_info
    from ddspec.bench.runner import WARMUP_TOKENS
    from ddspec.draft.ngram_table import table_description
    from ddspec.methods import shipped_head

    head = args.head or shipped_head(target.info)
    decoding = ("greedy" if args.temperature == 0 else
                f"sampling: temperature {args.temperature}, top-p {args.top_p}, top-k {args.sample_top_k}, "
                f"seed {args.seed}")
    return {
        "command": command_line(parser, args),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": f"{target.info.name} ({type(target).__name__}, {args.dtype})",
        "head": str(head) if head else "none",
        "ngram table": table_description(getattr(args, "ngram_table", "auto"), target),
        "methods": ", ".join(methods),
        "prompts": ", ".join(args.prompts) if args.prompts else "built-in set (ddspec.bench.prompts)",
        "limit per file": args.limit if args.limit is not None else "none",
        "turns": f"the first {args.max_turns} of each prompt" if args.max_turns else "all",
        "max new tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "decoding": decoding,
        "fairness": f"one untimed warm-up per method (at most {WARMUP_TOKENS} tokens); methods interleaved per "
                    "prompt and turn, their order shuffled every round (seeded); stop at --max-new-tokens or EOS "
                    "(counted) for all",
        **({"resumed": "yes: records of the earlier run(s) in this folder are included"} if args.resume else {}),
        **machine_info(torch.get_num_threads(), args.device),
    }


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ddspec.bench.plots import write_plots
    from ddspec.bench.prompts import load_prompts
    from ddspec.bench.report import render_table, write_summary
    from ddspec.bench.runner import Bench, RecordLog, build_arms, check_run_dir, parse_methods
    from ddspec.args import sampling_from_args, setup_torch, target_from_args, tree_from_args
    from ddspec.config import StopConfig

    # 1. Everything that can be checked before loading a model.
    _check_args(args)
    tree = tree_from_args(args)
    methods = parse_methods(args.methods, tree)
    sampling = sampling_from_args(args)
    StopConfig(max_new_tokens=args.max_new_tokens)
    prompts = load_prompts(args.prompts, args.limit, args.max_turns)
    out = Path(args.out or f"{DEFAULT_OUT}/{datetime.now():%Y%m%d-%H%M%S}")
    args.out = str(out)  # shown in the summary's command line
    settings = run_settings(args)
    check_run_dir(out, settings, args.resume)
    # 2. Models and arms.
    setup_torch(args)
    target = target_from_args(args)
    arms = build_arms(methods, target, args.head, tree, sampling, partial(_hf_model, args, target), args.model,
                      args.threads, args.llama_server)
    meta = _meta(args, parser, methods, target)
    # 3. The run; records.jsonl grows one flushed line per finished generation.
    log = RecordLog(out, settings, args.resume)
    try:
        outcome = Bench(arms, target.tokenizer, log, args.max_new_tokens, args.repeats).run(prompts)
    finally:
        log.close()
    # 4. Reports from whatever finished.
    summary = write_summary(out, log.records, meta, sampling.greedy, outcome.note)
    write_plots(out, summary)
    print(render_table(summary["overall"], summary["baseline"], summary["greedy"]))
    print(f"[ddspec] wrote {out}/records.jsonl ({len(log.records)} records), summary.md, summary.json and plots",
          file=sys.stderr)
    if outcome.error is not None:
        if isinstance(outcome.error, DdspecError):
            raise DdspecError(outcome.note) from outcome.error
        raise outcome.error
    if outcome.interrupted:
        print(f"[ddspec] interrupted; continue with --resume --out {out}", file=sys.stderr)
        return 130
    return 0
