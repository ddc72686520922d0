"""`ddspec tune`: grid, results files, resume."""

from __future__ import annotations

import json

from ddspec.cli import main
from ddspec.tune import grid


def test_grid_skips_impossible_and_duplicate_chains():
    g = grid((2, 3), (1, 4), (4, 64))
    assert (2, 1, 3) in g and (3, 1, 4) in g  # chains: total = depth + 1, once each
    assert (2, 4, 4) in g and (2, 4, 64) not in g  # 64 > 1 + 2 * 16 nodes can exist
    assert len(g) == len(set(g))


def test_tune_writes_sorted_results_and_resumes(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "tune"
    args = ["tune", "--model", str(tiny_dirs["llama"]), "--head", "random", "--threads", "1", "--limit", "2",
            "--max-new-tokens", "8", "--depths", "1,2", "--top-ks", "1,2", "--sizes", "3", "--out", str(out)]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "tune.jsonl").read_text().splitlines()]
    assert len(rows) == len(grid((1, 2), (1, 2), (3,)))
    table = (out / "tune.md").read_text()
    speedups = [float(line.split("|")[5].strip().rstrip("x")) for line in table.splitlines()[4:]]
    assert speedups == sorted(speedups, reverse=True)
    assert "best: --depth" in capsys.readouterr().out
    assert main(args) == 0  # everything done: resumes without running again
    assert len((out / "tune.jsonl").read_text().splitlines()) == len(rows)
