"""Measured step costs for the cost-aware method: measure them, check them, cache them.

For a target + head + device + dtype + threads (+ tree width) it times a target forward over N
new tokens after a realistic prefix (asking for the hidden layers the head reads, as real steps
do), one draft level (head on the frontier, log-softmax, top-k), the root's draft distribution,
and the per-step rest (commit + head refresh). The result is a
:class:`~ddspec.tree.cost.CostModel`, cached as JSON under ``<cache root>/costs/``
(``ddspec.machine.cache_root``); a missing or stale entry (any key field changed) is measured.

A calibration is only as good as the machine was quiet: every size is timed once per round,
rounds repeat, and the spread across rounds (median over sizes of IQR / median) is checked; a
spread above :data:`MAX_SPREAD` measures again (up to :data:`ATTEMPTS` times, keeping the
quietest), and the entry records when it was measured, its spread and the load average. The
method keeps correcting the curve from the step times it observes (tree/cost.py,
:class:`~ddspec.tree.cost.LearnedCosts`) and writes the learned curve back when it disagrees
persistently, so a bad entry does not last.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ddspec.fileio import write_json_atomic
from ddspec.machine import OtherLoad, cpu_name, device_sync, load_average
from ddspec.measured import Entry, not_cached
from ddspec.tree.cost import CostModel

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # beyond 64: extrapolated (EAGLE-2 verifies <= 60)
PREFIX = 256
SETTLE = 2  # untimed one-token forwards before each timed size (measure_once, bench.target.forward_times)
SMALL_ROWS = 8  # sizes up to this (decoding's steps) are timed among themselves, after the larger ones
FORMAT = 5  # 3: forwards ask for the head's hidden layers; entries carry spread and load; 4: the root as real steps pay it; 5: sizes up to SMALL_ROWS timed among themselves, each after SETTLE one-token forwards
MAX_SPREAD = 0.15  # median relative IQR across rounds above which a calibration is measured again
ATTEMPTS = 3
RETRY_BUDGET_S = 15.0  # no new attempt starts after this long (a first run must not take minutes: at most
# two attempts on this machine; the method corrects the costs from the steps it times anyway)


def cost_key(target, head, top_k: int, draft_weights: str) -> dict:
    """What a cost measurement depends on. ``draft_weights``: how the drafter holds the head's
    matmul weights (``EagleDrafter.draft_weights``, one of packed.DRAFT_WEIGHTS), which changes
    what a draft level costs."""
    head_sum = sum(float(p.detach().double().abs().sum()) for p in head.parameters())
    draft_vocab = head.d2t.numel() if hasattr(head, "d2t") else target.info.vocab_size
    key = {
        "format": FORMAT, "target": target.info.name, "impl": type(target).__name__,
        "head": f"{head_sum:.6e}:{draft_vocab}", "device": str(target.device), "dtype": str(target.dtype),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_name(), "top_k": top_k,
    }
    if getattr(target, "activations", "fp32") != "fp32":  # another model, other costs (fp32 keys unchanged)
        key["activations"] = target.activations
    if getattr(target, "kv_dtype", torch.float32) != torch.float32:  # an fp16 cache: other attention costs
        key["kv_cache"] = str(target.kv_dtype).removeprefix("torch.")
    if draft_weights != "q8_0":  # the head's matmuls on other kernels, other draft costs (keys made before
        key["draft_weights"] = draft_weights  # this field existed were all q8_0's, and stay valid)
    from ddspec import native

    if native.available():  # other kernels (a new ddspec, other compiler flags), other costs: measure again
        key["kernels"] = native.build_id()
        if passes := native.wide_choice():  # the AVX-512 passes chosen on this machine (timed once, cached)
            key["passes"] = passes
    return key


def drafter_cost_key(target, drafter) -> dict:
    """:func:`cost_key` of the set-up ``drafter`` (an EagleDrafter) drafts in."""
    return cost_key(target, drafter.head, drafter.cfg.top_k, drafter.draft_weights)


def relative_spread(samples: dict[int, list[float]]) -> float:
    """Median over sizes of (interquartile range / median): how much the rounds disagreed."""
    spreads = []
    for ts in samples.values():
        if len(ts) >= 2:
            q = statistics.quantiles(ts, n=4, method="inclusive")
            spreads.append((q[2] - q[0]) / statistics.median(ts))
    return statistics.median(spreads) if spreads else 0.0


def size_groups(sizes) -> tuple[list[int], list[int]]:
    """The sizes as they are timed (measure_once, bench.target.forward_times): the ones above
    SMALL_ROWS first, then decoding's own, each group largest first; a group's first round is
    a warm-up, so the small sizes are timed in the state decoding leaves, not a large forward's."""
    large = sorted((n for n in sizes if n > SMALL_ROWS), reverse=True)
    return large, sorted((n for n in sizes if n <= SMALL_ROWS), reverse=True)


@dataclass
class Measurement:
    cost: CostModel
    spread: float  # relative_spread of the verify rounds
    attempts: int = 1
    load: float | None = None  # 1-minute load average when it finished
    measured: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))
    source: str = "calibrated"  # or "learned" (written back by the method from observed steps)


def measure_once(target, drafter, sizes=SIZES, reps: int = 5, bar=None) -> Measurement:
    """Time the pieces of a step with this target and drafter (its head and tree width)."""
    gen = torch.Generator().manual_seed(0)
    vocab, layers = target.info.vocab_size, drafter.hidden_layers
    dev = target.device  # the drafter's inputs live where the head's weights do
    prompt = torch.randint(0, vocab, (PREFIX,), generator=gen).to(dev)
    room = PREFIX + max(sizes) + 8
    target.reset(room)
    out = target.forward(prompt, torch.arange(PREFIX), None, layers, last_logits=True)
    target.commit(torch.arange(PREFIX))
    drafter.reset(room)
    drafter.prefill(prompt, out, prompt[-1])
    drafter._committed = PREFIX
    # every size once per round, rounds repeated: a slow spell of a shared machine then spreads
    # over all sizes instead of bending the curve at a few of them (and shows in the spread).
    # A forward runs slower for a while after a large one (a CPU's last-level cache holds part
    # of the weights between decoding steps, and a large forward's other kernels and buffers push
    # them out): after 64 tokens the next one-token forwards took 5.2, 5.1, 4.6, 4.2, 4.0, 3.9 and
    # 3.7 ms (3.6 in decoding; int8 target, Intel Xeon family 6 model 167), and timed in
    # increasing order with the large sizes, the calibrated one-token step was 60% too dear and
    # the curve nearly flat up to 4 tokens. So the sizes up to SMALL_ROWS are timed among
    # themselves, after the larger ones (their own warm-up round restores the decoding state), and
    # each size after SETTLE one-token forwards untimed, as a decoding step follows others.
    inputs = {n: torch.randint(0, vocab, (n,), generator=gen) for n in sorted({*sizes, 1})}
    times: dict[int, list[float]] = {n: [] for n in sizes}

    def run(n: int) -> float:
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        device_sync(dev)
        t = time.perf_counter()
        target.forward(inputs[n], PREFIX + torch.arange(n), mask, layers)
        device_sync(dev)
        elapsed = time.perf_counter() - t
        target.truncate(PREFIX)
        return elapsed * 1e3

    for group in size_groups(sizes):
        for r in range(reps + 1):  # pass 0 is a warm-up
            for n in group:
                for _ in range(SETTLE):
                    run(1)
                elapsed = run(n)
                if r:
                    times[n].append(elapsed)
            if bar is not None:
                bar.update(len(group) / (reps + 1))
    verify = {n: statistics.median(ts) for n, ts in times.items()}
    k = drafter.cfg.top_k
    feats = out.features[-k:] if out.features.shape[0] >= k else out.features[-1:].expand(k, -1)
    toks = prompt[-k:] if prompt.numel() >= k else prompt[-1:].expand(k)
    mask = torch.ones(1, 1, k, PREFIX + k, dtype=torch.bool, device=dev)

    def level():
        hidden = drafter._run(feats, toks, torch.full((k,), PREFIX, device=dev), mask)
        drafter.draft_top(hidden, k)
        drafter.cache.truncate(PREFIX)

    level_ms = _median_ms(level, reps * 2, dev)
    root_ms = _median_ms(lambda: drafter.draft_top(drafter.root_hidden.view(1, -1), k), reps * 2, dev)

    def other():  # a typical commit: keep 3 entries, refresh the head over them
        step = target.forward(prompt[:3], PREFIX + torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril_(),
                              layers)
        target.commit(torch.arange(3))
        device_sync(dev)
        t = time.perf_counter()
        drafter._commit_entries(drafter._committed_features(step), prompt[:3])
        device_sync(dev)
        elapsed = time.perf_counter() - t
        target.truncate(PREFIX)
        drafter.cache.truncate(PREFIX)
        return elapsed

    other()
    other_ms = statistics.median(other() for _ in range(reps)) * 1e3
    cost = CostModel(verify_ms=verify, draft_root_ms=root_ms, draft_level_ms=level_ms, other_ms=other_ms)
    cost = replace(cost, draft_root_ms=policy_root_ms(target, drafter, cost, prompt[-1], reps * 2))
    if bar is not None:
        bar.update(3)
    return Measurement(cost, relative_spread(times), load=load_average())


def policy_root_ms(target, drafter, cost: CostModel, root: torch.Tensor, reps: int) -> float:
    """The root of a drafted step as real steps pay it: the root distribution, plus the cost-aware
    policy's choices and the tree built around it (a whole proposal, minus its levels at
    ``cost.draft_level_ms`` each, which is how the policy splits the steps it times), each after a
    target forward, as in a real step. The bare root distribution alone (``cost.draft_root_ms``)
    was 0.24 ms here against 1.9 ms in real steps, so every first run corrected, and rewrote, the
    fresh calibration."""
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy

    cfg = drafter.cfg
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    saved, drafter.cost_policy = drafter.cost_policy, policy
    samples = []
    try:
        # the first min_drafted proposals find the policy without a drafted rate (a cheaper choice
        # than later on): each proposal is fed back as a step (every node accepted, so that the
        # policy keeps drafting) and only the later drafted ones are timed
        for r in range(policy.min_drafted + 4 * reps):
            # a real step's verification runs between two proposals and leaves other weights in the caches
            target.forward(root.view(1), torch.tensor([PREFIX]), None, drafter.hidden_layers)
            target.truncate(PREFIX)
            device_sync(target.device)
            t = time.perf_counter()
            tree = drafter.propose(root, PREFIX)
            device_sync(target.device)
            elapsed = (time.perf_counter() - t) * 1e3
            drafter.cache.truncate(PREFIX)
            if r >= policy.min_drafted and policy.drafting:
                samples.append(max(elapsed - max(policy.levels - 1, 0) * cost.draft_level_ms, cost.draft_root_ms))
                if len(samples) == reps:
                    break
            verify = cost.verify(torch.tensor([tree.size])).item() + cost.other_ms
            policy.observe_step(tree.size, tree.size, elapsed, verify, 0.0)
    finally:
        drafter.cost_policy = saved
    return statistics.median(samples) if samples else cost.draft_root_ms


def _median_ms(fn, reps: int, device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        device_sync(device)
        t = time.perf_counter()
        fn()
        device_sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(target, drafter, sizes=SIZES, reps: int = 5, progress: bool = True,
            attempts: int = ATTEMPTS, max_spread: float = MAX_SPREAD, budget_s: float = RETRY_BUDGET_S) -> Measurement:
    """Measure until the rounds agree (spread <= max_spread), ``attempts`` run out or ``budget_s``
    has passed; keep the quietest attempt."""
    best: Measurement | None = None
    start = time.perf_counter()
    for attempt in range(1, attempts + 1):
        desc = "calibrating" if attempt == 1 else f"calibrating again ({attempt}/{attempts})"
        with tqdm(total=len(sizes) + 3, desc=desc, unit="piece", file=sys.stderr,
                  disable=not progress or None) as bar:
            m = measure_once(target, drafter, sizes, reps, bar)
        if best is None or m.spread < best.spread:
            best = m
        if m.spread <= max_spread:
            break
        if progress:
            print(f"ddspec: the calibration's rounds disagreed by {m.spread:.0%} (more than {max_spread:.0%}): "
                  "is another program using the CPU? (the method corrects the costs as it runs)", file=sys.stderr)
        if time.perf_counter() - start > budget_s:
            break
    best.attempts = attempt
    return best


# -- the cache --------------------------------------------------------------------------------
def to_json(m: Measurement, key: dict) -> dict:
    c = m.cost
    return {"key": key, "verify_ms": {str(n): t for n, t in sorted(c.verify_ms.items())},
            "draft_root_ms": c.draft_root_ms, "draft_level_ms": c.draft_level_ms, "other_ms": c.other_ms,
            "measured": m.measured, "spread": m.spread, "attempts": m.attempts, "load": m.load, "source": m.source}


def from_json(data: dict) -> Measurement:
    cost = CostModel(verify_ms={int(n): float(t) for n, t in data["verify_ms"].items()},
                     draft_root_ms=float(data["draft_root_ms"]), draft_level_ms=float(data["draft_level_ms"]),
                     other_ms=float(data["other_ms"]))
    return Measurement(cost, float(data.get("spread", 0.0)), int(data.get("attempts", 1)), data.get("load"),
                       str(data.get("measured", "?")), str(data.get("source", "calibrated")))


class CostStore:
    """One set-up's cache entry (``<cache root>/costs/<hash of key>.json``, ddspec/measured.py): read
    it, write it atomically, and say once if the cache cannot be written."""

    def __init__(self, key: dict) -> None:
        self.entry = Entry("costs", key, "the step costs")
        self.key, self.path = key, self.entry.path

    def read(self) -> Measurement | None:
        """The cached measurement, or None when missing or stale; a corrupt file gets a notice."""
        return self.entry.read(from_json)

    def write(self, m: Measurement) -> bool:
        """Whether ``m`` is cached now (False when the cache cannot be written)."""
        return self.entry.write(to_json(m, self.key))


class PolicyMemory:
    """What the cost-aware method learned in earlier runs with one set-up (the calibration's key):
    ``<cache root>/costs/<entry>.policy.json`` next to the costs. A one-shot ``ddspec generate``
    is a new process each time; without it every run explored afresh (its first drafted steps are
    forced, to learn what drafting yields here). ``DDSPEC_POLICY_MEMORY=0`` turns it off."""

    def __init__(self, store: CostStore) -> None:
        self.key, self.path = store.key, store.path.with_name(store.path.stem + ".policy.json")

    @staticmethod
    def enabled() -> bool:
        import os

        return os.environ.get("DDSPEC_POLICY_MEMORY", "1").strip().lower() not in ("0", "false", "no", "off")

    def _entry(self) -> dict | None:
        """The file's content when it is this set-up's, else None (missing, another's, unreadable)."""
        try:
            data = json.loads(self.path.read_text())
            return data if data.get("key") == self.key and isinstance(data.get("policy"), dict) else None
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def read(self) -> dict | None:
        """The remembered state, or None (start afresh)."""
        entry = self._entry()
        return None if entry is None else entry["policy"]

    def describe(self) -> str:
        """What ``ddspec calibrate --show`` prints about it."""
        data = self._entry()
        if data is None:
            return f"policy memory {self.path}: none yet (the next ddspec run starts it)"
        p = data["policy"]
        plain = p.get("_plain_tokens", 0.0) / p["_plain_ms_sum"] if p.get("_plain_ms_sum") else 0.0
        drafted = p.get("_draft_tokens", 0.0) / p["_draft_ms"] if p.get("_draft_ms") else 0.0
        return (f"policy memory {self.path}\n  saved {data.get('saved', '?')} ({_age(str(data.get('saved')))}); "
                f"plain steps {plain:.3f} tokens/ms, drafted steps forecast {drafted:.3f} tokens/ms "
                f"over {p.get('_drafted', 0):.0f} drafted and {p.get('_plain_steps', 0)} plain steps seen")

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)

    def write(self, policy: dict) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"key": self.key, "policy": policy,
                                          "saved": time.strftime("%Y-%m-%d %H:%M:%S")})
            return True
        except OSError:
            return False  # an unwritable cache: the costs' own notice says so


def load_or_measure(target, drafter, *, refresh: bool = False, progress: bool = True) -> tuple[Measurement, CostStore]:
    """The cached measurement for this set-up, measuring (and caching) it when missing or stale; one
    measured while other programs took more than a quarter of the CPU is used but not cached (a
    first run beside a build had cached one-token verifications at 3x their cost)."""
    store = CostStore(drafter_cost_key(target, drafter))
    m = None if refresh else store.read()
    if m is None:
        others = OtherLoad()
        m = measure(target, drafter, progress=progress)
        share = others.too_busy()
        if share is not None:  # used now (and corrected as steps run), not kept to steer later runs
            not_cached("the step costs", f"other programs used {share:.0%} of the CPU while measuring them")
        else:
            store.write(m)
    return m, store


def describe(m: Measurement, path: Path) -> str:
    """What ``ddspec calibrate`` and ``--show`` print about an entry."""
    c = m.cost
    age = _age(m.measured)
    load = "?" if m.load is None else f"{m.load:.2f}"
    return "\n".join([
        f"cost entry {path}",
        f"  {m.source} {m.measured} ({age}); spread across rounds {m.spread:.1%}, {m.attempts} attempt(s), "
        f"load average {load}",
        "  verify ms by N: " + ", ".join(f"{n}: {t:.1f}" for n, t in sorted(c.verify_ms.items())),
        f"  draft: root {c.draft_root_ms:.2f} ms, each further level {c.draft_level_ms:.2f} ms; "
        f"other per step {c.other_ms:.2f} ms",
    ])


def _age(stamp: str) -> str:
    try:
        seconds = time.time() - time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return "age unknown"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit} old"
    return f"{seconds:.0f} s old"
