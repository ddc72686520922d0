"""A/B of the AVX-512 VNNI passes for 8-bit activations (ddspec_kernels.c, DD_WIDE_A8) against the
8-lane VNNI passes, in one process, interleaved, medians: the int8 target's forward over N tokens
after a 256-token prefix (the layers' Q4_1 and the lm_head's Q8_0 blocks with 8-bit activations).
Both give the same bits (checked here too). Usage: python ab_avx512_vnni.py [reps]"""
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from ddspec import native  # noqa: E402
from ddspec.machine import cpu_name  # noqa: E402
from ddspec.models.loading import load_target  # noqa: E402

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
target = load_target("default", impl="native", activations="int8")
assert native.wide_available("q4_1a8"), "these kernels have no AVX-512 VNNI passes (CPU without AVX-512 VNNI, or DDSPEC_AVX512=0)"
chosen = native.wide_choice()  # as measured (or read from the cache) when the model loaded
print(f"cpu: {cpu_name()}; groups per pass chosen at load: {chosen}")


def use(wide: bool) -> None:
    for kind in ("q4_1a8", "q8_0a8"):
        native.set_wide(kind, chosen[kind] if wide else [0] * native.WIDE_ROWS)


gen = torch.Generator().manual_seed(0)
prefix = 256
target.reset(prefix + 80)
target.forward(torch.randint(0, target.info.vocab_size, (prefix,), generator=gen), torch.arange(prefix), None, ())
for n in (1, 2, 3, 4, 6, 8, 12, 16):
    toks = torch.randint(0, target.info.vocab_size, (n,), generator=gen)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
    pos = torch.arange(prefix, prefix + n)
    logits = {}
    times = {False: [], True: []}
    for r in range(reps + 1):
        for wide in ((False, True) if r % 2 else (True, False)):
            use(wide)
            target.truncate(prefix)
            t0 = time.perf_counter()
            out = target.forward(toks, pos, mask, ())
            if r:
                times[wide].append(time.perf_counter() - t0)
            logits[wide] = out.logits
    same = torch.equal(logits[False], logits[True])
    a, b = (statistics.median(times[w]) * 1e3 for w in (False, True))
    print(f"N={n:2d}: 8-lane {a:6.2f} ms  AVX-512 VNNI {b:6.2f} ms  ({b / a:.2f}x)  same logits: {same}", flush=True)
use(True)
