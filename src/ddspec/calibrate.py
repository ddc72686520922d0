"""`ddspec calibrate`: measure what a step costs on this machine, and cache it.

For a target + head + device + dtype + threads (+ tree width), it times a target forward over
N new tokens after a realistic prefix, one draft level (head on the frontier, log-softmax,
top-k), the root's draft distribution, and the per-step rest (commit + head refresh). The
result is a :class:`~ddspec.tree.cost.CostModel`, cached as JSON under
``~/.cache/ddspec/costs/``; a missing or stale entry (any key field changed) is re-measured.
The cost-aware method (``--method ddspec``) loads it automatically.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ddspec.bench.report import cpu_name
from ddspec.models.loading import cache_root
from ddspec.tree.cost import CostModel

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
PREFIX = 256
FORMAT = 2  # 2: native targets gained the small-rows weight layout (costs changed)


def cost_key(target, head, top_k: int) -> dict:
    head_sum = sum(float(p.detach().double().abs().sum()) for p in head.parameters())
    draft_vocab = head.d2t.numel() if hasattr(head, "d2t") else target.info.vocab_size
    return {
        "format": FORMAT, "target": target.info.name, "impl": type(target).__name__,
        "head": f"{head_sum:.6e}:{draft_vocab}", "device": str(target.device), "dtype": str(target.dtype),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_name(), "top_k": top_k,
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{digest}.json"


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(target, drafter, sizes=SIZES, reps: int = 5, progress: bool = True) -> CostModel:
    """Time the pieces of a step with this target and drafter (its head and tree width)."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.info.vocab_size
    prompt = torch.randint(0, vocab, (PREFIX,), generator=gen)
    room = PREFIX + max(sizes) + 8
    target.reset(room)
    out = target.forward(prompt, torch.arange(PREFIX))
    target.commit(torch.arange(PREFIX))
    drafter.reset(room)
    drafter.prefill(prompt, out, prompt[-1])
    drafter._committed = PREFIX
    bar = tqdm(total=len(sizes) + 3, desc="calibrating", unit="piece", file=sys.stderr,
               disable=not progress or None)
    # every size once per round, rounds repeated: a slow spell of a shared machine then spreads
    # over all sizes instead of bending the curve at a few of them
    inputs = {n: torch.randint(0, vocab, (n,), generator=gen) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(reps + 1):  # round 0 is a warm-up
        for n in sizes:
            mask = torch.ones(n, n, dtype=torch.bool).tril_()
            t = time.perf_counter()
            target.forward(inputs[n], PREFIX + torch.arange(n), mask)
            elapsed = time.perf_counter() - t
            target.truncate(PREFIX)
            if r:
                times[n].append(elapsed)
        bar.update(len(sizes) / (reps + 1))
    verify = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    k = drafter.cfg.top_k
    feats = out.features[-k:] if out.features.shape[0] >= k else out.features[-1:].expand(k, -1)
    toks = prompt[-k:]
    mask = torch.ones(1, 1, k, PREFIX + k, dtype=torch.bool)

    def level():
        hidden = drafter._run(feats, toks, torch.full((k,), PREFIX), mask)
        drafter.logprobs(hidden).topk(k, dim=-1)
        drafter.cache.truncate(PREFIX)

    level_ms = _median_ms(level, reps * 2)
    bar.update(1)
    root_ms = _median_ms(lambda: drafter.logprobs(drafter.root_hidden.view(1, -1)).topk(k), reps * 2)
    bar.update(1)

    def other():  # a typical commit: keep 3 entries, refresh the head over them
        target.forward(prompt[:3], PREFIX + torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril_())
        target.commit(torch.arange(3))
        t = time.perf_counter()
        drafter._commit_entries(out.features[-3:], prompt[:3])
        elapsed = time.perf_counter() - t
        target.truncate(PREFIX)
        drafter.cache.truncate(PREFIX)
        return elapsed

    other()
    other_ms = statistics.median(other() for _ in range(reps)) * 1e3
    bar.update(1)
    bar.close()
    return CostModel(verify_ms=verify, draft_root_ms=root_ms, draft_level_ms=level_ms, other_ms=other_ms)


def to_json(cost: CostModel, key: dict) -> dict:
    return {"key": key, "verify_ms": {str(n): t for n, t in cost.verify_ms.items()},
            "draft_root_ms": cost.draft_root_ms, "draft_level_ms": cost.draft_level_ms, "other_ms": cost.other_ms,
            "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


def from_json(data: dict) -> CostModel:
    return CostModel(verify_ms={int(n): t for n, t in data["verify_ms"].items()},
                     draft_root_ms=data["draft_root_ms"], draft_level_ms=data["draft_level_ms"],
                     other_ms=data["other_ms"])


def load_or_measure(target, drafter, *, refresh: bool = False, progress: bool = True) -> tuple[CostModel, Path]:
    """The cached CostModel for this set-up, measuring (and caching) it when missing or stale."""
    key = cost_key(target, drafter.head, drafter.cfg.top_k)
    path = cache_path(key)
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return from_json(data), path
        except (OSError, json.JSONDecodeError, KeyError, ValueError):
            pass  # unreadable or stale: measure again
    cost = measure(target, drafter, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(to_json(cost, key), indent=1))
    tmp.replace(path)
    return cost, path


def add_parser(sub) -> None:
    from ddspec.cli import add_model_args, add_tree_args

    p = sub.add_parser("calibrate", help="measure step costs for the cost-aware policy (cached)",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached entry exists")
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from ddspec.commands import DTYPES, setup_torch, tree_from_args
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.methods import resolve_head, tree_config
    from ddspec.models.loading import load_target

    tree = tree_from_args(args)
    setup_torch(args)
    target = load_target(args.model, impl=args.impl, device=args.device, dtype=DTYPES[args.dtype])
    drafter = EagleDrafter(resolve_head(args.head, target), target, tree_config("eagle2", tree))
    cost, path = load_or_measure(target, drafter, refresh=args.refresh)
    print(f"cost model for {target.info.name} ({path}):")
    print("  verify ms by N: " + ", ".join(f"{n}: {t:.1f}" for n, t in sorted(cost.verify_ms.items())))
    print(f"  draft: root {cost.draft_root_ms:.2f} ms, each further level {cost.draft_level_ms:.2f} ms "
          f"(top_k {tree.top_k}); other per step {cost.other_ms:.2f} ms")
    return 0
