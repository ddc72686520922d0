"""Running the `ddspec train` stages: set-up, logging, wall times, resumption."""

from __future__ import annotations

import argparse
import copy
from dataclasses import asdict, replace
import json
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ddspec.config import TreeConfig
from ddspec.datasets import eval_set
from ddspec.errors import DdspecError
from ddspec.fileio import write_json_atomic

EVAL_FILES = ("mt_bench", "humaneval", "gsm8k")
TINY_PROMPTS = [f"{verb} {thing}." for verb in ("Describe", "List facts about", "Write a poem on", "Explain")
                for thing in ("cats", "the sea", "numbers", "trees", "bread", "snow", "music", "stars")]


class StageLog:
    """OUT/<stage>.log with timestamps, and OUT/stages.json with each stage's wall time."""

    def __init__(self, out: Path, stage: str) -> None:
        self.out, self.stage = out, stage
        self.logger = logging.getLogger(f"ddspec.train.{stage}")
        self.logger.setLevel(logging.INFO)
        self.logger.handlers.clear()
        handler = logging.FileHandler(out / f"{stage}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        self.logger.addHandler(handler)
        self.t0 = time.perf_counter()

    def info(self, msg: str, echo: bool = True) -> None:
        self.logger.info(msg)
        if echo:
            print(f"[train {self.stage}] {msg}", file=sys.stderr, flush=True)

    def finish(self, **extra) -> None:
        path = self.out / "stages.json"
        stages = json.loads(path.read_text()) if path.is_file() else {}
        entry = stages.get(self.stage, {"wall_s": 0.0})
        entry["wall_s"] = entry.get("wall_s", 0.0) + time.perf_counter() - self.t0
        entry.update(extra, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
        stages[self.stage] = entry
        path.write_text(json.dumps(stages, indent=1))
        self.info(f"done in {time.perf_counter() - self.t0:.0f} s (this run)")


def _setup(args: argparse.Namespace):
    from ddspec.args import setup_torch, target_from_args

    setup_torch(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.tiny:
        from ddspec.models.tiny import make_tiny_model_dir

        family = getattr(args, "tiny_family", "llama")
        tiny = out / ("tiny_model" if family == "llama" else f"tiny_model-{family}")
        if not (tiny / "config.json").is_file():
            make_tiny_model_dir(tiny, family, seed=0, hidden=64, layers=6 if family == "gemma3" else 2,
                                max_position=1024, sliding_window=16)
        model = str(tiny)
    target = target_from_args(args, model=model, impl="native")
    return out, target


def stage_data(args, out: Path, target) -> None:
    from ddspec.train.data import PromptRecord, balanced_mix, read_prompts
    from ddspec.train.generate import GenerationSettings, run_generation

    log = StageLog(out, "data")
    capture = _capture_layers(args, target)
    fuse = _fuse_layers(args, target)
    if args.tiny:
        records = [PromptRecord(str(i), "tiny", t) for i, t in enumerate(TINY_PROMPTS)]
        budget = 600 * (1 + max(0, getattr(args, "sampled_answers", 0) or 0) + bool(getattr(args, "second_turns", 0)))
        settings = GenerationSettings(max_new_tokens=24, batch_size=8, shard_prompts=8, capture_layers=capture,
                                      fuse_layers=fuse)
    else:
        records, report = read_prompts(Path(args.prompts))
        log.info(f"prompts: {args.prompts}: {report.describe()}")
        records = balanced_mix(records)
        budget = args.response_tokens
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                      capture_layers=capture, fuse_layers=fuse)
    if capture:
        log.info(f"keeping the residual streams entering target layers {list(capture)} (EAGLE-3's inputs)")
    if fuse:
        log.info(f"keeping the fused head's states of layers {list(fuse)} (layers-*.pt: no `layers` stage needed "
                 "for these shards)")
    log.info(f"{len(records)} prompts after rebalancing; responses up to {settings.max_new_tokens} tokens; "
             f"budget {budget} response tokens")
    passes = _sampled_passes(args, records)
    greedy = getattr(args, "greedy_pass", True)
    second = getattr(args, "second_turns", 0) or 0
    if second < 0:
        raise DdspecError(f"--second-turns must be 0 or more, not {second}")
    if not greedy and not passes and not second:
        raise DdspecError("--no-greedy-pass leaves nothing to generate: add --sampled-answers N or --second-turns N")
    with tqdm(total=budget, desc="responses", unit="tok", file=sys.stderr, disable=None) as bar:
        def quiet(line: str) -> None:  # always in data.log; on the terminal too when no bar shows progress there
            log.info(line, echo=bool(bar.disable))

        manifest = (run_generation(target, records, out / "data", settings, budget, progress=bar, log=quiet)
                    if greedy else None)
        if second:
            manifest = _second_turns(args, target, records, out / "data", settings, budget, second, bar, quiet, log)
        for k, mix in passes:
            log.info(f"sampled pass {k}: {len(mix)} prompts at temperature {args.temperature}")
            manifest = run_generation(target, mix, out / "data", settings, budget, progress=bar, pass_id=k,
                                      temperature=args.temperature, log=quiet)
    log.info(f"{manifest['sequences']} sequences, {manifest['response_tokens']} response tokens, "
             f"{len(manifest['shards'])} shards, generation wall {manifest['wall_s']:.0f} s")
    log.finish(response_tokens=manifest["response_tokens"], sequences=manifest["sequences"])


def _second_turns(args, target, records, data_dir: Path, settings, budget: int, limit: int, bar, quiet, log) -> dict:
    """The greedy pass over second turns (``--second-turns N``): chats that follow up up to N greedy answers
    to the --sample-sources prompts with another of those prompts (train.generate.second_turn_records)."""
    from ddspec.train.generate import run_generation, second_turn_records

    sources, chat = _sample_source_records(args, records)
    if not (data_dir / "manifest.json").is_file():
        raise DdspecError(f"--second-turns follows up greedy answers, and {data_dir} has none yet: run the greedy "
                          "pass first (drop --no-greedy-pass)")
    follow = second_turn_records(data_dir, chat, target.tokenizer, limit)
    log.info(f"second turns: {len(follow)} greedy answers to {', '.join(sources)} prompts, each followed by another "
             f"of those prompts (chats over {settings.max_prompt_tokens} tokens are skipped)")
    manifest = run_generation(target, follow, data_dir, settings, budget, progress=bar, log=quiet, turn=2)
    if manifest["response_tokens"] >= budget:
        log.info(f"the response-token budget ({budget}) is used up: raise --response-tokens for more second turns")
    return manifest


def _fuse_layers(args, target) -> tuple[int, ...]:
    """--fuse-layers for the data stage: the layers whose states it keeps for a fused EAGLE-1/2 head."""
    from ddspec.train.layers import parse_layers

    spec = getattr(args, "fuse_layers", None)
    if not spec:
        return ()
    if getattr(args, "arch", "eagle") == "eagle3":
        raise DdspecError("--fuse-layers is for EAGLE-1/2 heads; an EAGLE-3 head (--arch eagle3) reads its own "
                          "captured layers: drop --fuse-layers")
    return parse_layers(spec, target.hf_config["num_hidden_layers"])


def _capture_layers(args, target) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (HF hidden_states indices), () for an EAGLE-1/2 head."""
    if getattr(args, "arch", "eagle") != "eagle3":
        return ()
    from ddspec.draft.eagle3 import default_capture_layers

    n = target.info.num_layers
    if n < 6:  # a tiny test target: three states from the layers it has (never the embeddings)
        return (1, max(1, n // 2), max(1, n - 1))
    return default_capture_layers(n)


def parse_sample_sources(spec: str | None, available: set[str]) -> dict[str, int | None]:
    """``"a,b:300"`` -> {"a": None, "b": 300}; None = every source but the capped math and code."""
    from ddspec.train.data import DEFAULT_CAPS

    if spec is None:
        return {s: None for s in sorted(available - set(DEFAULT_CAPS))}
    out: dict[str, int | None] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, cap = item.partition(":")
        if name not in available:
            raise DdspecError(f"--sample-sources: no prompts from source {name!r}; the prompt file has "
                              f"{', '.join(sorted(available))}")
        if cap and not (cap.isdigit() and int(cap) > 0):
            raise DdspecError(f"--sample-sources: bad cap {cap!r} for {name} (a positive whole number)")
        out[name] = int(cap) if cap else None
    if not out:
        raise DdspecError("--sample-sources is empty: name at least one source")
    return out


def _sample_source_records(args, records) -> tuple[dict[str, int | None], list]:
    """--sample-sources parsed ({source: cap or None}) and the records of those sources, in order."""
    sources = parse_sample_sources(getattr(args, "sample_sources", None), {r.source for r in records})
    return sources, [r for r in records if r.source in sources]


def _sampled_passes(args, records) -> list:
    """The prompt mix of each sampled pass (a different order per pass)."""
    from ddspec.train.data import balanced_mix

    n = getattr(args, "sampled_answers", 0) or 0
    if n < 0:
        raise DdspecError(f"--sampled-answers must be 0 or more, not {n}")
    first = getattr(args, "first_sampled_pass", 1)
    if first < 1:
        raise DdspecError(f"--first-sampled-pass must be 1 or more, not {first}")
    if not n:
        return []
    if not args.temperature > 0:
        raise DdspecError(f"--temperature must be above 0 for sampled answers, not {args.temperature}")
    sources, chosen = _sample_source_records(args, records)
    caps = {s: c for s, c in sources.items() if c is not None}
    return [(k, balanced_mix(chosen, caps=caps, seed=k)) for k in range(first, first + n)]


def stage_layers(args, out: Path, target) -> None:
    from ddspec.train.generate import load_manifest_sequences, target_fingerprint
    from ddspec.train.layers import parse_layers, run_layer_pass

    layers = parse_layers(args.fuse_layers, target.hf_config["num_hidden_layers"])
    if not layers:
        raise DdspecError("the layers stage needs --fuse-layers (e.g. --fuse-layers 2,15)")
    log = StageLog(out, "layers")
    data_dir = out / "data"
    total = load_manifest_sequences(data_dir)
    log.info(f"target residual streams at the inputs of layers {list(layers)} for {total} sequences "
             f"(runs {max(layers)} of {target.hf_config['num_hidden_layers']} layers)")
    with tqdm(total=total, desc="layer states", unit="seq", file=sys.stderr, disable=None) as bar:
        state = run_layer_pass(target, data_dir, layers, target_fingerprint(target), progress=bar)
    log.info(f"{len(state['shards'])} shards done, {state['wall_s']:.0f} s in all")
    log.finish(layers=list(layers), shards=len(state["shards"]))


def _warm_start_eagle3(head, init_from: str, target) -> None:
    """An earlier EAGLE-3 head's fc, midlayer and norm into ``head`` (trained on more data, say).
    The draft vocabulary and its lm_head rows stay this run's (taken from its data and the target)."""
    from ddspec.draft.checkpoint import load_head
    from ddspec.draft.eagle3 import Eagle3Head

    earlier = load_head(init_from, target.info)
    if not isinstance(earlier, Eagle3Head):
        raise DdspecError(f"--init-from {init_from} is an EAGLE-1/2 head; an EAGLE-3 run starts from an EAGLE-3 head")
    if earlier.capture_layers != head.capture_layers:
        raise DdspecError(f"--init-from {init_from} reads target layers {list(earlier.capture_layers)}, this run's "
                          f"data holds layers {list(head.capture_layers)}")
    mine = head.state_dict()
    carried = {k: v.float() for k, v in earlier.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    wrong = sorted(k for k, v in carried.items() if k not in mine or mine[k].shape != v.shape)
    if wrong:
        raise DdspecError(f"--init-from {init_from}: that head does not fit this target's EAGLE-3 head ({', '.join(wrong)})")
    head.load_state_dict(carried, strict=False)


def _new_head(target, sequences, draft_vocab: int, init_from: str | None = None, fuse_layers: tuple[int, ...] = (),
              layers: int = 0, keep_vocab: bool = False, ffn: int = 0):
    """The head to train: random, or warm-started from ``init_from``. ``layers`` = 0 keeps the
    earlier head's depth (1 for a random head); more layers than it has start as the identity.
    ``ffn``: its MLP width (0: the earlier head's, else the target's).
    ``keep_vocab``: the earlier head's draft vocabulary, not one counted from ``sequences``."""
    from ddspec.draft.checkpoint import add_identity_layers, load_head, random_head
    from ddspec.train.trainer import draft_vocabulary

    earlier = load_head(init_from, target.info) if init_from else None
    depth = layers or (len(earlier.layers) if earlier is not None else 1)
    if earlier is not None and ffn and ffn != earlier.arch.intermediate_size:
        raise DdspecError(f"--head-ffn {ffn}: the --init-from head {init_from} has MLP width "
                          f"{earlier.arch.intermediate_size}; drop --head-ffn to keep it")
    ffn = ffn or (earlier.arch.intermediate_size if earlier is not None else 0)
    head = random_head(target.hf_config, seed=0, fuse_layers=fuse_layers, layers=depth, ffn=ffn)
    if earlier is not None:  # the layer weights of an earlier head; its draft vocabulary is not carried over
        if earlier.fuse_layers and earlier.fuse_layers != fuse_layers:
            raise DdspecError(f"--init-from {init_from} fuses layers {list(earlier.fuse_layers)}; "
                              f"pass --fuse-layers {','.join(map(str, earlier.fuse_layers))}")
        if len(earlier.layers) > depth:
            raise DdspecError(f"--init-from {init_from} has {len(earlier.layers)} layers; --head-layers {depth} "
                              f"cannot hold it (pass --head-layers {len(earlier.layers)} or more)")
        weights = {k: v.float() for k, v in earlier.state_dict().items() if k != "d2t"}
        missing, unexpected = head.load_state_dict(weights, strict=False)
        new_layers = {k for k in missing if k.startswith("layers.") and int(k.split(".")[1]) >= len(earlier.layers)}
        if unexpected or set(missing) - {"d2t", "fuse.weight"} - new_layers:
            raise DdspecError(f"--init-from {init_from}: that head does not fit this target's head "
                              f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
        add_identity_layers(head, earlier)
    if keep_vocab:
        if earlier is None:
            raise DdspecError("--keep-draft-vocab keeps the draft vocabulary of the --init-from head: pass --init-from")
        d2t = getattr(earlier, "d2t", None)
        if d2t is None:
            raise DdspecError(f"--keep-draft-vocab: {init_from} drafts over the full vocabulary (no d2t); "
                              "drop --keep-draft-vocab, or pass --draft-vocab N")
        if draft_vocab and draft_vocab != d2t.numel():
            raise DdspecError(f"--keep-draft-vocab: {init_from} has a {d2t.numel()}-token draft vocabulary, "
                              f"not --draft-vocab {draft_vocab}")
        head.register_buffer("d2t", d2t.clone())
    elif draft_vocab:
        ids = draft_vocabulary(sequences, draft_vocab, target.info.vocab_size)
        head.register_buffer("d2t", ids - torch.arange(ids.numel()))
    return head


def stage_fit(args, out: Path, target) -> None:
    from ddspec.draft.checkpoint import save_head
    from ddspec.train.generate import load_shards, target_fingerprint
    from ddspec.train.layers import attach_layer_states, parse_layers
    from ddspec.train.trainer import HeadTrainer, TrainSettings, split_validation

    log = StageLog(out, "fit")
    manifest_path = out / "data" / "manifest.json"
    if not manifest_path.is_file():
        raise DdspecError(f"no training data in {out / 'data'}: run `ddspec train data --out {out}` first")
    manifest = json.loads(manifest_path.read_text())
    mine = target_fingerprint(target)
    if manifest["target"] != mine:
        raise DdspecError(f"{out / 'data'} was generated by {manifest['target']}, not by this target {mine}")
    sequences = load_shards(out / "data")
    eagle3 = getattr(args, "arch", "eagle") == "eagle3"
    kept = manifest.get("settings", {}).get("capture_layers") or []
    if eagle3 and kept != list(_capture_layers(args, target)):
        raise DdspecError(f"{out / 'data'} holds no layer states for an EAGLE-3 head "
                          f"({'layers ' + str(kept) if kept else 'none'}): make its data with "
                          f"`ddspec train data --arch eagle3 --out FOLDER` (a new folder)")
    if eagle3 and getattr(args, "keep_draft_vocab", False):
        raise DdspecError("--keep-draft-vocab is for EAGLE-1/2 heads; an EAGLE-3 head's vocabulary comes from its data")
    if eagle3 and getattr(args, "fuse_layers", None):
        raise DdspecError("--fuse-layers is for EAGLE-1/2 heads; an EAGLE-3 head reads its layers from the data stage")
    fuse_layers = parse_layers(getattr(args, "fuse_layers", None), target.hf_config["num_hidden_layers"])
    if fuse_layers:
        attach_layer_states(sequences, out / "data", fuse_layers)
    settings = TrainSettings(
        epochs=args.epochs if not args.tiny else 3.0, lr=args.lr, batch_tokens=args.batch_tokens if not args.tiny else 512,
        draft_vocab=args.draft_vocab if not args.tiny else 0, checkpoint_every=args.checkpoint_every,
        checkpoint_minutes=args.checkpoint_minutes,
        warmup_steps=args.warmup_steps if not args.tiny else 5, noise=args.noise, weight_decay=args.weight_decay,
        p_weight=args.p_weight,
        ttt_passes=args.ttt_passes, val_sequences=args.val_sequences, eval_every=args.eval_every,
        prompt_loss=args.prompt_loss,
    )
    if not settings.p_weight >= 0:
        raise DdspecError(f"--p-weight must be 0 or more (the cross-entropy's weight), got {settings.p_weight}")
    if not settings.checkpoint_every >= 1 or not settings.checkpoint_minutes >= 0:
        raise DdspecError(f"--checkpoint-every must be 1 or more and --checkpoint-minutes 0 or more, got "
                          f"{settings.checkpoint_every} and {settings.checkpoint_minutes}")
    if settings.ttt_passes < 1:
        raise DdspecError(f"--ttt-passes must be at least 1 (1 = plain teacher forcing), got {settings.ttt_passes}")
    if settings.val_sequences >= len(sequences):
        raise DdspecError(f"--val-sequences {settings.val_sequences}: the data holds only {len(sequences)} sequences; "
                          "hold out fewer (0 = none)")
    sequences, val = split_validation(sequences, settings.val_sequences)
    init_from = getattr(args, "init_from", None)
    head_layers = getattr(args, "head_layers", 0) or 0
    if not 0 <= head_layers <= 8:
        raise DdspecError(f"--head-layers must be from 1 to 8 (0 = as --init-from, else 1), got {head_layers}")
    head_ffn = getattr(args, "head_ffn", 0) or 0
    if head_ffn < 0 or eagle3 and head_ffn:
        raise DdspecError(f"--head-ffn must be >= 1 (0 = the target's width), for an EAGLE-1/2 head; got {head_ffn}"
                          + (" with --arch eagle3" if eagle3 else ""))
    if eagle3:
        from ddspec.train.trainer import draft_vocabulary, new_eagle3_head

        size = settings.draft_vocab or target.info.vocab_size
        head = new_eagle3_head(target, draft_vocabulary(sequences, size, target.info.vocab_size), tuple(kept))
        if init_from:
            _warm_start_eagle3(head, init_from, target)
    else:
        head = _new_head(target, sequences, settings.draft_vocab, init_from, fuse_layers, head_layers,
                         getattr(args, "keep_draft_vocab", False), head_ffn)
        if getattr(head, "d2t", None) is not None:  # record the vocabulary trained on (a kept one too)
            settings = replace(settings, draft_vocab=int(head.d2t.numel()))
    trainer = HeadTrainer(head, target.embed_tokens, target.lm_head_weight_t(), sequences, settings, out, val=val)
    if trainer.try_resume():
        log.info(f"resuming from step {trainer.step}/{trainer.total_steps} ({out / 'train_state.pt'})")
    elif init_from:
        log.info(f"warm start from the weights of {init_from} ({len(getattr(head, 'layers', [head]))}-layer head)")
    log.info(f"{len(sequences)} sequences, {len(trainer.batches)} batches per epoch, {trainer.total_steps} steps; "
             f"settings {settings}")
    with tqdm(total=trainer.total_steps, initial=trainer.step, desc="training", unit="step", file=sys.stderr,
              disable=None) as bar:
        trainer.train(progress=bar, log=lambda s: log.logger.info(json.dumps(s))
                      if s["step"] % 20 == 0 or "val_acc" in s else None)
    summary = _training_summary(trainer.history)
    log.info(f"final (mean of last 50 steps): {summary}")
    if trainer.best is not None:
        summary["best_val"] = {"step": trainer.best["step"], **trainer.best["val"]}
        log.info(f"kept the head of step {trainer.best['step']}, best on {len(val)} held-out sequences: "
                 f"{ {k: round(v, 4) for k, v in trainer.best['val'].items()} }")
    meta = {"training": {"steps": trainer.step, "settings": asdict(settings), "train_wall_s": trainer.wall_s,
                         **({"init_from": str(init_from)} if init_from else {}), **summary}}
    if eagle3:
        from ddspec.draft.eagle3_checkpoint import save_eagle3_head

        save_eagle3_head(head, out / "head", target.info.num_layers, dtype=torch.float32, metadata=meta)
    else:
        save_head(head, out / "head", metadata=meta)
    log.finish(steps=trainer.step, train_wall_s=trainer.wall_s, **summary)


def stage_calibrate(args, out: Path, target) -> None:
    """Fit the head's greedy draft temperature on the run's held-out sequences (trainer.fit_draft_temperature)
    and record it in the head's config (``ddspec.draft_temperature``), where the drafter reads it."""
    from ddspec.draft.checkpoint import load_head
    from ddspec.draft.eagle3 import Eagle3Head
    from ddspec.train.generate import load_manifest_sequences, load_shards, tail_shard_keys
    from ddspec.train.layers import attach_layer_states
    from ddspec.train.trainer import TrainSettings, fit_draft_temperature

    folder = Path(args.to) if args.to else out / "head"
    n_val = args.val_sequences
    if n_val < 1:
        if args.stage == "all":
            print("[train calibrate] skipped: no held-out sequences (--val-sequences N) to fit the draft temperature "
                  "on; the head keeps T = 1", file=sys.stderr)
            return
        raise DdspecError("calibrate fits the draft temperature on held-out sequences: give --val-sequences N, "
                          "the same N as `fit` (the last N sequences, which the head was not trained on)")
    if not (folder / "config.json").is_file():
        raise DdspecError(f"no head in {folder} (no config.json): run `ddspec train fit --out {out}` first, "
                          "or name a head folder with --to")
    log = StageLog(out, "calibrate")
    head = load_head(folder, target.info)
    total = load_manifest_sequences(out / "data")
    if n_val >= total:
        raise DdspecError(f"--val-sequences {n_val}: the data holds only {total} sequences; hold out fewer")
    keys = tail_shard_keys(out / "data", n_val)  # the held-out sequences live in the newest shards
    sequences = load_shards(out / "data", keys)
    if isinstance(head, Eagle3Head):
        if "states" not in sequences[-1]:
            raise DdspecError(f"{out / 'data'} holds no captured layer states for an EAGLE-3 head: calibrate it on "
                              "data made with `ddspec train data --arch eagle3`")
    elif head.fuse_layers:
        attach_layer_states(sequences, out / "data", head.fuse_layers, keys)
    val = sequences[-n_val:]
    passes = max(2, args.ttt_passes)
    settings = TrainSettings(batch_tokens=args.batch_tokens if not args.tiny else 512)
    with tqdm(total=len(val), desc="calibrate", unit="seq", file=sys.stderr, disable=None) as bar:
        fit = fit_draft_temperature(head, target.embed_tokens, target.lm_head_weight_t(), val, settings,
                                    n_passes=passes, progress=bar)
    fit["fitted_on"] = f"the last {n_val} sequences of the run's data (held out from `fit`)"
    cfg = json.loads((folder / "config.json").read_text())
    cfg.setdefault("ddspec", {})["draft_temperature"] = fit
    write_json_atomic(folder / "config.json", cfg, indent=2)
    nll = fit["nll"]
    log.info(f"greedy draft temperature {fit['greedy']} for {folder} ({fit['tokens']} held-out tokens, depths "
             f"1..{passes}, top-1 accuracy {fit['accuracy']}); argmax NLL {nll['1.0']:.4f} at T = 1, "
             f"{min(nll.values()):.4f} at the best grid point")
    log.finish(greedy=fit["greedy"], tokens=fit["tokens"], head=str(folder))


def _training_summary(history: list[dict]) -> dict:
    """Means of the last 50 steps' losses and accuracies (every pass of the training-time test)."""
    last = [h for h in history if "loss" in h][-50:]
    keys = [k for k in (last[-1] if last else {}) if k == "loss" or k.startswith(("v_loss", "p_loss", "acc"))]
    return {k: sum(h[k] for h in last) / len(last) for k in keys}


def stage_eval(args, out: Path, target) -> None:
    from ddspec.draft.checkpoint import load_head
    from ddspec.train.evaluate import evaluate_head, parse_eval_sets, turn_records

    log = StageLog(out, "eval")
    if (out / "head" / "config.json").is_file():
        head = load_head(out / "head", target.info)
    else:
        head, meta = _head_from_checkpoint(out, target)
        log.info(f"training has not finished: evaluating the checkpoint at step {meta['training']['steps']}")
    turns = getattr(args, "eval_turns", 1)
    if turns < 1:
        raise DdspecError(f"--eval-turns {turns}: evaluate at least the first turn (1)")
    if args.tiny:
        sets = {"tiny": [[p] + ["Go on."] * (turns - 1) for p in TINY_PROMPTS[:4]]}
        categories = {"tiny": ["tiny"] * 4}
        new_tokens = 24
    else:
        limits = parse_eval_sets(args.eval_sets, args.eval_limit, EVAL_FILES)
        records = {name: turn_records(eval_set(name), n, turns) for name, n in limits.items()}
        sets = {name: [turns for _, turns in rows] for name, rows in records.items()}
        categories = {name: [cat for cat, _ in rows] for name, rows in records.items()}
        new_tokens = args.eval_new_tokens
    results = {}
    variants = {"head": head}
    from ddspec.draft.eagle3 import Eagle3Head

    # the same head drafting over the whole vocabulary (an EAGLE-3 head's lm_head has only its own rows)
    if hasattr(head, "d2t") and not isinstance(head, Eagle3Head) and args.eval_full_vocab:
        full = copy.deepcopy(head)
        del full.d2t
        variants["head_full_vocab"] = full
    against = getattr(args, "against", None)
    if against:
        variants["against"] = _against_head(against, target)
        log.info(f"side by side with {against}")
    total = sum(1 if isinstance(p, str) else len(p) for ps in sets.values() for p in ps) * len(variants)
    with tqdm(total=total, desc="eval", unit="turn", file=sys.stderr, disable=None) as bar:
        for vname, h in variants.items():
            for name, prompts in sets.items():
                r = evaluate_head(target, h, prompts, new_tokens, progress=bar, categories=categories[name],
                                  tree=TreeConfig(context_vocab=getattr(args, "context_vocab", TreeConfig().context_vocab)),
                                  replay=getattr(args, "eval_replay", False))
                results.setdefault(vname, {})[name] = r
                # three places and the counts: a τ of 2.995 must not print as 3.00
                log.info(f"{vname} {name} ({len(prompts)} prompts, {r['turns']} turns{', replayed' if r['replay'] else ''}): "
                         f"tau {r['tau']:.3f} ({r['tau_tokens']} tokens in "
                         f"{r['tau_steps']} steps), depth acceptance "
                         f"{[round(x, 2) for x in r['depth_acceptance']]}, draft {r['draft_ms_per_step']:.1f} ms/step, "
                         f"identical {r['identical_to_plain']}")
                if len(r["by_category"]) > 1:
                    log.info(f"{vname} {name} tau by category: "
                             + ", ".join(f"{c} {e['tau']:.3f}" for c, e in r["by_category"].items()))
                if len(r["by_turn"]) > 1:
                    log.info(f"{vname} {name} tau by turn: "
                             + ", ".join(f"turn {t} {e['tau']:.3f} ({e['turns']} turns)" for t, e in r["by_turn"].items()))
    (out / "eval.json").write_text(json.dumps(results, indent=1))
    log.finish()


def _against_head(spec: str, target):
    """The head ``--against`` names: a folder, or ``shipped`` (the target's shipped head)."""
    from ddspec.methods import resolve_head, shipped_head

    if spec == "shipped":
        if shipped_head(target.info) is None:
            raise DdspecError(f"--against shipped: no head ships for {target.info.name}; give a head folder")
        return resolve_head(None, target)
    if not (Path(spec) / "config.json").is_file():
        raise DdspecError(f"--against {spec}: not a head folder (no config.json)")
    return resolve_head(spec, target)


def _head_from_checkpoint(out: Path, target):
    """The head in train_state.pt (a run stopped before the end), with its progress as metadata."""
    from ddspec.draft.checkpoint import random_head
    from ddspec.draft.head import EagleHead

    path = out / "train_state.pt"
    if not path.is_file():
        raise DdspecError(f"no trained head in {out} (neither head/ nor train_state.pt): run "
                          f"`ddspec train fit --out {out}` first")
    state = torch.load(path, weights_only=False)
    weights = state["head"]
    if "midlayer.mlp.down_proj.weight" in weights:  # an EAGLE-3 head
        from ddspec.draft.eagle3 import Eagle3Head

        head = Eagle3Head(state["head_config"], tuple(state["capture_layers"]), max_position=target.arch.max_position)
    elif "head_config" in state:  # its depth and fused layers, as trained
        d2t = weights.get("d2t")
        head = EagleHead(state["head_config"], own_embedding="embed_tokens.weight" in weights,
                         draft_vocab=None if d2t is None else d2t.numel())
    else:  # checkpoints written before the config was kept: one-layer heads
        head = random_head(target.hf_config)
        if "d2t" in weights:
            head.register_buffer("d2t", torch.zeros_like(weights["d2t"]))
    head.load_state_dict(weights)
    meta = {"training": {"steps": state["step"], "settings": state["settings"], "train_wall_s": state["wall_s"],
                         "partial": True, **_training_summary(state["history"])}}
    return head.eval().requires_grad_(False), meta


def _export_eagle3(head, fmt: str, dest: Path, target, meta: dict) -> None:
    """Write an EAGLE-3 head in the published EAGLE-3 layout; refuse a head whose maths differs."""
    from ddspec.draft.eagle3 import Eagle3Head
    from ddspec.draft.eagle3_checkpoint import save_eagle3_head

    if not isinstance(head, Eagle3Head):
        raise DdspecError(
            "this run's head is an EAGLE-1/2 head and cannot be written in the EAGLE-3 layout: it reads "
            "fc(cat(embed, feature)) into its residual stream and feeds the target's lm_head without a norm, where "
            "an EAGLE-3 head normalises the embedding and its hidden input separately, keeps the embedding out of "
            "its residual and has its own norm and lm_head, so no EAGLE-3 weights compute the same draft. "
            "Export it with --format eagle (the default)")
    if fmt != "eagle3":
        raise DdspecError("this run's head is an EAGLE-3 head: export it with --format eagle3")
    save_eagle3_head(head, dest, target.info.num_layers, metadata=meta)


def stage_export(args, out: Path, target) -> None:
    from ddspec.draft.checkpoint import load_head, save_head
    from ddspec.draft.eagle3 import Eagle3Head
    from ddspec.train.model_card import write_model_card

    log = StageLog(out, "export")
    dest = Path(args.to) if args.to else out / "export"
    if (out / "head" / "config.json").is_file():
        head = load_head(out / "head", target.info)
        meta = json.loads((out / "head" / "config.json").read_text()).get("ddspec", {})
    else:
        head, meta = _head_from_checkpoint(out, target)
        log.info(f"training has not finished: exporting the checkpoint at step {meta['training']['steps']}")
    fmt = getattr(args, "format", None) or ("eagle3" if isinstance(head, Eagle3Head) else "eagle")
    if fmt == "eagle3" or isinstance(head, Eagle3Head):
        _export_eagle3(head, fmt, dest, target, meta)
    else:
        save_head(head.half(), dest, metadata=meta)
        write_model_card(dest, out, target)
    log.info(f"head written to {dest} ({fmt} layout)")
    log.finish()


def stage_merge(args, out: Path, target) -> None:
    from ddspec.train.merge import merge_data

    if not getattr(args, "from_run", None):
        raise DdspecError("the merge stage needs --from OTHER_RUN: the run folder whose data joins this one's")
    log = StageLog(out, "merge")
    src = Path(args.from_run)
    added = merge_data(out / "data", src / "data" if (src / "data").is_dir() else src, log=log.info)
    log.info(f"added {added['shards']} shards, {added['sequences']} sequences, {added['response_tokens']} response "
             f"tokens; skipped {added['skipped']}")
    log.finish(source=str(src), **added)


def run_stages(args: argparse.Namespace) -> int:
    out, target = _setup(args)
    stages = {"data": stage_data, "layers": stage_layers, "fit": stage_fit, "calibrate": stage_calibrate,
              "eval": stage_eval, "export": stage_export, "merge": stage_merge}
    todo = [s for s in stages if s != "merge" and (s != "layers" or getattr(args, "fuse_layers", None))] \
        if args.stage == "all" else [args.stage]
    for name in todo:
        stages[name](args, out, target)
    return 0
