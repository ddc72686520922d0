"""What a format made for AMX tiles would do to T(N): an experiment on Intel CPUs with AMX-INT8.

ddspec's kernels keep the GGUF's blocks (a scale every 32 inputs), so every product of 8-bit
activations and levels is 32 deep, and AMX tiles did not pay for them (four tries, see
docs/kernels-history.md). This times the other way: the same matmuls (the default model's
shapes: q/k/v, o, gate/up, down of 30 layers and the lm_head) on 8-bit weights with one scale
per output row, multiplied on AMX tiles over all their inputs at once
(scripts/amx_row_scale.c), against ddspec's own kernels on the model's weights
(``native.gemm_sweep``, streamed as a forward reads them), and the int8 forward over N tokens,
all in the same rounds. Then what the forward would take with the tiles' matmuls in place of
ours: forward - our matmuls + the tiles' matmuls. Random weights of the right shapes (the
timing does not depend on the values). Such a format would change every output (a different
rounding of every weight) and cannot be used for some row counts only: a verified token must get
the bits plain decoding gives it, so one-token steps would pay its bytes too.

Run: python scripts/amx_row_scale.py [--sizes 1,2,4,8,16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
P = ctypes.c_void_p


def build(tmp: str) -> ctypes.CDLL:
    from ddspec import native

    cc = native.c_compiler()
    if cc is None:
        sys.exit("amx_row_scale: no C compiler (cc/gcc) on PATH")
    lib = Path(tmp) / "libamx_row_scale.so"
    done = subprocess.run([cc, "-O3", "-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-int8", "-fopenmp", "-fPIC",
                           "-shared", str(HERE / "amx_row_scale.c"), "-o", str(lib)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"amx_row_scale: the build failed:\n{done.stderr[-2000:]}")
    return ctypes.CDLL(str(lib))


class RowScaled:
    """Random 8-bit weights [out, in] with one scale per output row, packed for AMX tiles."""

    def __init__(self, lib, out: int, inputs: int, gen: torch.Generator) -> None:
        self.lib, self.out, self.inputs = lib, out, inputs
        self.w = torch.randint(-127, 128, (out, inputs), dtype=torch.int8, generator=gen)
        self.s = torch.rand(out, generator=gen) * 0.01 + 0.001
        self.packed = torch.empty(out * inputs, dtype=torch.int8)
        lib.amx_pack(P(self.w.data_ptr()), ctypes.c_int64(out), ctypes.c_int64(inputs), P(self.packed.data_ptr()))


def sweep(lib, weights: list[RowScaled], x: torch.Tensor, threads: int) -> torch.Tensor:
    n, inputs = x.shape
    ws = (P * len(weights))(*[w.packed.data_ptr() for w in weights])
    ss = (P * len(weights))(*[w.s.data_ptr() for w in weights])
    outs = (ctypes.c_int64 * len(weights))(*[w.out for w in weights])
    y = torch.empty(n, max(w.out for w in weights))
    if lib.amx_sweep(ws, ss, outs, ctypes.c_int64(len(weights)), ctypes.c_int64(inputs), P(x.data_ptr()),
                     ctypes.c_int64(n), P(y.data_ptr()), threads):
        raise ValueError(f"amx_sweep refused {n} rows of {inputs} inputs")
    return y.view(-1)[: n * weights[-1].out].view(n, weights[-1].out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,8,16", help="row counts, at most 16 (default 1,2,4,8,16)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds, medians taken (default 9)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(not 1 <= n <= 16 for n in sizes):
        sys.exit("amx_row_scale: --sizes must be between 1 and 16 (one tile's rows)")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_int8" not in flags:
        sys.exit("amx_row_scale: this CPU has no AMX-INT8 (an Intel Xeon of Sapphire Rapids or later has)")
    torch.set_num_threads(args.threads)

    from ddspec import native
    from ddspec.bench.phases import sweep_weights
    from ddspec.bench.target import prefixed_forwards
    from ddspec.machine import interleaved_medians
    from ddspec.models.loading import load_target

    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        if lib.amx_init() != 0:
            sys.exit("amx_row_scale: Linux did not grant this process the AMX tile state")
        gen = torch.Generator().manual_seed(0)
        check = RowScaled(lib, 96, 576, gen)  # the tiles' sums against torch's
        for n in (1, 3, 16):
            x = torch.randn(n, 576, generator=gen)
            m = x.abs().amax(1, keepdim=True)
            want = (torch.round(x * 127 / m) @ check.w.float().T) * (m / 127) * check.s
            err = (sweep(lib, [check], x, args.threads) - want).abs().max().item()
            if err > 1e-4 * want.abs().max().item():
                sys.exit(f"amx_row_scale: the tiles' results are wrong ({err:.3g} off at {n} rows)")

        target = load_target("default", impl="native", activations="int8")
        ours = {name: streamed for name, (streamed, _) in sweep_weights(target).items()}
        tiles = {name: [RowScaled(lib, w.out_features, w.in_features, gen) for w in ws] for name, ws in ours.items()}
        xs = {n: {name: torch.randn(n, ws[0].in_features, generator=gen) for name, ws in ours.items()} for n in sizes}
        forward, settle = prefixed_forwards(target, 256, sizes)

        def run(case: tuple[str, int]) -> None:
            what, n = case
            if what == "forward":
                forward(n)
            else:
                for name in ours:
                    if what == "ours":
                        native.gemm_sweep(ours[name], xs[n][name])
                    else:
                        sweep(lib, tiles[name], xs[n][name], args.threads)

        cases = [(what, n) for n in sizes for what in ("forward", "ours", "tiles")]
        med = {case: s * 1e3 for case, s in interleaved_medians(
            cases, run, args.rounds, setup=lambda case: settle(case[1]) if case[0] == "forward" else None).items()}
    what_if = {n: med[("forward", n)] - med[("ours", n)] + med[("tiles", n)] for n in sizes}
    rows = [("int8 forward over N tokens after 256", {n: med[("forward", n)] for n in sizes}),
            ("its matmuls alone, ddspec's kernels (GGUF blocks)", {n: med[("ours", n)] for n in sizes}),
            ("the same matmuls, 8-bit rows on AMX tiles", {n: med[("tiles", n)] for n in sizes}),
            ("the forward with the tiles' matmuls instead", what_if)]
    print(f"ms, medians of {args.rounds} interleaved rounds, {args.threads} threads")
    print(f"| | {' | '.join(f'N = {n}' for n in sizes)} |")
    print(f"|---|{'---:|' * len(sizes)}")
    for label, v in rows:
        print(f"| {label} | {' | '.join(f'{v[n]:.2f}' for n in sizes)} |")
    base, alt = med[("forward", sizes[0])], what_if[sizes[0]]
    print(f"T(N)/T({sizes[0]}) today: " + ", ".join(f"{med[('forward', n)] / base:.2f}" for n in sizes))
    print(f"T(N)/T({sizes[0]}) with the tiles: " + ", ".join(f"{what_if[n] / alt:.2f}" for n in sizes)
          + f"; its T({sizes[0]}) is {alt / base:.2f}x today's")


if __name__ == "__main__":
    main()
