"""The README.md shipped beside an exported head: data, sizes, steps, wall times, measured τ."""

from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ttt_lines(meta: dict) -> list[str]:
    """Training-time test and held-out selection, when the run used them."""
    lines = []
    passes = (meta.get("settings") or {}).get("ttt_passes", 1) if isinstance(meta.get("settings"), dict) else 1
    if passes > 1:
        accs = ", ".join(f"{meta[k]:.3f}" for k in ["acc"] + [f"acc{k}" for k in range(2, passes + 1)] if k in meta)
        lines.append(f"- training-time test: {passes} passes (draft depths 1-{passes} trained on the head's own "
                     f"predicted features); final training top-1 per depth: {accs}")
    best = meta.get("best_val")
    if best:
        accs = ", ".join(f"{v:.3f}" for k, v in sorted(best.items()) if k.startswith("val_acc"))
        lines.append(f"- kept: the head of step {best['step']}, the best on the held-out sequences "
                     f"(top-1 at draft depth 1, 2, ...: {accs})")
    return lines


def _temperature_lines(fit: dict | None) -> list[str]:
    """The greedy draft temperature (`ddspec train calibrate`), when the head has one."""
    if not fit:
        return []
    nll = fit.get("nll", {})
    best = min(nll.values()) if nll else float("nan")
    return [f"- greedy draft temperature: **{fit['greedy']}** (`ddspec.draft_temperature` in config.json; greedy "
            "decoding scores tree nodes with log_softmax(logits / T), sampling with T = 1), fitted on "
            f"{fit.get('fitted_on', '?')}: {fit.get('tokens', '?')} tokens, draft depths 1-{fit.get('depths', '?')}; NLL of "
            f"the target's argmax {nll.get('1.0', float('nan')):.4f} at T = 1, {best:.4f} at the best grid point"]


def _stage_time(name: str, entry: dict, manifest: dict) -> str:
    """A stage's wall time; a resumed data stage records only its last run, the manifest all shards."""
    run_min = entry.get("wall_s", 0) / 60
    total_min = manifest.get("wall_s", 0) / 60 if name == "data" else 0
    if total_min > run_min + 0.05:
        return f"{total_min:.1f} min of generation over all runs (the last run: {run_min:.1f} min)"
    return f"{run_min:.1f} min"


def model_title(info) -> str:
    """The model's name for a card: its name, or where that is a file path, its published name."""
    name = info.name
    if ("/" in name or name.endswith(".gguf")) and info.published:
        return info.published
    return Path(name).name if "/" in name else name


def write_model_card(dest: Path, run: Path, target) -> Path:
    stages, evals = _load(run / "stages.json"), _load(run / "eval.json")
    manifest = _load(run / "data" / "manifest.json")
    meta = _load(dest / "config.json").get("ddspec", {}).get("training", {})
    size_mb = sum(f.stat().st_size for f in dest.glob("*.safetensors")) / 1e6
    fused = _load(dest / "config.json").get("fuse_layers") or []
    fuse_flag = f" --fuse-layers {','.join(map(str, fused))}" if fused else ""
    depth = int(_load(dest / "config.json").get("num_hidden_layers", 1))
    if depth > 1:
        fuse_flag += f" --head-layers {depth}"
    lines = [
        f"# EAGLE-1/2 draft head for {model_title(target.info)}",
        "",
        "Trained with `ddspec train` (self-distillation: the target's own greedy answers).",
        "Layout: EAGLE-1/2 (`config.json` + `model.safetensors`, fp16); loads in ddspec and in",
        "engines that read EAGLE-1/2 heads. `d2t`, when present, is ddspec's reduced draft vocabulary.",
        *([f"Fused features: the head also reads the target's residual stream at the inputs of layers {fused}",
           "(`fuse_layers` in config.json, tensor `fuse.weight`); this is ddspec's extension, which plain",
           "EAGLE-1/2 loaders do not know."] if fused else []),
        *([f"Depth: {depth} decoder layers (`num_hidden_layers`; `layers.0` .. `layers.{depth - 1}`, every layer after",
           "the first with an `input_layernorm`, as the EAGLE repository's draft model builds them)."]
          if depth > 1 else []),
        "",
        "## Data",
        f"- prompts: {manifest.get('prompts', 'the training prompts shipped with ddspec')}, GSM8K and code capped "
        "at 1500 each, sources interleaved",
        f"- sequences: {manifest.get('sequences', '?')}, response tokens: {manifest.get('response_tokens', '?')}",
        f"- generation settings: {json.dumps(manifest.get('settings', {}))}",
        "",
        "## Training",
        f"- steps: {meta.get('steps', '?')}; final loss {meta.get('loss', float('nan')):.3f}, "
        f"top-1 draft accuracy {meta.get('acc', float('nan')):.3f} (mean of the last 50 steps)",
        f"- settings: {meta.get('settings', '?')}",
        *_ttt_lines(meta),
        *([f"- warm start: from the weights of `{meta['init_from']}` (an earlier head), not from random ones"]
          if meta.get("init_from") else []),
        f"- head size on disk: {size_mb:.1f} MB",
        *_temperature_lines(_load(dest / "config.json").get("ddspec", {}).get("draft_temperature")),
        "",
        "## Wall time per stage (this machine)",
        "",
        "| stage | wall time |",
        "|---|---|",
    ]
    if "data" not in stages and manifest.get("wall_s"):  # an interrupted data stage: the shards' own times
        lines.append(f"| data (generation of the shards kept) | {manifest['wall_s'] / 60:.1f} min |")
    for name, entry in stages.items():
        lines.append(f"| {name} | {_stage_time(name, entry, manifest)} |")
    lines += ["", "## Measured (greedy, EAGLE-2 tree: top_k 10, depth 6, total_tokens 60)", ""]
    lines += ["| variant | eval set | prompts | τ | per-depth acceptance | draft ms/step | identical to plain |",
              "|---|---|---|---|---|---|---|"]
    for variant, sets in evals.items():
        for name, r in sets.items():
            acc = ", ".join(f"{x:.2f}" for x in r["depth_acceptance"][:8])
            lines.append(f"| {variant} | {name} | {r['prompts']} | {r['tau']:.3f} | {acc} | "
                         f"{r['draft_ms_per_step']:.1f} | {r['identical_to_plain']} |")
    lines += ["", "## Reproduce", "", "```", f"ddspec train all --out {run}{fuse_flag}  # then: ddspec train export --to {dest}", "```", ""]
    path = dest / "README.md"
    path.write_text("\n".join(lines))
    return path
