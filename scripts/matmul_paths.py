"""Which fp32 matmul path is fastest here for the default model's weight shapes?

Compares, for 1-64 rows, ``F.linear(x, W)`` (MKL, W [out, in]), oneDNN's
``torch.ops.mkldnn._linear_pointwise`` and ``torch.mm(x, W^T)`` with W pre-transposed to
[in, out], streaming 30 layers of distinct weights (as a real forward does, so that the
weights come from memory, not from the cache). The native target stores [in, out] weights
and uses ``torch.matmul`` because that column won or tied on our CPU (2026-11-30, 2 threads):

    rows:        1      2      4      8     16     32     64   (ms for 30 layers' 4 matmuls)
    F.linear   26.2   23.2   34.3   38.2   54.0   57.6   89.7
    mkldnn     28.6   39.4   36.2   41.2   51.6   59.7   89.4
    mm(W^T)    19.4   25.4   28.6   59.9*  44.8   50.3   85.9     (* a noisy sample)

A later, more careful measurement (15 interleaved runs, medians, 2026-11-30) found
F.linear on [out, in] weights 15-20% faster than mm at 2-3 rows (18.3 vs 21.7 ms, 19.0 vs
23.7 ms) and slower at 1 row (17.7 vs 14.9 ms): the native target now keeps both layouts for
small models on a CPU and picks by row count (models/llama.py, ``project``).

Run: python scripts/matmul_paths.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, gate+up, down
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [[torch.randn(o, i) for (o, i) in SHAPES] for _ in range(LAYERS)]
    transposed = [[w.t().contiguous() for w in ws] for ws in weights]
    paths = {
        "F.linear": lambda x, l, j: F.linear(x, weights[l][j]),
        "mkldnn": lambda x, l, j: torch.ops.mkldnn._linear_pointwise(x, weights[l][j], None, "none", [], ""),
        "mm(W^T)": lambda x, l, j: torch.mm(x, transposed[l][j]),
    }
    print("rows " + " ".join(f"{name:>9}" for name in paths))
    for n in (1, 2, 4, 8, 16, 32, 64):
        xs = {i: torch.randn(n, i) for i in (576, 1536)}
        row = []
        for fn in paths.values():
            def stack():
                for layer in range(LAYERS):
                    for j, (_, i) in enumerate(SHAPES):
                        fn(xs[i], layer, j)
            stack()
            times = []
            for _ in range(9):
                t = time.perf_counter()
                stack()
                times.append(time.perf_counter() - t)
            row.append(statistics.median(times) * 1e3)
        print(f"{n:4d} " + " ".join(f"{t:9.2f}" for t in row))


if __name__ == "__main__":
    main()
