"""Where a target forward's time goes, phase by phase: ``python -m ddspec.bench.phases``.

The forward over N new tokens on the native kernels is one C call for all the decoder layers (see
native/ddspec_kernels.c). This tool loads a profiling build of those kernels (compiled once and
cached beside the normal one, with ``-DDD_PROFILE``: thread 0 reads the CPU's time-stamp counter
at the barrier that ends each phase of each layer) and times forwards over N tokens after a
prefix, the sizes interleaved round by round and each forward after two untimed one-token ones
(as decoding steps follow each other). It prints, per N, the median milliseconds of each phase
summed over the layers, the layers' total, the rest of the forward (the lm_head, the final norm,
Python) and the forward itself. A phase's time includes its wait for the slower thread at its
barrier. The profiling build computes the same bits as the normal one; only its counters differ.

It answers "what makes a forward over 8 tokens cost more than over 1" on the machine at hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from ddspec.machine import core_count


def forward_phases(target, prefix: int, sizes: list[int], reps: int, seed: int = 0) -> dict[int, dict[str, float]]:
    """Median ms per phase (native.PHASES), ``layers``, ``rest`` and ``forward`` for each size."""
    from ddspec import native

    gen = torch.Generator().manual_seed(seed)
    vocab = target.info.vocab_size
    target.reset(prefix + max(sizes) + 1)
    target.forward(torch.randint(0, vocab, (prefix,), generator=gen), torch.arange(prefix))
    target.commit(torch.arange(prefix))
    inputs = {n: (torch.randint(0, vocab, (n,), generator=gen), torch.ones(n, n, dtype=torch.bool).tril_())
              for n in sorted(set(sizes) | {1})}
    a, t0 = native.cycles(), time.perf_counter()
    time.sleep(0.2)
    hz = (native.cycles() - a) / (time.perf_counter() - t0)

    def forward(n: int) -> float:
        target.truncate(prefix)
        t = time.perf_counter()
        target.forward(inputs[n][0], prefix + torch.arange(n), inputs[n][1] if n > 1 else None)
        return time.perf_counter() - t

    samples: dict[int, dict[str, list[float]]] = {n: {} for n in sizes}
    for r in range(reps + 1):  # the first round warms up
        for n in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            forward(1)
            forward(1)
            native.phase_cycles()  # zero the counters
            wall = forward(n)
            ms = [c / hz * 1e3 for c in native.phase_cycles()]
            if r == 0:
                continue
            row = samples[n]
            for name, v in zip(native.PHASES, ms):
                row.setdefault(name, []).append(v)
            row.setdefault("layers", []).append(sum(ms))
            row.setdefault("rest", []).append(wall * 1e3 - sum(ms))
            row.setdefault("forward", []).append(wall * 1e3)
    target.truncate(prefix)
    return {n: {k: statistics.median(v) for k, v in row.items()} for n, row in samples.items()}


def table(result: dict[int, dict[str, float]]) -> list[str]:
    from ddspec import native

    sizes = sorted(result)
    lines = ["| phase (ms) | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for name in (*native.PHASES, "layers", "rest", "forward"):
        label = {"layers": "**layers (sum)**", "rest": "rest of the forward (lm_head, final norm, Python)",
                 "forward": "**forward**"}.get(name, name)
        lines.append(f"| {label} | " + " | ".join(f"{result[n][name]:.3f}" for n in sizes) + " |")
    first = sizes[0]
    lines.append(f"| forward / forward at N = {first} | "
                 + " | ".join(f"{result[n]['forward'] / result[first]['forward']:.2f}x" for n in sizes) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from ddspec import native

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m ddspec.bench.phases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="the target (default: the default model)")
    ap.add_argument("--activations", default="int8", choices=("fp32", "int8"), help="default int8")
    ap.add_argument("--sizes", default="1,2,4,8", help="new tokens per forward, comma-separated (default 1,2,4,8)")
    ap.add_argument("--prefix", type=int, default=200, help="cached tokens before each forward (default 200)")
    ap.add_argument("--reps", type=int, default=15, help="timed rounds, the sizes interleaved (default 15)")
    ap.add_argument("--threads", type=int, default=core_count(), help="threads (default: the core count)")
    args = ap.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: give whole numbers separated by commas, e.g. 1,2,4,8")
    if not sizes or sizes[0] < 1 or args.prefix < 1 or args.reps < 1:
        ap.error("--sizes, --prefix and --reps must be positive")
    if not native.profiling():  # a fresh process, so that it loads the profiling build
        env = dict(os.environ, **{native.PROFILE_ENV: "1"})
        return subprocess.call([sys.executable, "-m", "ddspec.bench.phases", *argv], env=env)
    torch.set_num_threads(args.threads)
    from ddspec.errors import DdspecError
    from ddspec.machine import cpu_name
    from ddspec.models.loading import load_target

    if not native.available():
        print(f"ddspec: no native kernels here ({native.unavailable_reason()}): nothing to profile", file=sys.stderr)
        return 1
    try:
        target = load_target(args.model, impl="native", activations=args.activations)
    except DdspecError as e:
        print(f"ddspec: {e}", file=sys.stderr)
        return 1
    if getattr(target, "layers", None) is None or target.layers[0].fused is None:
        print("ddspec: this model's layers do not run on the native kernel here: nothing to profile", file=sys.stderr)
        return 1
    result = forward_phases(target, args.prefix, sizes, args.reps)
    print(f"Forward phases: {args.model}, {args.activations} activations, after {args.prefix} tokens; "
          f"{cpu_name()}, {args.threads} threads; medians of {args.reps} interleaved rounds (profiling build "
          f"{native.build_id()}).")
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
