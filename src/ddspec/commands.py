"""What each CLI subcommand does, once its flags are parsed (kept apart from argparse)."""

from __future__ import annotations

import argparse
import sys

from ddspec.args import EXAMPLE_PROMPT, sampling_from_args, setup_torch, stop_from_args, target_from_args, tree_from_args
from ddspec.config import StopConfig
from ddspec.engine import Engine, RunStats
from ddspec.errors import DdspecError
from ddspec.prompts import chat_prompt_ids


def build_engine(args: argparse.Namespace, notices: list[str]) -> Engine:
    """The engine the flags ask for; the method's notices go to ``notices`` (see :func:`end_answer`)."""
    sampling = sampling_from_args(args)
    stop_from_args(args)  # validate before the (slow) model load
    tree = tree_from_args(args)
    setup_torch(args)
    from ddspec.methods import default_method, make_drafter

    target = target_from_args(args)
    method = default_method(target, args.head, tree.draft_model) if args.method == "auto" else args.method
    return Engine(target, make_drafter(method, target, args.head, tree, notify=notices.append), sampling,
                  method=method)


def print_summary(stats: RunStats, method: str = "vanilla", out=None) -> None:
    out = out or sys.stderr  # read when called: a redirected stderr is honoured
    print(
        f"[ddspec] {method}: {stats.new_tokens} new tokens (prompt {stats.prompt_tokens}) in {stats.wall_s:.2f} s "
        f"= {stats.tokens_per_s:.1f} tokens/s (prefill {stats.prefill_s * 1e3:.0f} ms included); "
        f"{len(stats.steps)} steps, finish: {stats.finish_reason}",
        file=out,
    )
    if stats.steps and method != "vanilla":
        n = len(stats.steps)
        hist = stats.tau_histogram()
        print(
            f"[ddspec] tau {stats.tau:.2f} (histogram of tokens per step: "
            + ", ".join(f"{k}:{v}" for k, v in sorted(hist.items()))
            + f"); mean tree {sum(s.tree_size for s in stats.steps) / n:.1f} nodes, "
            f"draft {sum(s.draft_ms for s in stats.steps) / n:.1f} ms + verify "
            f"{sum(s.verify_ms for s in stats.steps) / n:.1f} ms per step",
            file=out,
        )


def stream_answer(engine: Engine, prompt_ids: list[int], stop: StopConfig) -> tuple[str, RunStats | None]:
    """Stream an answer to stdout; Ctrl-C stops it early and keeps what was written."""
    pieces: list[str] = []
    stream = engine.stream(prompt_ids, stop)
    try:
        while True:
            chunk = next(stream)
            pieces.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except StopIteration as done:
        return "".join(pieces), done.value
    except KeyboardInterrupt:
        stream.close()
        print("\n[ddspec] stopped", file=sys.stderr)
        return "".join(pieces), None
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()


def end_answer(stats: RunStats | None, method: str, notices: list[str]) -> None:
    """After an answer: its summary, then the notices held while it streamed (a line on stderr
    would land in the middle of the answer on a terminal)."""
    if stats is not None:
        print_summary(stats, method)
    for line in notices:
        print(line, file=sys.stderr)
    notices.clear()


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None:
        prompt = EXAMPLE_PROMPT if sys.stdin.isatty() or sys.stdin.closed else sys.stdin.read().strip() or EXAMPLE_PROMPT
    notices: list[str] = []
    engine = build_engine(args, notices)
    tok = engine.target.tokenizer
    ids = tok.encode(prompt) if args.raw else chat_prompt_ids(tok, [{"role": "user", "content": prompt}])
    _, stats = stream_answer(engine, ids, stop_from_args(args))
    end_answer(stats, engine.method, notices)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    notices: list[str] = []
    engine = build_engine(args, notices)
    stop = stop_from_args(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("ddspec chat: /reset clears the history, /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            print("[history cleared]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = chat_prompt_ids(engine.target.tokenizer, history)
            answer, stats = stream_answer(engine, ids, stop)
        except DdspecError as e:
            history.pop()
            print(f"ddspec: error: {e}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})
        end_answer(stats, engine.method, notices)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ddspec.calibrate import CostStore, PolicyMemory, describe, drafter_cost_key, load_or_measure
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.methods import resolve_head, tree_config

    tree = tree_from_args(args)
    setup_torch(args)
    if args.refresh:  # the matmul kernel choice is a measurement too: make it again
        from ddspec.machine import cache_root

        for entry in (cache_root() / "kernels").glob("*.json"):
            entry.unlink(missing_ok=True)
    target = target_from_args(args)
    drafter = EagleDrafter(resolve_head(args.head, target), target, tree_config("eagle2", tree))
    if args.show:
        store = CostStore(drafter_cost_key(target, drafter))
        m = store.read()
        if m is None:
            print(f"no cost entry for {target.info.name} with this head, device, dtype, threads and top_k "
                  f"(would be {store.path}): run `ddspec calibrate`", file=sys.stderr)
            return 1
        print(describe(m, store.path))
        print(PolicyMemory(store).describe())
        return 0
    m, store = load_or_measure(target, drafter, refresh=args.refresh)
    if args.refresh:  # what the method learned was learned against the old measurement: start over
        PolicyMemory(store).forget()
    print(f"cost model for {target.info.name} (top_k {tree.top_k}):")
    print(describe(m, store.path))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "calibrate": cmd_calibrate}


def run_command(args: argparse.Namespace) -> int:
    return COMMANDS[args.command](args)
