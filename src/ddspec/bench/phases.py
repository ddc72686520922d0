"""Where a target forward's time goes, phase by phase: ``python -m ddspec.bench.phases``.

The forward over N new tokens on the native kernels is one C call for all the decoder layers (see
native/kernels/attention.inc). This tool loads a profiling build of those kernels (compiled once and
cached beside the normal one, with ``-DDD_PROFILE``: thread 0 reads the CPU's time-stamp counter
at the barrier that ends each phase of each layer) and times forwards over N tokens after a
prefix as ``make bench`` times its forward curve (bench.target.forward_times: the sizes
interleaved round by round, each forward after untimed one-token ones, as decoding steps follow
each other). It prints, per N, the median milliseconds of each phase
summed over the layers, the layers' total, the rest of the forward (the lm_head, the final norm,
Python) and the forward itself. A phase's time includes its wait for the slower thread at its
barrier. The profiling build computes the same bits as the normal one; only its counters differ.

A second table times the matmuls alone (the layers' four and the lm_head; one C call each way,
nothing between them): their weights streamed as a forward reads them, and a layer-sized weight
again and again so that it stays in the caches. Where the two agree, the matmul is bound by its
arithmetic and more rows cost more arithmetic, whatever the memory; the lines under it give that
arithmetic per unit of work and, against the forward over the smallest N timed in the same
rounds, the floor it puts under the forward's growth with N.

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


def counter_hz() -> float:
    """The time-stamp counter's ticks per second, over 0.2 s of the clock (the profiling build)."""
    from ddspec import native

    a, t0 = native.cycles(), time.perf_counter()
    time.sleep(0.2)
    return (native.cycles() - a) / (time.perf_counter() - t0)


def forward_phases(target, prefix: int, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Median ms per phase (native.PHASES), ``layers``, ``rest`` and ``forward`` for each size, the
    forwards timed as ``bench.target.forward_times`` times them (same prefix, order and settling)."""
    from ddspec import native
    from ddspec.bench.target import prefixed_forwards
    from ddspec.calibrate import size_groups
    from ddspec.machine import interleaved_medians

    hz = counter_hz()
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


LM_SLICES = 16  # the lm_head in cache: a sixteenth of its rows (the size of a layer's gate/up) sixteen times


def sweep_weights(target) -> dict[str, tuple[list, list]]:
    """By matmul: (streamed, cached) lists of NativeWeight for native.gemm_sweep, the same work each.
    Streamed: each decoder layer's own weight in turn (as a forward reads them), the lm_head once;
    cached: the first layer's weight as many times, the first sixteenth of the lm_head's rows
    sixteen times: small enough to stay in a core's caches, so that only the arithmetic is left."""
    layers = target.native_matmuls()
    heads = layers.pop("lm_head")
    out = {name: (ws, [ws[0]] * len(ws)) for name, ws in layers.items()}
    lm = heads[0] if heads else None
    if lm is not None and lm.out_features >= 16 * LM_SLICES:
        part = lm.select(torch.arange(lm.out_features // LM_SLICES))
        out["lm_head"] = ([lm], [part] * LM_SLICES)
    return out


def matmul_sweeps(target, weights: dict[str, tuple[list, list]], prefix: int, sizes: list[int],
                  reps: int) -> dict[int, dict[str, tuple[float, float]]]:
    """Per size N and matmul: (streamed, cached) median ms over N rows (``weights``: :func:`sweep_weights`; one C
    call each, native.gemm_sweep, nothing between the matmuls), and under ``"forward"`` (the same
    value twice) the forward over N tokens after ``prefix`` timed in the same rounds (as
    :func:`forward_phases` times it), so that the two compare within one minute of this machine.
    Where streamed and cached agree the matmul is bound by its arithmetic, where streamed is slower
    by its reads. Rounds interleave everything."""
    from ddspec import native
    from ddspec.bench.target import prefixed_forwards
    from ddspec.machine import interleaved_medians

    gen = torch.Generator().manual_seed(0)
    xs = {n: {name: torch.randn(n, ws[0][0].in_features, generator=gen) for name, ws in weights.items()} for n in sizes}
    forward, settle = prefixed_forwards(target, prefix, sizes)
    cases = [(n, name, cached) for n in sizes for name in weights for cached in (0, 1)]
    cases += [(n, "forward", 0) for n in sizes]

    def setup(case) -> None:
        if case[1] == "forward":
            settle(case[0])

    def run(case) -> None:
        n, name, cached = case
        if name == "forward":
            forward(n)
        else:
            native.gemm_sweep(weights[name][cached], xs[n][name])

    med = interleaved_medians(cases, run, reps, setup=setup)  # seconds
    target.truncate(prefix)
    out = {n: {name: (med[(n, name, 0)] * 1e3, med[(n, name, 1)] * 1e3) for name in weights} for n in sizes}
    for n in sizes:
        out[n]["forward"] = (med[(n, "forward", 0)] * 1e3,) * 2
    return out


def sweep_table(sweeps: dict[int, dict[str, tuple[float, float]]], layers: int) -> list[str]:
    sizes = sorted(sweeps)
    names = [name for name in sweeps[sizes[0]] if name != "forward"]
    lines = [f"| matmuls alone ({layers} layers; ms) | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for name in (*names, "all"):
        for k, how in ((0, "streamed"), (1, "in cache")):
            vals = [sum(sweeps[n][m][k] for m in names) if name == "all" else sweeps[n][name][k] for n in sizes]
            label = f"**all, {how}**" if name == "all" else f"{name}, {how}"
            lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    forwards = " | ".join(f"{sweeps[n]['forward'][0]:.3f}" for n in sizes)
    lines.append(f"| forward over N tokens, the same rounds | {forwards} |")
    return lines


def row_cycles(sweeps: dict[int, dict[str, tuple[float, float]]], weights: dict[str, tuple[list, list]], hz: float,
               threads: int) -> float | None:
    """CPU cycles per thread that one more row costs per 16 outputs x 32 inputs of weight (a group's
    block, the kernels' unit of work), from the in-cache sweeps of the two largest sizes: the
    arithmetic's cost per unit, which sets how much dearer each verified token makes a forward."""
    sizes = sorted(sweeps)
    if len(sizes) < 2:
        return None
    a, b = sizes[-2], sizes[-1]
    ms = sum(sweeps[b][name][1] - sweeps[a][name][1] for name in sweeps[b] if name != "forward") / (b - a)
    units = sum((w.out_features + 15) // 16 * (w.in_features // 32)
                for streamed, _ in weights.values() for w in streamed)
    return ms * 1e-3 * hz * threads / units


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
    ap.add_argument("--no-sweeps", action="store_true",
                    help="skip the second table: the matmuls alone (the layers' four and the lm_head), their "
                         "weights streamed from memory as in a forward and held in the caches (arithmetic alone)")
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
    if not args.no_sweeps:
        weights = sweep_weights(target)
        sweeps = matmul_sweeps(target, weights, args.prefix, sizes, args.reps)
        print()
        print("\n".join(sweep_table(sweeps, len(target.layers))))
        hz = counter_hz()
        per = row_cycles(sweeps, weights, hz, args.threads)
        if per is not None:
            print(f"\nIn cache, each row past N = {sorted(sweeps)[-2]} costs {per:.1f} cycles of each of the "
                  f"{args.threads} threads per 16 outputs x 32 inputs of weight (time-stamp counter at "
                  f"{hz / 1e9:.2f} GHz): the kernels' arithmetic per group and block.")
        first = sizes[0]
        floor = {n: sum(v[1] for name, v in sweeps[n].items() if name != "forward") for n in sizes}
        one = sweeps[first]["forward"][0]
        print(f"The matmuls' arithmetic alone (all, in cache) over N tokens, against the forward over {first} "
              "in the same rounds: "
              + ", ".join(f"N = {n}: {floor[n] / one:.2f}x" for n in sizes if n != first)
              + f": no forward over N tokens can cost less relative to the forward over {first} with these "
              "kernels (attention and the rest come on top; the forward's own reads may overlap the arithmetic).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
