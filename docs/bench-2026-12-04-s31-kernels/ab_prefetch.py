"""A/B in one process: the quantised passes' L2 prefetch off vs the measured choice (or the blocks ahead given);
the forward over N tokens after 256, interleaved, medians. Usage: python ab_prefetch.py int8|fp32 REPS [8lane] [BLOCKS]
(8lane: the AVX-512 passes switched off, as on a CPU without AVX-512)."""
import statistics, sys, time, torch
torch.set_num_threads(2)
from ddspec import native
from ddspec.machine import cpu_name
from ddspec.models.loading import load_target
act = sys.argv[1]; reps = int(sys.argv[2]); lanes8 = "8lane" in sys.argv[3:]
target = load_target("default", impl="native", activations=act)
chosen = native.prefetch_blocks()
if lanes8:
    for kind in native.wide_choice():
        native.set_wide(kind, [0] * native.WIDE_ROWS)
if len(sys.argv) > 4:
    chosen = int(sys.argv[4])
print(f"cpu: {cpu_name()}; {act}; {'8-lane passes' if lanes8 else 'AVX-512 passes as chosen'}; prefetch: {chosen} blocks ahead")
gen = torch.Generator().manual_seed(0)
prefix = 256
target.reset(prefix + 80)
target.forward(torch.randint(0, target.info.vocab_size, (prefix,), generator=gen), torch.arange(prefix), None, ())
for n in (1, 2, 4, 8, 16):
    toks = torch.randint(0, target.info.vocab_size, (n,), generator=gen)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
    pos = torch.arange(prefix, prefix + n)
    times = {0: [], chosen: []}; out = {}
    for r in range(reps + 1):
        for b in ((0, chosen) if r % 2 else (chosen, 0)):
            native.set_prefetch(b)
            target.truncate(prefix)
            t0 = time.perf_counter(); o = target.forward(toks, pos, mask, ()); dt = time.perf_counter() - t0
            if r: times[b].append(dt)
            out[b] = o.logits
    a, b = (statistics.median(times[k]) * 1e3 for k in (0, chosen))
    print(f"N={n:2d}: no prefetch {a:6.2f} ms  prefetch {chosen} {b:6.2f} ms ({b / a:.2f}x)  same logits: {torch.equal(out[0], out[chosen])}", flush=True)
native.set_prefetch(chosen)
