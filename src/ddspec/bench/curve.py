"""The cost of one target forward over N new tokens, N = 1 .. 16, for any model file: ddspec's
native target beside llama.cpp's own ``llama-bench`` on the same GGUF.

How flat this curve is decides what a draft tree can buy: a step that verifies N tokens costs
T(N), so with τ tokens accepted per step speculation beats plain decoding only where τ / T(N)
exceeds 1 / T(1). ddspec times a forward over N random tokens after a ``--depth``-token prefix
(median of interleaved repetitions, as ``python -m ddspec.bench.target`` does); llama-bench
times a batch of N prompt tokens at the same depth (``-p N -n 0 -d DEPTH``: its "pp" test,
one forward over N tokens).

Run: ``python -m ddspec.bench.curve --model FILE.gguf [--activations int8] [--llama-bench PATH]
[--out report.md]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

from ddspec.machine import core_count, cpu_name

SIZES = tuple(range(1, 17))


def llama_bench_curve(binary: str, gguf: Path, sizes, depth: int, threads: int, reps: int = 5) -> dict[int, float]:
    """ms of one forward over N tokens after ``depth`` tokens, by N, from llama.cpp's llama-bench
    (its pp-N test: N prompt tokens in one batch; ms = N / tokens per second)."""
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, sizes)), "-n", "0", "-d", str(depth),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {int(r["n_prompt"]): 1e3 * int(r["n_prompt"]) / float(r["avg_ts"]) for r in json.loads(out)}


def report(model: str, activations: str, depth: int, ours: dict[int, float], theirs: dict[int, float] | None) -> str:
    lines = [f"# Forward cost by tokens: {model}", "",
             f"- date: {date.today().isoformat()}; cpu: {cpu_name()}; cores: {core_count()}; threads: {torch.get_num_threads()}",
             f"- ddspec: native target, --activations {activations}, a forward over N random tokens after {depth} "
             "cached tokens (median of interleaved repetitions)",
             f"- llama.cpp: llama-bench -p N -n 0 -d {depth} (one batch of N tokens at that depth)" if theirs else
             "- llama.cpp: not measured (no --llama-bench)", "",
             "| N | ddspec T(N) ms | T(N)/T(1) |" + (" llama.cpp T(N) ms | T(N)/T(1) |" if theirs else ""),
             "|---:|---:|---:|" + ("---:|---:|" if theirs else "")]
    for n in ours:
        row = f"| {n} | {ours[n]:.2f} | {ours[n] / ours[1]:.2f} |"
        if theirs and n in theirs:
            row += f" {theirs[n]:.2f} | {theirs[n] / theirs[1]:.2f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file (or any model spec ddspec loads)")
    ap.add_argument("--activations", default="int8", choices=("fp32", "int8"))
    ap.add_argument("--depth", type=int, default=256, help="tokens already in the cache (default 256)")
    ap.add_argument("--threads", type=int, default=core_count())
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (scripts/build_llama_cpp.sh)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ddspec.bench.target import forward_times
    from ddspec.errors import DdspecError
    from ddspec.models.loading import load_target

    try:
        target = load_target(args.model, impl="native", activations=args.activations)
    except DdspecError as e:
        print(f"ddspec: error: {e}", file=sys.stderr)
        return 2
    ours = forward_times(target, args.depth, SIZES)
    theirs = None
    if args.llama_bench:
        try:
            theirs = llama_bench_curve(args.llama_bench, Path(args.model), SIZES, args.depth, args.threads)
        except (OSError, subprocess.CalledProcessError, ValueError, KeyError) as e:
            print(f"ddspec: llama-bench failed ({e}); reporting ddspec alone", file=sys.stderr)
    text = report(args.model, args.activations, args.depth, ours, theirs)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
