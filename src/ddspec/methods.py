"""Decoding methods by name, and how each becomes a drafter.

| method  | tree                                   | depth                          |
|---------|----------------------------------------|--------------------------------|
| vanilla | none: plain autoregressive decoding    |                                |
| chain   | one token per level (greedy draft)     | fixed (``depth``)              |
| eagle   | static tree of index paths (EAGLE-1)   | the shape's own                |
| eagle2  | dynamic top-k tree, reranked (EAGLE-2) | fixed (``depth``)              |
| ddd     | dynamic top-k tree, reranked           | Dynamic Depth Decoding checks  |
| ddspec  | dynamic top-k tree, size by cost       | cost-aware (tree/cost.py)      |
| lookup  | chain copied from an earlier occurrence of the context's last tokens (no head) | up to ``depth`` (default 3; 6 after a 3-token match) |

A tree method may carry its own sizes, written ``METHOD@d<depth>k<top_k>n<total_tokens>``
(any subset, in that order): ``eagle2@d3k4n8`` is a fixed-depth EAGLE-2 tree of depth 3,
top_k 4 and 8 verified tokens, which is how ``ddspec tune`` names its best static setting and
how ``ddspec bench`` runs it next to the others. A last ``t<T>`` sets the greedy draft
temperature (``--draft-temperature``): ``eagle2@t1`` is EAGLE-2 on the raw head's scores. A last
``c<N>`` sets ``--context-vocab``: ``eagle2@c0`` drafts from the head's own vocabulary alone. A
last ``g0`` turns the n-gram table of the target's own answers off (``--ngram-table none``):
``lookup@g0`` is prompt lookup on the context alone.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

from ddspec.config import TreeConfig
from ddspec.errors import ConfigError, DdspecError

METHODS = ("vanilla", "chain", "eagle", "eagle2", "ddd", "ddspec", "lookup")
HEADLESS = ("vanilla", "lookup")  # the methods that need no draft head
SHAPES = {"chain": "chain", "eagle": "static", "eagle2": "dynamic", "ddd": "dynamic", "ddspec": "dynamic",
          "lookup": "chain"}
POLICIES = {"ddd": "ddd", "ddspec": "cost"}
HEADS_DIR = Path(__file__).parent / "heads"
DRAFT_MODEL_METHOD = "chain"  # what --method auto runs with --draft-model and no head
# the heads shipped with ddspec, by target name
SHIPPED_HEADS = {"SmolLM2-135M-Instruct": HEADS_DIR / "smollm2-135m-instruct",
                 "Qwen2.5-Coder-0.5B-Instruct": HEADS_DIR / "qwen2.5-coder-0.5b-instruct",
                 "Qwen2.5-Coder-1.5B-Instruct": HEADS_DIR / "qwen2.5-coder-1.5b-instruct"}


_SIZED = re.compile(r"(?:d(?P<depth>\d+))?(?:k(?P<top_k>\d+))?(?:n(?P<total_tokens>\d+))?"
                    r"(?:t(?P<draft_temperature>\d+(?:\.\d+)?))?(?:c(?P<context_vocab>\d+))?(?:g(?P<ngram_table>[01]))?"
                    r"(?P<draft_model>m)?")


def split_method(spec: str) -> tuple[str, dict[str, int | float]]:
    """``'eagle2@d3k4n8'`` -> ``('eagle2', {'depth': 3, 'top_k': 4, 'total_tokens': 8})``; ``'ddd'`` -> ``('ddd', {})``;
    ``'eagle2@t0.8'`` -> ``('eagle2', {'draft_temperature': 0.8})``; ``'lookup@g0'`` -> ``('lookup', {'ngram_table': 'none'})``."""
    method, _, sizes = spec.partition("@")
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if not _:
        return method, {}
    m = _SIZED.fullmatch(sizes)
    if method == "vanilla" or not sizes or m is None:
        raise ConfigError(f"bad method {spec!r}: sizes go after a tree method as @d<depth>k<top_k>n<total_tokens>"
                          "t<draft temperature>c<context vocab>g<0|1: n-gram table>m<draft with --draft-model>, any of "
                          "them in that order, e.g. eagle2@d3k4n8, eagle2@t1, eagle2@c0, lookup@g0 or chain@d4m")
    sizes = {k: float(v) if k == "draft_temperature" else int(v)
             for k, v in m.groupdict().items() if v is not None and k not in ("ngram_table", "draft_model")}
    if m["ngram_table"] == "0":
        sizes["ngram_table"] = "none"
    if m["draft_model"]:
        if method in HEADLESS or method == "eagle":
            raise ConfigError(f"bad method {spec!r}: m (draft with --draft-model) goes after chain, eagle2 or ddd")
        sizes["draft_model"] = True
    return method, sizes


def method_label(method: str, cfg: TreeConfig) -> str:
    """The ``METHOD@dXkYnZ`` name of a method with the sizes of ``cfg``."""
    return f"{method}@d{cfg.depth}k{cfg.top_k}n{cfg.total_tokens}"


def tree_config(method: str, base: TreeConfig = TreeConfig()) -> TreeConfig | None:
    """The TreeConfig of a method (None for vanilla), keeping the sizes set in ``base``
    unless the name carries its own (``eagle2@d3k4n8``)."""
    method, sizes = split_method(method)
    if method == "vanilla":
        return None
    if sizes.pop("draft_model", False) and base.draft_model is None:
        raise ConfigError(f"method {method}@...m drafts with a draft model: give it with --draft-model FILE")
    return replace(base, shape=SHAPES[method], depth_policy=POLICIES.get(method, "fixed"), **sizes)


def uses_draft_model(method: str, target, head_spec, tree: TreeConfig) -> bool:
    """Whether ``method`` drafts with --draft-model (``tree.draft_model``) rather than a head: when its
    name asks for it (``chain@d4m``), or when there is a draft model and no head (none given, none
    shipped for the target)."""
    name, sizes = split_method(method)
    if tree.draft_model is None or name in HEADLESS:
        return False
    return bool(sizes.get("draft_model")) or (head_spec is None and shipped_head(target.info) is None)


def name_key(name: str) -> str:
    """A model name for matching: lower case, letters and digits only ("Qwen2.5 Coder 0.5B Instruct AWQ"
    -> "qwen25coder05binstructawq")."""
    return "".join(c for c in name.lower() if c.isalnum())


def shipped_head(info) -> Path | None:
    """The head ddspec ships for a target (its ModelInfo), or None: found by the target's name, or by
    its published name (a GGUF's general.name, a config's _name_or_path, the folder's name) or its
    file's name starting with a shipped head's model name, so that any quantisation of that model
    finds it ("Qwen2.5 Coder 0.5B Instruct AWQ" -> the Qwen2.5-Coder-0.5B-Instruct head). Loading it
    checks the shapes."""
    folder = SHIPPED_HEADS.get(info.name)
    if folder is None:  # the published name, else the file's or folder's name ("SmolLM2-135M-Instruct.Q4_1.gguf")
        keys = [name_key(Path(n).name) for n in (info.published, info.name) if n]
        folder = next((f for k in keys for model, f in SHIPPED_HEADS.items() if k.startswith(name_key(model))), None)
    return folder if folder is not None and (folder / "config.json").is_file() else None


def resolve_head(spec: str | None, target):
    """Load the head named by --head: a folder, 'random[:SEED]' (tests), or the shipped one."""
    from ddspec.draft.checkpoint import load_head, random_head

    if spec is not None and spec.startswith("random"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        return random_head(target.hf_config, seed=seed).to(target.device, target.dtype).eval().requires_grad_(False)
    folder = Path(spec) if spec else shipped_head(target.info)
    if folder is None:
        raise DdspecError(
            f"no draft head for {target.info.name}: pass --head FOLDER (an EAGLE-1/2 or EAGLE-3 head; "
            "`ddspec train` makes one), or decode without a draft (method vanilla)"
        )
    return load_head(folder, target.info, target.device, target.dtype)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def make_drafter(method: str, target, head, base: TreeConfig = TreeConfig(), notify=_to_stderr,
                 shared: dict | None = None):
    """The drafter for a method, or None for vanilla. ``head``: a loaded EagleHead or Eagle3Head, or a --head spec.
    ``notify(line)``: how the ddspec method's notices reach the user (default: stderr at once).
    ``shared``: one dict for every drafter of this head on this model's sessions (a server's slots):
    the head's kernel-planned weights are built once for all of them (eagle.drafting_parts)."""
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.draft.eagle3 import Eagle3Head
    from ddspec.draft.head import EagleHead

    cfg = tree_config(method, base)
    if cfg is None:
        return None
    name, sizes = split_method(method)
    if name == "lookup":
        from ddspec.draft.lookup import DEPTH, LookupDrafter
        from ddspec.draft.ngram_table import resolve_table

        depth = sizes.get("depth")  # lookup@d<depth>: that length for every chain
        return LookupDrafter(depth or DEPTH, max_position=target.info.max_position, copy_depth=depth,
                             table=resolve_table(cfg.ngram_table, target))
    if uses_draft_model(method, target, head, base):  # a smaller model of the same tokenizer drafts
        from ddspec.draft.model import DraftModelDrafter, load_draft_model

        return DraftModelDrafter(load_draft_model(cfg.draft_model, target), target, cfg)
    if not isinstance(head, (EagleHead, Eagle3Head)):
        head = resolve_head(head, target)
    if cfg.depth_policy != "cost":
        return EagleDrafter(head, target, cfg, shared=shared)
    return cost_aware_drafter(head, target, cfg, notify, shared)


def cost_aware_drafter(head, target, cfg: TreeConfig, notify=_to_stderr, shared: dict | None = None):
    """The ddspec method: an EAGLE-2 drafter whose depth and size follow measured costs.

    The costs come from the calibration cache (measured on first use); the policy corrects them
    from the step times it observes and, when they disagree persistently with the cached entry,
    writes what it learned back to the cache at once (unless other programs took more than
    BUSY_SHARE of the CPU meanwhile) and passes a one-line notice to ``notify``
    (default: stderr at once; the CLI holds it until the answer has been written)."""
    from ddspec.calibrate import Measurement, load_or_measure
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.machine import OtherLoad
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy

    shared = {} if shared is None else shared  # the probe's kernel-planned weights serve the drafter too
    probe = EagleDrafter(head, target, replace(cfg, depth_policy="fixed"), shared=shared)
    calibration, store = load_or_measure(target, probe)

    others = OtherLoad()

    def persist(learned, why: str) -> None:
        # costs learned while other programs took the CPU describe that moment, not this machine:
        # keep them for this run only (the calibration's own rule: it measures again when noisy)
        share = others.too_busy()
        if share is not None:
            notify(f"ddspec: the measured step costs differ from the cached calibration ({why}), but other "
                   f"programs used {share:.0%} of the CPU meanwhile: not saved ({store.path} unchanged)")
            return
        if store.write(Measurement(learned, spread=0.0, source="learned")):
            notify(f"ddspec: the measured step costs differ from the cached calibration ({why}); updated {store.path}")

    policy = CostAwarePolicy(calibration.cost, AcceptanceModel(), max_depth=cfg.max_depth,
                             max_tokens=cfg.total_tokens, persist=persist)
    remember_policy(policy, store, others, calibration.measured)
    from ddspec.draft.lookup import LookupDrafter
    from ddspec.draft.ngram_table import resolve_table

    # free drafts for its plain steps: a match on the context's last 3 or 2 tokens, then the n-gram
    # table of the target's answers, then a match on the last token alone; the policy verifies as
    # many of a continuation's tokens as pay for their order (CostAwarePolicy.chain_length; a table
    # match's order is TABLE_ORDER + n)
    lookup = LookupDrafter(min_ngram=1, max_position=target.info.max_position,
                           table=resolve_table(cfg.ngram_table, target))
    return EagleDrafter(head, target, cfg, cost_policy=policy, lookup=lookup, shared=shared)


def remember_policy(policy, store, others, calibrated: str) -> None:
    """Start ``policy`` from what earlier runs with this set-up learned (calibrate.PolicyMemory),
    and save what it learns: every ``SAVE_EVERY`` steps and when the process exits, unless other
    programs took more than a quarter of the CPU since it was made (the rates it learnt then
    describe that moment, as for the costs). The learned cost corrections are taken up only while
    the calibration they corrected (its ``measured`` stamp, ``calibrated``) is still the cached one:
    after ``ddspec calibrate --refresh``, or a cache entry rewritten with learned costs, the new
    entry counts."""
    import atexit

    from ddspec.calibrate import PolicyMemory

    if not PolicyMemory.enabled():
        return
    memory = PolicyMemory(store)
    data = memory.read()
    if data is not None:
        try:
            policy.restore(data, costs=data.get("calibrated") == calibrated)
        except (KeyError, TypeError, ValueError):
            policy.forget_memory()  # an older layout, maybe half taken up: start afresh (it is rewritten below)

    def save(snapshot: dict) -> None:
        if others.too_busy() is None:
            memory.write({**snapshot, "calibrated": calibrated})

    policy.remember = save
    atexit.register(lambda: policy.steps_seen and save(policy.snapshot()))


def default_method(target, head_spec: str | None, draft_model: str | None = None) -> str:
    """What --method auto runs: ``ddspec`` when there is a draft head (given, or shipped for this
    target), ``lookup`` (prompt lookup, no head) otherwise.

    Why ddspec (docs/cost_policy.md, `ddspec bench` of 2026-11-30 on our 2-core CPU): it was the
    fastest method on MT-bench, HumanEval and GSM8K, ahead of plain decoding, of the best static
    tree found by `ddspec tune`, and far ahead of EAGLE-2 and DDD with the paper's 60-token trees,
    which a CPU cannot verify cheaply. It measures this machine's costs on first use (cached).
    Without a head, lookup: lossless like every method, its drafts cost a dict lookup and a step
    without a match is a plain step (`ddspec bench` of 2026-12-01 19:44, AMD EPYC: 1.16x plain
    decoding over 60 first turns; 1.08-1.23x by file).
    """
    if head_spec is not None or shipped_head(target.info) is not None:
        return "ddspec"
    if draft_model is not None:  # --draft-model without a head: its trees (sizes: TreeConfig's, or METHOD@...)
        return DRAFT_MODEL_METHOD
    return "lookup"
