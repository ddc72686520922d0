"""The ``ddspec`` command line: generate, chat (and, as they arrive, bench, train, tune).

Flags map to fields of the config dataclasses by name; every user mistake ends in a one-line
error (exit status 2), never a stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ddspec.args import add_model_args, add_sampling_args, add_spec_args, add_tree_args
from ddspec.errors import DdspecError

# Modules that provide more subcommands: each has add_parser(subparsers), which must call
# parser.set_defaults(handler=fn) with fn(args) -> exit status.
EXTRA_COMMANDS = ("ddspec.bench.cli", "ddspec.train.cli", "ddspec.train.ngrams", "ddspec.tune", "ddspec.server.cli")


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
    cal = sub.add_parser("calibrate", help="measure step costs for the cost-aware method (cached)",
                         description="Measure what a target forward over N tokens and a draft level cost on "
                                     "this machine, check that the measurement's rounds agree, and cache the "
                                     "result for the cost-aware method (which also measures on first use). "
                                     "--show prints the cached entry and its age without measuring.",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    how = cal.add_mutually_exclusive_group()
    how.add_argument("--refresh", action="store_true",
                     help="measure again even if a cached entry exists (the matmul kernel choice too)")
    how.add_argument("--show", action="store_true", help="print the cached entry (curve, age, noise); measure nothing")
    add_model_args(cal)
    add_tree_args(cal)
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
