"""Benchmark of the target layer on the default model (issue: foundation).

Prints, in one run, on this machine:
1. greedy decoding tokens/s at 256 new tokens: ddspec's native plain decoding (fp32
   activations, and ``--activations int8`` where the model has GGUF blocks) vs HF ``generate``
   (median of R interleaved runs, same prompt, all forced to 256 tokens), and how many of the
   int8 model's tokens equal the fp32 model's before the first difference;
2. the memory floor: fp32 weight bytes / measured copy bandwidth (STREAM convention: bytes read
   + bytes written per second), and the fraction of it our decoding reaches;
3. the time of one target forward over N = 1..64 new tokens after a 256-token prefix, for the
   native (fp32 and int8 activations) and the HF implementation (median of several repetitions), with the matmul kernels the
   native target chose on this machine (models/kernels.py);
4. the compute floor: the CPU's measured 8-bit multiply-add peak, and what it allows a forward
   over 8 and 16 tokens whatever the kernel (the lower bound of T(8)/T(1) and T(16)/T(1)); and the
   re-read floor: the weight bytes a token reads / the rate at which these threads re-read a
   buffer that size (as a forward re-reads its weights every token), the least time of any
   one-token forward here;
5. long context: the forward over 1, 4, 8 new tokens after 2,000 cached tokens and the prefill of
   a 2,000-token prompt, per native arm (with the KV cache's dtype);
6. the time of one draft level of the shipped head (head over top_k frontier rows, log-softmax
   over the draft vocabulary, top-k) for top_k = 1..16.

Run: ``python -m ddspec.bench.target [--repeats 3] [--out runs/bench_target.md]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from ddspec.bench.report import native_kernels_line
from ddspec.machine import core_count, cpu_name, device_sync
from ddspec.config import StopConfig
from ddspec.engine import Engine
from ddspec.prompts import chat_prompt_ids

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
SIZES = (1, 2, 4, 8, 16, 32, 64)


def copy_bandwidth(mbytes: int = 256, reps: int = 7) -> float:
    """Bytes moved per second (read + write) copying a buffer far larger than the caches."""
    src = torch.ones(mbytes * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def bytes_read_per_token(target) -> int:
    """Weight bytes one plain decoding step streams with the kernels chosen for 1 row: fp32 for
    torch's kernels, the GGUF blocks for ``native`` where the weights have them."""
    def size(weight, kernel: str) -> int:
        if kernel == "native" and weight.native is not None:
            return weight.native.nbytes
        return weight.out_features * weight.in_features * 4
    layers = sum(size(w, target.layer_plan.kernel(1)) for layer in target.layers for w in layer.weights)
    return layers + size(target.lm_head_w, target.head_plan.kernel(1))


def macs_per_token(target) -> int:
    """Weight multiply-adds of one token's forward: every layer matmul and the lm_head (attention
    adds a little more, growing with the context)."""
    ws = [w for layer in target.layers for w in layer.weights] + [target.lm_head_w]
    return sum(w.out_features * w.in_features for w in ws)


def arithmetic_ms_per_token(target, peak: float | None) -> float | None:
    """Ms of one token's weight multiply-adds at the 8-bit peak (``peak``: per second), None without one."""
    return macs_per_token(target) / peak * 1e3 if peak else None


def compute_floor_lines(target, fwd: dict[int, float], peak: float | None) -> list[str]:
    """What the CPU's 8-bit multiply-add peak allows a forward over N tokens, against the
    int8 curve measured here (``fwd``: N -> ms)."""
    from ddspec import native as native_lib

    if peak is None or not fwd:
        return []
    macs = macs_per_token(target)
    per_token = arithmetic_ms_per_token(target, peak)  # ms of int8 arithmetic per token, at the peak
    floor = {n: n * per_token for n in (8, 16)}
    marginal = (fwd[16] - fwd[8]) / 8
    return [
        "",
        f"Compute floor: a token's forward multiplies {macs / 1e6:.0f} M weights (layers and lm_head; attention "
        f"comes on top). This CPU's measured 8-bit multiply-add peak is {peak / 1e9:.0f} GMAC/s in these threads "
        f"(`{native_lib.int8_peak_step()}` on registers, the int8 kernels' widest inner step; no weight loaded, no "
        f"scale applied), so N "
        f"tokens need at least N x {per_token:.2f} ms of arithmetic whatever the kernel: T(8) >= {floor[8]:.1f} ms "
        f"and T(16) >= {floor[16]:.1f} ms. Against the int8 T(1) measured here ({fwd[1]:.1f} ms), T(8)/T(1) >= "
        f"{floor[8] / fwd[1]:.2f} and T(16)/T(1) >= {floor[16] / fwd[1]:.2f} for any implementation on this CPU "
        f"(a faster one-token forward only raises them). Each token past 8 costs {marginal:.2f} ms here, "
        f"{per_token / marginal * 100:.0f}% of the peak's {per_token:.2f} ms.",
    ]


def reread_floor_lines(read: int, rate: float | None, fwd: dict[int, float], per_token_ms: float | None) -> list[str]:
    """What re-reading a token's weights costs on this machine (``rate``: native.read_rate over ``read``
    bytes), against the int8 T(1) measured here, and the best T(8)/T(1) the two floors leave."""
    if rate is None or not fwd:
        return []
    ms = read / rate * 1e3
    lines = [
        "",
        f"Re-read floor: every token's forward reads the same {read / 1e6:.0f} MB of weights again. These threads "
        f"re-read a buffer of that size at {rate / 1e9:.1f} GB/s here (best of 15 passes; it stays in this CPU's "
        f"caches as far as they hold it, whereas the copy above streams from memory), so no one-token forward of "
        f"these weights takes less than {ms:.2f} ms on this machine: the int8 T(1) measured here "
        f"({fwd[1]:.1f} ms) spends at least {ms / fwd[1] * 100:.0f}% of its time reading them.",
    ]
    if per_token_ms is not None:
        best = max(ms, 8 * per_token_ms) / max(ms, per_token_ms)
        lines[-1] += (f" With the compute floor, an implementation at both floors (reads and arithmetic fully "
                      f"overlapped) would have T(8)/T(1) = {best:.2f}; measured here: {fwd[8] / fwd[1]:.2f}.")
    return lines


def time_ours(target, ids: list[int], n: int) -> tuple[float, list[int]]:
    """tokens/s of plain decoding, and the tokens."""
    device_sync(target.device)
    t = time.perf_counter()
    res = Engine(target).generate(ids, StopConfig(max_new_tokens=n, stop_on_eos=False))
    assert res.stats.new_tokens == n
    return n / (time.perf_counter() - t), list(res.token_ids)  # the tokens' .tolist() waited for a GPU


def load_int8():
    """The default model with 8-bit activations, or None (with the reason printed) where it cannot run."""
    from ddspec.errors import DdspecError
    from ddspec.models.loading import load_target

    try:
        return load_target("default", impl="native", activations="int8")
    except DdspecError as e:
        print(f"no int8 arm: {e}", flush=True)
        return None


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def time_hf_generate(model, ids: list[int], n: int) -> float:
    x = torch.tensor([ids], device=model.device)
    device_sync(model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    device_sync(model.device)
    assert out.shape[1] - x.shape[1] == n
    return n / (time.perf_counter() - t)


def forward_times(target, prefix: int, sizes=SIZES, reps: int = 15) -> dict[int, float]:
    """Median ms of one forward over N new tokens (causal among themselves) after `prefix` tokens.

    The sizes are interleaved (:func:`~ddspec.machine.interleaved_medians`): each of ``reps`` rounds
    (after a warm-up round) times every N once, in an order rotated every round, so that a change in
    the machine's speed during the run (this VM's moves from minute to minute) lands on every N
    alike instead of on the ratios between them. As in the calibration (:func:`~ddspec.calibrate.measure_once`),
    the sizes up to :data:`~ddspec.calibrate.SMALL_ROWS` are timed among themselves, after the
    larger ones, and each forward after :data:`~ddspec.calibrate.SETTLE` one-token forwards, untimed:
    a forward runs slower for a while after a large one, and interleaved with them the int8
    model's T(1) here read 5.0 ms against 3.5-3.7 ms in decoding (Intel Xeon family 6 model 167),
    which made T(8) / T(1) look 1.41 instead of about 1.9."""
    from ddspec.calibrate import size_groups
    from ddspec.machine import interleaved_medians

    run, settle = prefixed_forwards(target, prefix, sizes)
    medians = {}
    for group in size_groups(sizes):
        if group:
            medians.update(interleaved_medians(group, run, reps, setup=settle))
    target.truncate(prefix)
    return {n: medians[n] * 1e3 for n in sizes}


def prefixed_forwards(target, prefix: int, sizes):
    """``(run, settle)`` for timing forwards after a random ``prefix``-token prompt, which this puts
    in the target's cache: ``run(n)`` is the forward over n new random tokens (causal among
    themselves; a GPU's work done before it returns), ``settle(n)`` the :data:`~ddspec.calibrate.SETTLE`
    untimed one-token forwards that go before each timed one (as decoding steps follow each
    other), each from the prefix, which it leaves in place for ``run``."""
    from ddspec.calibrate import SETTLE

    gen = torch.Generator().manual_seed(0)
    vocab = target.info.vocab_size
    target.reset(prefix + max(sizes) + 1)
    target.forward(torch.randint(0, vocab, (prefix,), generator=gen), torch.arange(prefix))
    target.commit(torch.arange(prefix))
    inputs = {n: (torch.randint(0, vocab, (n,), generator=gen), torch.ones(n, n, dtype=torch.bool).tril_())
              for n in sizes}

    def run(n: int) -> None:
        target.forward(inputs[n][0], prefix + torch.arange(n), inputs[n][1])
        device_sync(target.device)  # a GPU's work done inside the timing

    def settle(n: int) -> None:
        for _ in range(SETTLE):
            target.truncate(prefix)
            run(1)
        target.truncate(prefix)

    if 1 not in inputs:
        inputs[1] = (torch.randint(0, vocab, (1,), generator=gen), torch.ones(1, 1, dtype=torch.bool))
    return run, settle


LONG_CONTEXT = 2000  # the long-context rows: forwards after this many cached tokens, and a prompt this long
LONG_SIZES = (1, 4, 8)


def prefill_ms(target, n: int, reps: int = 3) -> float:
    """Median ms of the prefill of an n-token prompt (the engine's call: the last token's logits)."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.info.vocab_size, (n,), generator=gen)
    times = []
    for _ in range(reps):
        target.reset(n + 1)
        t = time.perf_counter()
        target.forward(prompt, torch.arange(n), last_logits=True)
        device_sync(target.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def long_context_lines(arms: dict) -> list[str]:
    """The forward over 1, 4, 8 tokens after LONG_CONTEXT cached ones and the prefill of a prompt
    that long, per native arm: where attention, not the weights, sets the cost."""
    rows = []
    for name, target in arms.items():
        fwd = forward_times(target, LONG_CONTEXT, sizes=LONG_SIZES, reps=9)
        pre = prefill_ms(target, LONG_CONTEXT)
        label = "native" if name == "native" else "native, int8 activations"
        kv = str(getattr(target, "kv_dtype", torch.float32)).removeprefix("torch.").replace("float", "fp")
        rows.append(f"| {label} | {kv} | " + " | ".join(f"{fwd[n]:.1f}" for n in LONG_SIZES)
                    + f" | {fwd[4] / fwd[1]:.2f}x | {fwd[8] / fwd[1]:.2f}x | {pre:.0f} |")
    return [
        f"Long context: a forward over N new tokens after {LONG_CONTEXT:,} cached tokens (ms, median of 9 "
        f"rounds, interleaved) and the prefill of a {LONG_CONTEXT:,}-token prompt (ms, median of 3):",
        "",
        "| arm | KV cache | T(1) | T(4) | T(8) | T(4)/T(1) | T(8)/T(1) | prefill |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


LEVEL_TOP_KS = (1, 2, 4, 8, 10, 16)


def draft_level_times(target, prefix: int = 256, top_ks=LEVEL_TOP_KS, reps: int = 15,
                      head_spec: str | None = None) -> dict[int, float]:
    """Median ms of one draft level of a head (``head_spec``, as --head; default the shipped one) at
    each top_k, after `prefix` committed tokens."""
    from ddspec.config import TreeConfig
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.methods import resolve_head

    head = resolve_head(head_spec, target)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.info.vocab_size, (prefix,), generator=gen).to(target.device)
    result = {}
    for k in top_ks:
        drafter = EagleDrafter(head, target, TreeConfig(top_k=k, depth=6, total_tokens=60))
        target.reset(prefix + 8)
        out = target.forward(prompt, torch.arange(prefix), None, drafter.hidden_layers)
        drafter.reset(prefix + 8)
        drafter.prefill(prompt, out, prompt[-1])
        feats, toks = out.features[-k:], prompt[-k:]
        mask = torch.ones(1, 1, k, prefix + k, dtype=torch.bool, device=target.device)
        times = []
        for _ in range(reps + 2):
            device_sync(target.device)
            t = time.perf_counter()
            hidden = drafter._run(feats, toks, torch.full((k,), prefix, device=target.device), mask)
            drafter.draft_top(hidden, k)  # the level's scores, as the drafter takes them
            device_sync(target.device)
            times.append(time.perf_counter() - t)
            drafter.cache.truncate(prefix)
        result[k] = statistics.median(times[2:]) * 1e3
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per arm (default 3)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=core_count())
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ddspec.models.loading import load_target

    native = load_target("default", impl="native")
    int8 = load_int8()
    hf = load_target("default", impl="hf")
    ids = chat_prompt_ids(native.tokenizer, [{"role": "user", "content": PROMPT}])

    arms = {"native": native} | ({"int8": int8} if int8 is not None else {})
    for target in arms.values():  # warm-up every arm
        time_ours(target, ids, 16)
    time_hf_generate(hf.model, ids, 16)
    ours: dict[str, list[float]] = {name: [] for name in arms}
    texts: dict[str, list[int]] = {}
    theirs = []
    for r in range(args.repeats):
        for name, target in arms.items():
            speed, texts[name] = time_ours(target, ids, args.new_tokens)
            ours[name].append(speed)
        theirs.append(time_hf_generate(hf.model, ids, args.new_tokens))
        print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in ours.items())
              + f", HF generate {theirs[-1]:.1f} tok/s", flush=True)
    bw = copy_bandwidth()
    wbytes = weight_bytes(hf.model)
    floor_ms = wbytes / bw * 1e3
    read = bytes_read_per_token(native)
    read_floor_ms = read / bw * 1e3
    med = {name: statistics.median(v) for name, v in ours.items()}
    ours_med, theirs_med = med["native"], statistics.median(theirs)
    fwd = {name: forward_times(target, 256) for name, target in arms.items()}
    fwd_native = fwd["native"]
    fwd_hf = forward_times(hf, 256)
    levels = draft_level_times(native)
    long_lines = long_context_lines(arms)
    from ddspec import native as native_lib

    peak = native_lib.int8_peak(args.threads)
    rate = native_lib.read_rate(read, args.threads)
    per_token_ms = arithmetic_ms_per_token(native, peak)
    int8_rows = []
    if int8 is not None:
        same = common_prefix(texts["native"], texts["int8"])
        int8_rows = [f"| ddspec native plain decoding, `--activations int8` | {med['int8']:.1f} | "
                     f"{1e3 / med['int8']:.1f} | {med['int8'] / theirs_med:.2f}x |"]
        int8_note = (f"`--activations int8`: its first {same} of {args.new_tokens} tokens equal the fp32 model's "
                     f"(the rounding of activations makes it a slightly different model; every method's output "
                     f"equals plain decoding with the same setting).")
    else:
        int8_note = "No `--activations int8` arm here (the model has no GGUF blocks or the kernels are unavailable)."
    curve_rows = ["| native, int8 activations | " + " | ".join(f"{fwd['int8'][n]:.1f}" for n in SIZES) + " |"
                  ] if int8 is not None else []
    ratio = lambda f: f"T(8)/T(1) = {f[8] / f[1]:.2f}x, T(16)/T(1) = {f[16] / f[1]:.2f}x"  # noqa: E731

    lines = [
        f"# Target benchmark: {native.info.name}, fp32",
        "",
        f"Command: `python -m ddspec.bench.target --repeats {args.repeats}`; machine: {cpu_name()}, "
        f"{args.threads} threads, torch {torch.__version__}; date: {date.today().isoformat()}.",
        "",
        f"Greedy decoding, {args.new_tokens} new tokens (prefill of {len(ids)} tokens included), "
        f"median of {args.repeats} interleaved runs:",
        "",
        "| arm | tokens/s | ms/token | speedup |",
        "|---|---|---|---|",
        f"| HF `generate` | {theirs_med:.1f} | {1e3 / theirs_med:.1f} | 1.00x |",
        f"| ddspec native plain decoding | {ours_med:.1f} | {1e3 / ours_med:.1f} | {ours_med / theirs_med:.2f}x |",
        *int8_rows,
        "",
        int8_note,
        "",
        f"Memory floor of the fp32 model: {wbytes / 1e6:.0f} MB of weights / {bw / 1e9:.1f} GB/s copy bandwidth = "
        f"{floor_ms:.1f} ms/token ({1e3 / floor_ms:.1f} tokens/s). The kernels chosen here read "
        f"{read / 1e6:.0f} MB per token (GGUF blocks where the native kernel runs): floor "
        f"{read_floor_ms:.1f} ms/token ({1e3 / read_floor_ms:.0f} tokens/s); native reaches "
        f"{read_floor_ms / (1e3 / ours_med) * 100:.0f}% of that.",
        "",
        "Target forward over N new tokens after a 256-token prefix (ms, median of 15 rounds, the sizes interleaved):",
        "",
        "| N | " + " | ".join(str(n) for n in SIZES) + " |",
        "|---|" + "---|" * len(SIZES),
        "| native | " + " | ".join(f"{fwd_native[n]:.1f}" for n in SIZES) + " |",
        *curve_rows,
        "| HF adapter | " + " | ".join(f"{fwd_hf[n]:.1f}" for n in SIZES) + " |",
        "",
        f"native {ratio(fwd_native)}" + (f"; int8 activations {ratio(fwd['int8'])}" if int8 is not None else "")
        + "; "
        f"kernels chosen here by rows (layers): {native.layer_plan.describe()}; lm_head: {native.head_plan.describe()}; "
        f"C kernels: {native_kernels_line()}",
        *compute_floor_lines(native, fwd.get("int8", {}), peak),
        *reread_floor_lines(read, rate, fwd.get("int8", {}), per_token_ms),
        "",
        *long_lines,
        "",
        "One draft level of the shipped head (head over top_k rows + log-softmax over the draft vocabulary "
        "+ top-k; ms, median):",
        "",
        *level_rows(levels),
    ]
    report = "\n".join(lines)
    print(report)
    write_report(args.out, report)
    return 0


def level_rows(levels: dict[int, float]) -> list[str]:
    """The markdown table of one draft level's ms by top_k."""
    return ["| top_k | " + " | ".join(str(k) for k in LEVEL_TOP_KS) + " |", "|---|" + "---|" * len(LEVEL_TOP_KS),
            "| ms | " + " | ".join(f"{levels[k]:.2f}" for k in LEVEL_TOP_KS) + " |"]


def write_report(out: Path | None, report: str) -> None:
    """Also write the report to ``out`` (markdown), when given."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
