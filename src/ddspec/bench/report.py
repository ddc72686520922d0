"""Turning benchmark records into numbers and tables (docs/design.md §3), as pure functions.

A *record* is one dict per (prompt, turn, method), as written to ``records.jsonl`` by the
runner (see :mod:`ddspec.bench.runner` for the fields). Everything here works on lists of
such dicts and touches no model, so tests can call it on hand-built records.

Definitions used in every table:
- tokens/s = total new tokens / total wall time over the group's generations (wall time of
  one generation = median over repeats, prefill included);
- speedup = tokens/s of a method / tokens/s of the baseline (``vanilla``) over the same
  (prompt, turn) pairs of the same run, i.e. a ratio of totals, not a mean of ratios;
- τ = mean over all decoding steps of (accepted + 1); unknown (None) for arms that do not
  expose their steps (HF);
- losslessness k/n = of the n (prompt, turn) pairs both arms finished, k outputs equal the
  baseline's token for token (greedy runs only).
"""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from pathlib import Path

from ddspec.machine import core_count, cpu_name

BASELINE = "vanilla"
SPEEDUP_NOTE = (
    "speedup = (total new tokens / total wall time) of the method ÷ the same ratio for `vanilla`, "
    "over the same prompts and turns in this run; wall time per generation is the median over "
    "repeats and includes the prefill"
)

Record = dict


def record_key(record: Record) -> tuple:
    """What a generation answered: (prompt file, question id, turn)."""
    return (record["source"], record["question_id"], record["turn"])


def by_method(records: list[Record]) -> dict[str, list[Record]]:
    """Records grouped by method, methods in order of first appearance."""
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r["method"], []).append(r)
    return groups


def throughput(records: list[Record]) -> float | None:
    """Total new tokens / total wall time (None when there is no time)."""
    time = sum(r["wall_time"] for r in records)
    return sum(r["new_tokens"] for r in records) / time if time > 0 else None


def speedup(records: list[Record], baseline: list[Record]) -> float | None:
    """Throughput ratio over the (prompt, turn) pairs present in both lists."""
    common = {record_key(r) for r in records} & {record_key(r) for r in baseline}
    mine = throughput([r for r in records if record_key(r) in common])
    ref = throughput([r for r in baseline if record_key(r) in common])
    return mine / ref if mine is not None and ref else None


def tau(records: list[Record]) -> float | None:
    """Mean accepted length: tokens per decoding step, over every step of every record."""
    lengths = [a for r in records for a in r["accept_lengths"]]
    return sum(lengths) / len(lengths) if lengths else None


def tau_histogram(records: list[Record]) -> dict[int, int]:
    """How many steps emitted 1, 2, ... tokens."""
    hist: dict[int, int] = defaultdict(int)
    for r in records:
        for a in r["accept_lengths"]:
            hist[a] += 1
    return dict(sorted(hist.items()))


def depth_acceptance(records: list[Record]) -> list[float]:
    """P(accepted >= d | accepted >= d - 1) for d = 1, 2, ... over every step (accepted = τ-length - 1)."""
    accepted = [a - 1 for r in records for a in r["accept_lengths"]]
    rates, prev = [], len(accepted)
    for d in range(1, max(accepted, default=0) + 1):
        cur = sum(a >= d for a in accepted)
        rates.append(cur / prev)
        prev = cur
    return rates


def per_step_means(records: list[Record]) -> dict[str, float | None]:
    """Tree size and draft / verify ms per decoding step, weighted by each record's steps."""
    stepped = [r for r in records if r.get("decoding_steps")]
    steps = sum(r["decoding_steps"] for r in stepped)
    if not steps:
        return {"tree_size": None, "draft_ms": None, "verify_ms": None}
    return {
        "tree_size": sum(sum(r["tree_sizes"]) for r in stepped) / steps,
        "draft_ms": sum(r["draft_ms"] * r["decoding_steps"] for r in stepped) / steps,
        "verify_ms": sum(r["verify_ms"] * r["decoding_steps"] for r in stepped) / steps,
    }


def time_split(records: list[Record]) -> dict[str, float | None]:
    """ms per generated token spent drafting, verifying, and on everything else (prefill included).

    draft and verify are None for arms that do not report steps; "other" is then the whole time.
    """
    tokens = sum(r["new_tokens"] for r in records)
    if not tokens:
        return {"draft": None, "verify": None, "other": None}
    wall = sum(r["wall_time"] for r in records) * 1e3
    stepped = [r for r in records if r.get("decoding_steps")]
    if not stepped:
        return {"draft": None, "verify": None, "other": wall / tokens}
    draft = sum(r["draft_ms"] * r["decoding_steps"] for r in stepped)
    verify = sum(r["verify_ms"] * r["decoding_steps"] for r in stepped)
    return {"draft": draft / tokens, "verify": verify / tokens, "other": max(wall - draft - verify, 0.0) / tokens}


def forecast(records: list[Record]) -> dict[str, float] | None:
    """The cost-aware method's forecast against what its decoding steps measured: tokens/s over the
    decoding steps only (prefill excluded on both sides). None for methods that forecast nothing."""
    rs = [r for r in records if r.get("predicted_ms")]
    if not rs:
        return None
    steps_tokens = sum(sum(r["accept_lengths"]) for r in rs)
    return {"predicted_tokens_per_s": 1e3 * sum(r["predicted_tokens"] for r in rs) / sum(r["predicted_ms"] for r in rs),
            "measured_tokens_per_s": 1e3 * steps_tokens / sum(r["step_ms"] for r in rs)}


def losslessness(records: list[Record], baseline: list[Record]) -> tuple[int, int]:
    """(k, n): n pairs answered by both, k of them with identical output ids."""
    ref = {record_key(r): r["output_ids"] for r in baseline}
    pairs = [(r["output_ids"], ref[record_key(r)]) for r in records if record_key(r) in ref]
    return sum(mine == theirs for mine, theirs in pairs), len(pairs)


def decoding_rate(records: list[Record]) -> float | None:
    """Tokens/s of the decoding alone, prefill excluded: the tokens after the first over the decoding
    steps' time (llama.cpp's server: its own predicted tokens and milliseconds)."""
    rs = [r for r in records if r.get("decode_ms")]
    ms = sum(r["decode_ms"] for r in rs)
    return 1e3 * sum(r["decode_tokens"] for r in rs) / ms if ms else None


def method_metrics(records: list[Record], baseline: list[Record] | None, greedy: bool) -> dict:
    """Every number of one table row."""
    row = {
        "generations": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "wall_time": sum(r["wall_time"] for r in records),
        "tokens_per_s": throughput(records),
        "decode_tokens_per_s": decoding_rate(records),
        "speedup": speedup(records, baseline) if baseline else None,
        "tau": tau(records),
        "tau_histogram": tau_histogram(records),
        "depth_acceptance": depth_acceptance(records),
        **per_step_means(records),
        "time_split_ms_per_token": time_split(records),
        "forecast": forecast(records),
        "lossless": None,
    }
    if baseline and greedy:
        k, n = losslessness(records, baseline)
        row["lossless"] = {"equal": k, "compared": n}
    return row


def group_metrics(records: list[Record], greedy: bool, baseline: str = BASELINE) -> dict[str, dict]:
    """method -> metrics for one group of records (baseline first, compared with the same group's)."""
    methods = by_method(records)
    ref = methods.get(baseline)
    if ref is not None:
        methods = {baseline: ref, **methods}
    return {m: method_metrics(rs, ref, greedy) for m, rs in methods.items()}


def summarize(records: list[Record], greedy: bool, baseline: str = BASELINE) -> dict:
    """Overall, per prompt file and per category metrics."""
    def split(field: str) -> dict[str, dict]:
        groups: dict[str, list[Record]] = {}
        for r in records:
            groups.setdefault(str(r[field]), []).append(r)
        return {name: group_metrics(rs, greedy, baseline) for name, rs in groups.items()}

    return {
        "baseline": baseline,
        "greedy": greedy,
        "speedup_definition": SPEEDUP_NOTE,
        "overall": group_metrics(records, greedy, baseline),
        "by_source": split("source"),
        "by_category": split("category"),
        "by_turn": split("turn"),
    }


# -- rendering -------------------------------------------------------------------------------
def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{suffix}"


def _lossless_cell(row: dict, method: str, baseline: str, greedy: bool) -> str:
    if method == baseline:
        return "reference"
    if not greedy:
        return "n/a (sampling)"
    if row["lossless"] is None:
        return "—"
    cell = f"{row['lossless']['equal']}/{row['lossless']['compared']}"
    return cell + " (own Q weights)" if method == "llama.cpp" else cell


TABLE_HEAD = ("| method | gens | tokens | tokens/s | decoding tokens/s | speedup | τ | tree size | draft ms/step "
              "| verify ms/step | lossless |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def render_table(group: dict[str, dict], baseline: str, greedy: bool) -> str:
    lines = [TABLE_HEAD]
    for method, row in group.items():
        speed = "1.00x" if method == baseline and row["tokens_per_s"] else _num(row["speedup"], ".2f", "x")
        lines.append(
            f"| {method} | {row['generations']} | {row['new_tokens']} | {_num(row['tokens_per_s'], '.1f')} "
            f"| {_num(row.get('decode_tokens_per_s'), '.1f')} | {speed} | {_num(row['tau'], '.2f')} | {_num(row['tree_size'], '.1f')} "
            f"| {_num(row['draft_ms'], '.1f')} | {_num(row['verify_ms'], '.1f')} "
            f"| {_lossless_cell(row, method, baseline, greedy)} |"
        )
    return "\n".join(lines)


def render_matrix(groups: dict[str, dict], field: str, fmt: str, suffix: str = "") -> str:
    """A category x method table of one metric."""
    methods = list(dict.fromkeys(m for g in groups.values() for m in g))
    lines = ["| category | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for name, group in groups.items():
        cells = [_num(group[m][field], fmt, suffix) if m in group else "—" for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(summary: dict, meta: dict, interrupted: str | None = None) -> str:
    baseline, greedy = summary["baseline"], summary["greedy"]
    out = ["# ddspec bench", ""]
    if interrupted:
        out += [f"> **Interrupted run**: {interrupted}. The tables cover the generations that finished.", ""]
    out += ["```", meta["command"], "```", ""]
    out += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
    out += ["", f"Speedup: {SPEEDUP_NOTE}.",
            "τ: mean tokens per decoding step (accepted + 1); tree size: nodes verified per step, root included; "
            "draft/verify ms: means per step. HF arms do not expose their steps (—).",
            "Lossless: k/n greedy outputs equal to `vanilla`'s token for token (turns after the first use each "
            "method's own earlier answers, so one divergence can carry into the next turn; HF arms run "
            "transformers' own forward, whose fp32 rounding can flip a near-tie)." if greedy else
            "Lossless: not checked (sampling run; exact equality is only expected for greedy decoding).", ""]
    if baseline not in summary["overall"]:
        out += [f"No `{baseline}` arm in this run: speedups and losslessness are unavailable.", ""]
    out += ["## Overall", "", render_table(summary["overall"], baseline, greedy), ""]
    if len(summary["by_source"]) > 1:
        for name, group in summary["by_source"].items():
            out += [f"## {name}", "", render_table(group, baseline, greedy), ""]
    depth_rows = [(m, row["depth_acceptance"]) for m, row in summary["overall"].items() if row["depth_acceptance"]]
    if depth_rows:
        width = max(len(r) for _, r in depth_rows)
        out += ["## Acceptance by depth", "", "P(accepted >= d | accepted >= d-1), over every decoding step:", "",
                "| method | " + " | ".join(f"d={d}" for d in range(1, width + 1)) + " |",
                "|---|" + "---|" * width]
        out += [f"| {m} | " + " | ".join([f"{x:.2f}" for x in r] + ["—"] * (width - len(r))) + " |"
                for m, r in depth_rows]
        out += [""]
    forecasts = [(name, m, row["forecast"]) for name, group in [("all", summary["overall"])]
                 + sorted(summary["by_source"].items()) for m, row in group.items() if row.get("forecast")]
    if forecasts:
        out += ["## The cost model: forecast against measurement", "",
                "Tokens per second over decoding steps (prefill excluded): what the cost-aware method expected "
                "of the trees it chose, and what those steps took.", "",
                "| prompts | method | forecast tokens/s | measured tokens/s | measured / forecast |", "|---|---|---:|---:|---:|"]
        out += [f"| {name} | {m} | {f['predicted_tokens_per_s']:.1f} | {f['measured_tokens_per_s']:.1f} "
                f"| {f['measured_tokens_per_s'] / f['predicted_tokens_per_s']:.2f} |" for name, m, f in forecasts]
        out += [""]
    if len(summary.get("by_turn", {})) > 1:
        for name, group in summary["by_turn"].items():
            out += [f"## Turn {name}", "", render_table(group, baseline, greedy), ""]
    if summary["by_category"]:
        out += ["## By category", "", "Speedup:", "", render_matrix(summary["by_category"], "speedup", ".2f", "x"),
                "", "τ:", "", render_matrix(summary["by_category"], "tau", ".2f"), ""]
        for name, group in summary["by_category"].items():
            out += [f"### {name}", "", render_table(group, baseline, greedy), ""]
    return "\n".join(out)


def machine_info(threads: int, device: str) -> dict[str, str | int]:
    import torch
    import transformers

    cores = core_count()
    info: dict[str, str | int] = {"cpu": cpu_name(), "cores": cores or 0, "torch threads": threads,
                                  "torch": torch.__version__, "transformers": transformers.__version__,
                                  "python": platform.python_version(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if device == "cpu":
        info["native kernels"] = native_kernels_line()
    return info


def native_kernels_line() -> str:
    """Which C kernel builds ran (the CPU features they use, measured choices included)."""
    from ddspec import native

    if not native.available():
        return f"none ({native.unavailable_reason()})"
    parts = ["AVX2/FMA"]
    if native.vnni_flags():
        parts.append("VNNI")
    parts += [name for flag, name in (("-mgfni", "GFNI"), ("-mavx512vbmi", "VBMI")) if flag in native.wide_flags()]
    wide = native.wide_choice()
    if wide:
        parts.append("AVX-512 passes (groups per pass by rows 1-8: " + "; ".join(
            f"{kind} {','.join(map(str, groups))}" for kind, groups in wide.items()) + ", 0 = 8-lane)")
    ahead = native.prefetch_blocks()
    parts.append(f"L2 prefetch {ahead} blocks ahead from 3 rows" if ahead else "no L2 prefetch")
    if wide:
        parts.append("attention on " + ("16" if native.attention_wide() else "8") + " lanes")
    return ", ".join(parts) + f"; build {native.build_id()}"


def write_summary(out: Path, records: list[Record], meta: dict, greedy: bool,
                  interrupted: str | None = None) -> dict:
    """summary.md and summary.json in ``out``; returns the summary."""
    summary = summarize(records, greedy)
    (out / "summary.md").write_text(render_markdown(summary, meta, interrupted), encoding="utf-8")
    doc = {"meta": meta, "interrupted": interrupted, **summary}
    (out / "summary.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return summary
