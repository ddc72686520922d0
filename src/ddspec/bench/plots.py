"""PNG plots of a benchmark summary (matplotlib, Agg backend: no display needed).

- ``speedup_by_category.png``: speedup over ``vanilla`` per category (and overall), one bar
  per method;
- ``tau_histogram.png``: for each method with decoding steps, the share of steps that emitted
  1, 2, ... tokens, with τ in the title;
- ``time_split.png``: ms per generated token spent drafting, verifying and on everything else
  (prefill, bookkeeping), per method; HF arms show one undivided bar.
"""

from __future__ import annotations

from pathlib import Path

PLOT_FILES = ("speedup_by_category.png", "tau_histogram.png", "time_split.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summary: dict, path: Path) -> None:
    plt = _pyplot()
    groups = {**summary["by_category"], "overall": summary["overall"]}
    methods = [m for m in summary["overall"] if m != summary["baseline"]]
    fig, ax = plt.subplots(figsize=(min(20.0, max(6.0, 0.3 * len(groups) * max(len(methods), 1) + 2)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        values = [(groups[g].get(m) or {}).get("speedup") or 0.0 for g in groups]
        ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(groups))], values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right")
    ax.set_ylabel(f"speedup over {summary['baseline']} (x)")
    ax.set_title("Speedup by method and category")
    if methods:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax.text(0.5, 0.5, f"no method besides {summary['baseline']}", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tau(summary: dict, path: Path) -> None:
    plt = _pyplot()
    rows = {m: r for m, r in summary["overall"].items() if r["tau_histogram"] and m != summary["baseline"]}
    n = max(len(rows), 1)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3), squeeze=False, sharey=True)
    for ax, (m, row) in zip(axes[0], rows.items()):
        hist = {int(k): v for k, v in row["tau_histogram"].items()}
        steps = sum(hist.values())
        ax.bar(list(hist), [v / steps for v in hist.values()], color="tab:blue")
        ax.set_title(f"{m}: τ = {row['tau']:.2f}", fontsize="medium")
        ax.set_xlabel("tokens per step (accepted + 1)")
        ax.set_xticks(sorted(hist))
    axes[0][0].set_ylabel("share of steps")
    if not rows:
        axes[0][0].text(0.5, 0.5, "no speculative method in this run", ha="center", transform=axes[0][0].transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time_split(summary: dict, path: Path) -> None:
    plt = _pyplot()
    rows = {m: r["time_split_ms_per_token"] for m, r in summary["overall"].items()
            if r["time_split_ms_per_token"]["other"] is not None}
    fig, ax = plt.subplots(figsize=(7, 0.5 * max(len(rows), 1) + 1.5))
    names = list(rows)
    left = [0.0] * len(names)
    for part, color in (("draft", "tab:orange"), ("verify", "tab:blue"), ("other", "tab:gray")):
        values = [rows[m][part] or 0.0 for m in names]
        ax.barh(names, values, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token (HF arms: undivided, shown as other)")
    ax.set_title("Where the time goes")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out: Path, summary: dict) -> list[Path]:
    paths = [out / name for name in PLOT_FILES]
    for plot, path in zip((plot_speedup, plot_tau, plot_time_split), paths):
        plot(summary, path)
    return paths
