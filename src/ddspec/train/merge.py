"""`ddspec train merge --out RUN --from OTHER`: train on another run's data too.

Data made in another run folder (new sampled passes made with ``--first-sampled-pass K``, say, or
data from an earlier run) joins RUN's: every shard of OTHER/data is added after RUN's own,
hard-linked where the file system allows (no second copy on disk), else copied, with its layer
states (``layers-*.pt``) when OTHER has them for the same layers. The appended shards are the
newest, so a later ``fit --val-sequences N`` holds out the last N of them.

Refused, with the reason: data of another target, EAGLE-3 states beside none (or other layers),
fused-layer states of other layers. Skipped, with a line each: shards merged before (a rerun adds
nothing) and greedy shards that answer the same prompt range RUN's greedy pass already answered
(the same text again). A shard file is in place before the manifest names it, so an interrupted
merge leaves RUN consistent and a rerun finishes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddspec.errors import DdspecError
from ddspec.fileio import place_file, write_json_atomic
from ddspec.train.layers import layer_state


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def merge_data(dst: Path, src: Path, log=print) -> dict:
    """Append the shards of data folder ``src`` to data folder ``dst`` (see the module doc)."""
    theirs = _read(src / "manifest.json")
    if theirs is None:
        raise DdspecError(f"no training data in {src} (no manifest.json): give --from a run folder that "
                          "`ddspec train data` has written to")
    if src.resolve() == dst.resolve():
        raise DdspecError(f"--from names this run's own data ({src})")
    mine = _read(dst / "manifest.json")
    if mine is None:
        raise DdspecError(f"no training data in {dst} yet: run `ddspec train data --out {dst.parent}` first "
                          f"(or use {src.parent} itself as the run folder)")
    if theirs["target"].rsplit(":", 1)[-1] != mine["target"].rsplit(":", 1)[-1]:  # config and weights, not the path
        raise DdspecError(f"{src} holds data from target {theirs['target']}, {dst} from {mine['target']}: "
                          "only data of the same target can be merged")
    cap_theirs = theirs["settings"].get("capture_layers", [])
    cap_mine = mine["settings"].get("capture_layers", [])
    if cap_theirs != cap_mine:
        raise DdspecError(f"{src} keeps the states of target layers {cap_theirs or 'none'} (EAGLE-3 data), {dst} "
                          f"{cap_mine or 'none'}: merge data made with the same --arch")
    their_layers, on_disk = _read(src / "layers.json"), _read(dst / "layers.json")
    layers = None if their_layers is None else tuple(their_layers["layers"])
    if layers and on_disk and on_disk["layers"] != list(layers):
        raise DdspecError(f"{src} holds the fused states of layers {list(layers)}, {dst} of {on_disk['layers']}: "
                          "only states of the same layers can be merged")
    mine_layers = layer_state(dst, layers, mine["target"]) if layers else None
    merged = {e["merged_from"] for e in mine["shards"].values() if "merged_from" in e}
    greedy_done = {(e["first"], e["prompts"]) for e in mine["shards"].values()
                   if not e.get("pass") and "merged_from" not in e and "first" in e}
    added = {"shards": 0, "sequences": 0, "response_tokens": 0, "skipped": 0}
    for key in sorted(theirs["shards"]):
        e = theirs["shards"][key]
        origin = f"{src.resolve()}:{key}"
        if origin in merged:
            added["skipped"] += 1
            continue
        if not e.get("pass") and (e.get("first"), e.get("prompts")) in greedy_done:
            log(f"skipped {src}/shard-{key}.pt: greedy answers to prompts {e['first']}-{e['first'] + e['prompts'] - 1}, "
                "which this run's greedy pass has answered already")
            added["skipped"] += 1
            continue
        new = f"{len(mine['shards']):05d}"
        place_file(src / f"shard-{key}.pt", dst / f"shard-{new}.pt")
        if layers and key in their_layers["shards"]:
            place_file(src / f"layers-{key}.pt", dst / f"layers-{new}.pt")
            mine_layers["shards"][new] = dict(their_layers["shards"][key])
            write_json_atomic(dst / "layers.json", mine_layers)
        mine["shards"][new] = dict(e, merged_from=origin)
        for field in ("sequences", "response_tokens"):
            mine[field] += e[field]
            added[field] += e[field]
        write_json_atomic(dst / "manifest.json", mine)
        added["shards"] += 1
        log(f"shard {new} <- {src}/shard-{key}.pt ({'sampled pass ' + str(e['pass']) if e.get('pass') else 'greedy'}, "
            f"{e['sequences']} sequences, {e['response_tokens']} response tokens)")
    return added
