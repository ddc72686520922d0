"""`ddspec tune`: grid-search the best static tree setting on a tuning prompt set.

The strongest rival of any depth heuristic is a grid search (docs/design.md §2.3: an independent
reproduction found a tuned static depth and size as fast as DDD). For every (depth, top_k,
total_tokens) in the grid it decodes the tuning prompts greedily with a fixed-depth EAGLE-2
tree, and reports tokens/s (total tokens / total time), τ and the speedup over plain decoding
measured in the same run (plain decoding is re-measured every ``--vanilla-every`` settings, and
each setting is compared with the latest measurement). Tune on prompts *other* than those you
benchmark on.

Results go to OUT/tune.jsonl (one line per setting, so an interrupted run resumes) and
OUT/tune.md (sorted table, best first).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from ddspec.errors import DdspecError


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_parser(sub) -> None:
    from ddspec.args import add_model_args, add_tree_args

    p = sub.add_parser("tune", help="grid-search the best static tree (depth, top_k, total_tokens)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", action="append", default=None, help="tuning prompts: a JSONL file or shipped sets (mt-bench, humaneval, gsm8k); repeatable. "
                        "Tune on prompts other than those you measure on")
    p.add_argument("--limit", type=int, default=10, help="first K prompts of each file (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--depths", type=_ints, default=(2, 3, 4, 6), help="comma-separated (default 2,3,4,6)")
    p.add_argument("--top-ks", type=_ints, default=(1, 2, 4, 8), help="comma-separated (default 1,2,4,8)")
    p.add_argument("--sizes", type=_ints, default=(4, 8, 16, 32),
                   help="total_tokens values, comma-separated (default 4,8,16,32)")
    p.add_argument("--vanilla-every", type=int, default=4, metavar="K",
                   help="re-measure plain decoding before every K-th setting (default 4; 1 = next to each)")
    p.add_argument("--out", required=True, help="results folder (resumes when it exists)")
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(handler=run)


def grid(depths, top_ks, sizes) -> list[tuple[int, int, int]]:
    """Settings worth running: a chain (top_k 1) only needs total_tokens = depth + 1."""
    out = []
    for d in depths:
        for k in top_ks:
            for n in sizes:
                size = d + 1 if k == 1 else n
                if size > 1 + d * k * k or (d, k, size) in out:
                    continue
                out.append((d, k, size))
    return out


def run(args: argparse.Namespace) -> int:
    from ddspec.bench.prompts import load_prompts
    from ddspec.args import setup_torch, target_from_args, tree_from_args
    from ddspec.config import StopConfig
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.engine import Engine
    from ddspec.methods import resolve_head, tree_config
    from ddspec.prompts import chat_prompt_ids

    base = tree_from_args(args)
    prompts = load_prompts(args.prompts, args.limit)
    setup_torch(args)
    target = target_from_args(args)
    head = resolve_head(args.head, target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "tune.jsonl"
    done = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[tuple(row["setting"])] = row
    stop = StopConfig(max_new_tokens=args.max_new_tokens)
    ids = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    settings = grid(args.depths, args.top_ks, args.sizes)
    if not settings:
        raise DdspecError("the grid is empty: check --depths, --top-ks and --sizes")

    def timed(engine) -> tuple[int, float, list]:
        tokens, wall, steps = 0, 0.0, []
        for x in ids:
            t = time.perf_counter()
            res = engine.generate(x, stop)
            wall += time.perf_counter() - t
            tokens += res.stats.new_tokens
            steps += res.stats.steps
        return tokens, wall, steps

    Engine(target).generate(ids[0], StopConfig(max_new_tokens=8))  # warm-up
    if args.vanilla_every < 1:
        raise DdspecError(f"--vanilla-every must be >= 1, got {args.vanilla_every}")
    todo = [s for s in settings if s not in done]
    with tqdm(total=len(settings), initial=len(settings) - len(todo), desc="tuning", unit="setting",
              file=sys.stderr, disable=None) as bar:
        for i, setting in enumerate(todo):
            d, k, n = setting
            cfg = replace(tree_config("eagle2", base), depth=d, top_k=k, total_tokens=n)
            if i % args.vanilla_every == 0:  # plain decoding, re-measured as the run goes
                v_tokens, v_wall, _ = timed(Engine(target))
            tokens, wall, steps = timed(Engine(target, EagleDrafter(head, target, cfg)))
            row = {"setting": [d, k, n], "tokens_per_s": tokens / wall, "vanilla_tokens_per_s": v_tokens / v_wall,
                   "speedup": (tokens / wall) / (v_tokens / v_wall),
                   "tau": sum(s.accepted + 1 for s in steps) / max(1, len(steps))}
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            done[setting] = row
            bar.update(1)
            bar.set_postfix(best=f"{max(r['speedup'] for r in done.values()):.2f}x")
    rows = sorted(done.values(), key=lambda r: -r["speedup"])
    lines = [f"# ddspec tune: {target.info.name}, {len(prompts)} prompts x {args.max_new_tokens} tokens", "",
             "| depth | top_k | total_tokens | tokens/s | speedup vs vanilla | τ |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['setting'][0]} | {r['setting'][1]} | {r['setting'][2]} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['tau']:.2f} |" for r in rows]
    (out / "tune.md").write_text("\n".join(lines) + "\n")
    best = rows[0]
    print("\n".join(lines[:8]))
    d, k, n = best["setting"]
    print(f"best: --depth {d} --tree-top-k {k} --total-tokens {n} ({best['speedup']:.2f}x); "
          f"in ddspec bench: --methods vanilla,eagle2@d{d}k{k}n{n},...")
    return 0
