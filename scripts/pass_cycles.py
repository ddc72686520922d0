"""What one row of a verification costs in the 8-bit matmuls, at best: the Q4_1 x int8 pass in L1.

Compiles scripts/pass_cycles.c (which includes ddspec's kernel source) with ddspec's own build
flags, runs it on one core, and prints the pass's time-stamp-counter cycles per row and
group-block (16 outputs x 32 inputs), with and without the GGUF block end (the per-32-input
scaling the format requires). With ``--forward`` it also loads the default model with 8-bit
activations and times its forward over 1, 8 and 16 tokens after 256 (interleaved rounds, this
process) and prints what the pass alone, at its L1 rate on every thread, puts under T(N):

    T(N) >= N x (the model's multiply-adds / 512) x (cycles per row and group-block) / (threads x counter rate)

a bound no forward with these kernels can beat, whatever its memory traffic (every weight in
L1, both threads at one thread's rate); the forward's attention, norms and lm_head argmax come
on top. Where ``sums only`` is close to ``pass``, the block end is cheap; where ``pass`` is close
to its dot products' share of the vector units, the pass is at its arithmetic bound.

Run: python scripts/pass_cycles.py [--forward] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pass_cycles(iters: int, reps: int) -> tuple[str, float, float, float]:
    """(the pass timed, the time-stamp counter's rate, median cycles per row and group-block of the
    pass and of its sums alone)."""
    from ddspec import native

    cc = native._compiler()
    if cc is None:
        sys.exit("pass_cycles: no C compiler (cc/gcc) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "pass_cycles"
        flags = [f for f in native.build_flags() if f != "-fPIC"]
        build = subprocess.run([cc, *flags, f'-DDD_SOURCE="{native.SOURCE}"', str(HERE / "pass_cycles.c"),
                                "-o", str(exe), "-lm"], capture_output=True, text=True)
        if build.returncode:
            sys.exit(f"pass_cycles: the build failed:\n{build.stderr[-2000:]}")
        run = subprocess.run([str(exe), str(iters), str(reps)], capture_output=True, text=True,
                             preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    lines = run.stdout.split("\n")
    if run.returncode or len(lines) < 3:
        sys.exit(f"pass_cycles: the run failed:\n{run.stdout}{run.stderr[-2000:]}")
    rows = [line.split() for line in lines[2:] if line.startswith("pass")]
    return (lines[0], float(lines[1].split()[1]), statistics.median(float(r[1]) for r in rows),
            statistics.median(float(r[3]) for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000, help="passes per repetition (default 20000)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions, median taken (default 7)")
    ap.add_argument("--forward", action="store_true", help="also time the int8 model's forward and print the bound")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the forward (default: all)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the forward (default 15)")
    args = ap.parse_args()

    what, hz, full, sums = pass_cycles(args.iters, args.reps)
    print(f"{what} (one thread, weights and rows in L1; time-stamp counter at {hz / 1e9:.2f} GHz)")
    print(f"cycles per row and group-block (16 outputs x 32 inputs): pass {full:.2f}, its integer sums alone "
          f"{sums:.2f} (the block end {full - sums:.2f}, {100 * (full - sums) / full:.0f}%)")
    if not args.forward:
        return

    import torch

    from ddspec.bench.target import macs_per_token, prefixed_forwards
    from ddspec.machine import interleaved_medians
    from ddspec.models.loading import load_target

    torch.set_num_threads(args.threads)
    target = load_target("default", impl="native", activations="int8")
    units = macs_per_token(target) / 512
    sizes = [1, 8, 16]
    run, settle = prefixed_forwards(target, 256, sizes)
    times = {n: s * 1e3 for n, s in interleaved_medians(sizes, run, args.rounds, setup=settle).items()}
    t1 = times[1]
    print(f"the int8 forward after 256 tokens ({args.threads} threads, median of {args.rounds} interleaved rounds): "
          + ", ".join(f"T({n}) {times[n]:.2f} ms" for n in sizes))
    for n in sizes[1:]:
        floor = n * units * full / (args.threads * hz) * 1e3
        bare = n * units * sums / (args.threads * hz) * 1e3
        print(f"N = {n}: the pass alone at its L1 rate >= {floor:.2f} ms = {floor / t1:.2f} x T(1) "
              f"(its sums alone {bare / t1:.2f} x); measured T({n}) / T(1) = {times[n] / t1:.2f}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
