"""How closely the native forward of each family follows transformers', as a table.

For every native family a tiny random model is built with transformers' own class (6 layers,
hidden 64, an 8-token sliding window where the family has windows; a prompt of 40 tokens, so
the windowed layers' masks matter), and the largest absolute logit difference is measured:

- ``C fp32``: ddspec's C kernels, fp32 activations, against transformers' own forward;
- ``torch fp32``: ddspec's torch path (``DDSPEC_KERNEL=linear``) against the same;
- ``tree``: the native forward of a 14-node tree after 20 tokens against each of its paths
  decoded alone (the C kernels: 0 means bit for bit).

The 8-bit activation mode has no transformers counterpart: tests/test_families.py runs each
family's Q8_0 GGUF in it against the fp32 mode on the same blocks, and every method against plain
decoding in it.

Run: ``python -m ddspec.bench.parity [--out parity.md]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

from ddspec.machine import core_count, cpu_name

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
WINDOWED = ("mistral", "gemma2", "gemma3", "phi3")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def family_row(family: str, root: Path) -> dict[str, float]:
    from ddspec.models.loading import load_target
    from ddspec.models.tiny import make_tiny_model_dir

    folder = make_tiny_model_dir(root / family, family, seed=1, layers=6, max_position=256,
                                 sliding_window=8 if family in WINDOWED else None)
    tokens = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    hf = load_target(str(folder), impl="hf")
    with torch.no_grad():
        ref = hf.model(input_ids=tokens.view(1, -1)).logits[0]
    row: dict[str, float] = {}
    for name, kernel in (("C fp32", "native"), ("torch fp32", "linear")):
        os.environ["DDSPEC_KERNEL"] = kernel
        try:
            target = load_target(str(folder), impl="native")
        finally:
            os.environ.pop("DDSPEC_KERNEL", None)
        target.reset(128)
        row[name] = _max_diff(target.forward(tokens, torch.arange(40)).logits, ref)
    row["tree"] = _tree_diff(target)
    return row


def _tree_diff(target) -> float:
    gen = torch.Generator().manual_seed(7)
    n, prefix = 14, 20
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    depths = [0] * n
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            depths[i] = depths[parents[i]] + 1
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    tokens = torch.randint(0, 128, (n,), generator=gen)
    target.reset(128)
    target.forward(torch.arange(prefix) % 128, torch.arange(prefix))
    target.commit(torch.arange(prefix))
    tree = target.forward(tokens, prefix + torch.tensor(depths), mask).logits
    worst = 0.0
    for leaf in set(range(n)) - set(parents):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        target.truncate(prefix)
        seq = target.forward(tokens[path], prefix + torch.arange(len(path))).logits
        worst = max(worst, _max_diff(seq, tree[path]))
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    lines = [f"# Native forward against transformers, per family ({date.today()}, {cpu_name()}, {core_count()} cores)",
             "", "Largest absolute logit difference over a 40-token prompt (6 layers, hidden 64; 8-token windows "
             "where the family has them); tree: a 14-node tree's rows against their paths decoded alone.", "",
             "| family | C kernels fp32 vs transformers | torch path fp32 vs transformers | tree vs its paths |",
             "|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            r = family_row(family, Path(tmp))
            cells = [f"{r[k]:.1e}" for k in ("C fp32", "torch fp32", "tree")]
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
