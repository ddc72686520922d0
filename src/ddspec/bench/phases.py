"""Where a target forward's time goes, phase by phase: ``python -m ddspec.bench.phases``.

The forward over N new tokens on the native kernels is one C call for all the decoder layers (see
native/ddspec_kernels.c). This tool loads a profiling build of those kernels (compiled once and
cached beside the normal one, with ``-DDD_PROFILE``: thread 0 reads the CPU's time-stamp counter
at the barrier that ends each phase of each layer) and times forwards over N tokens after a
prefix as ``make bench`` times its forward curve (bench.target.forward_times: the sizes
interleaved round by round, each forward after untimed one-token ones, as decoding steps follow
each other). It prints, per N, the median milliseconds of each phase
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


def forward_phases(target, prefix: int, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Median ms per phase (native.PHASES), ``layers``, ``rest`` and ``forward`` for each size, the
    forwards timed as ``bench.target.forward_times`` times them (same prefix, order and settling)."""
    from ddspec import native
    from ddspec.bench.target import prefixed_forwards
    from ddspec.calibrate import size_groups
    from ddspec.machine import interleaved_medians

    a, t0 = native.cycles(), time.perf_counter()
    time.sleep(0.2)
    hz = (native.cycles() - a) / (time.perf_counter() - t0)
    run, settle = prefixed_forwards(target, prefix, sizes)
    samples: dict[int, list[tuple[float, list[float]]]] = {n: [] for n in sizes}  # (wall ms, phase ms)

    def setup(n: int) -> None:
        settle(n)
        native.phase_cycles()  # zero the counters

    def timed(n: int) -> None:
        t = time.perf_counter()
        run(n)
        wall = (time.perf_counter() - t) * 1e3
        samples[n].append((wall, [c / hz * 1e3 for c in native.phase_cycles()]))

    for group in size_groups(sizes):
        if group:
            interleaved_medians(group, timed, reps, setup=setup)
    target.truncate(prefix)
    result = {}
    for n, got in samples.items():
        got = got[1:]  # the warm-up round's
        row = {name: statistics.median(ms[i] for _, ms in got) for i, name in enumerate(native.PHASES)}
        row["layers"] = statistics.median(sum(ms) for _, ms in got)
        row["rest"] = statistics.median(wall - sum(ms) for wall, ms in got)
        row["forward"] = statistics.median(wall for wall, _ in got)
        result[n] = row
    return result


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
