"""What one row of a verification costs in the 8-bit matmuls, at best: the Q4_1 x int8 pass in L1.

Compiles scripts/pass_cycles.c (which includes ddspec's kernel source) with ddspec's own build
flags, runs one copy pinned to each CPU at once, and prints the pass's time-stamp-counter cycles
per row and group-block (16 outputs x 32 inputs), with and without the GGUF block end (the
per-32-input scaling the format requires). With ``--forward`` it also loads the default model
with 8-bit activations and times its forward over 1, 8 and 16 tokens after 256 in the same
rounds as the pass, and prints what the pass alone, at its L1 rate on every thread, puts under T(N):

    T(N) >= N x (the model's multiply-adds / 512) x (cycles per row and group-block) / (threads x counter rate)

a bound no forward with these kernels can beat, whatever its memory traffic (as if every weight
were in L1); the forward's attention, norms and lm_head argmax come on top. The difference
between the pass and its integer sums alone is what the format's block end costs.

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


def build(tmp: str) -> Path:
    """scripts/pass_cycles.c compiled with ddspec's build flags, in ``tmp``."""
    from ddspec import native

    cc = native.c_compiler()
    if cc is None:
        sys.exit("pass_cycles: no C compiler (cc/gcc) on PATH")
    exe = Path(tmp) / "pass_cycles"
    flags = [f for f in native.build_flags() if f != "-fPIC"]
    done = subprocess.run([cc, *flags, f'-DDD_SOURCE="{native.SOURCE}"', str(HERE / "pass_cycles.c"),
                           "-o", str(exe), "-lm"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pass_cycles: the build failed:\n{done.stderr[-2000:]}")
    return exe


def pass_cycles(exe: Path, iters: int, reps: int, cpus: list[int]) -> tuple[str, float, float, float]:
    """(the pass timed, the time-stamp counter's rate, cycles per row and group-block of the pass
    and of its integer sums alone): one copy per CPU in ``cpus``, all at once (each CPU busy, as
    in a forward), each pinned to its CPU; the medians over ``reps`` of each copy, averaged."""
    runs = [subprocess.Popen([str(exe), str(iters), str(reps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda c=c: os.sched_setaffinity(0, {c})) for c in cpus]
    results = []
    for run in runs:
        out, err = run.communicate()
        lines = out.split("\n")
        if run.returncode or len(lines) < 3:
            sys.exit(f"pass_cycles: the run failed:\n{out}{err[-2000:]}")
        rows = [line.split() for line in lines[2:] if line.startswith("pass")]
        results.append((lines[0], float(lines[1].split()[1]), statistics.median(float(r[1]) for r in rows),
                        statistics.median(float(r[3]) for r in rows)))
    return (results[0][0], statistics.mean(r[1] for r in results), statistics.mean(r[2] for r in results),
            statistics.mean(r[3] for r in results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000, help="passes per repetition (default 20000)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of the pass alone, median taken (default 7)")
    ap.add_argument("--forward", action="store_true", help="also time the int8 model's forward and print the bound")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads: copies of the pass at once, and the forward's (default: every CPU of this process)")
    ap.add_argument("--rounds", type=int, default=15, help="rounds of the pass and the forward, interleaved (default 15)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]

    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        what, hz, full, sums = pass_cycles(exe, args.iters, args.reps, cpus)
        print(f"{what}, weights and rows in L1, one copy on each of {len(cpus)} CPUs at once "
              f"(time-stamp counter at {hz / 1e9:.2f} GHz)")
        print(f"cycles per row and group-block (16 outputs x 32 inputs): pass {full:.2f}, its integer sums alone "
              f"{sums:.2f} (the block end {full - sums:.2f}, {100 * (full - sums) / full:.0f}%)")
        if args.forward:
            forward_bound(exe, args, cpus, hz)


def forward_bound(exe: Path, args, cpus: list[int], hz: float) -> None:
    """The int8 forward over 1, 8 and 16 tokens and the pass, in the same rounds: per round, what
    the pass alone at that round's L1 rate puts under T(8) and T(16), against that round's T(1)."""
    import torch

    from ddspec.bench.target import macs_per_token, prefixed_forwards
    from ddspec.models.loading import load_target

    torch.set_num_threads(len(cpus))
    target = load_target("default", impl="native", activations="int8")
    units = macs_per_token(target) / 512  # rows x group-blocks of one token's matmuls
    sizes = [1, 8, 16]
    run, settle = prefixed_forwards(target, 256, sizes)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    passes: list[tuple[float, float]] = []
    for r in range(args.rounds + 1):  # pass 0 warms up
        _, _, full, sums = pass_cycles(exe, args.iters, 1, cpus)
        row = {}
        for n in sizes[r % 3:] + sizes[: r % 3]:
            settle(n)
            t0 = time.perf_counter()
            run(n)
            row[n] = (time.perf_counter() - t0) * 1e3
        if r:
            passes.append((full, sums))
            for n in sizes:
                times[n].append(row[n])
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"the int8 forward after 256 tokens ({len(cpus)} threads, medians of {args.rounds} rounds): "
          + ", ".join(f"T({n}) {med[n]:.2f} ms" for n in sizes)
          + f"; the pass in the same rounds {statistics.median(p[0] for p in passes):.2f} cycles "
          f"(sums alone {statistics.median(p[1] for p in passes):.2f})")
    def ms(n: int, cycles: float) -> float:  # n rows of the pass at this many cycles per row and group-block
        return n * units * cycles / (len(cpus) * hz) * 1e3

    for n in sizes[1:]:
        floor = statistics.median(ms(n, p[0]) / t for p, t in zip(passes, times[1]))
        bare = statistics.median(ms(n, p[1]) / t for p, t in zip(passes, times[1]))
        measured = statistics.median(a / b for a, b in zip(times[n], times[1]))
        print(f"N = {n}: the pass alone at its L1 rate puts >= {floor:.2f} x T(1) under T({n}) (its integer sums "
              f"alone {bare:.2f} x); measured T({n}) / T(1) = {measured:.2f} (medians of the rounds' ratios)")


if __name__ == "__main__":
    main()
