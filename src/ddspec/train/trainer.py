"""Stage 3: train an EAGLE-1/2 head on the target's own answers (docs/design.md §2.1).

Objective (EAGLE-1): SmoothL1(f̂_{t+1}, f_{t+1}) + 0.1 · CE(softmax(lm_head(f_{t+1})),
log_softmax(lm_head(f̂_{t+1}))), on response positions only, with uniform noise U(-a, a) on
the input features. AdamW (β 0.9/0.95), linear warm-up then cosine decay, gradient clipping.
With a reduced draft vocabulary the cross-entropy runs over those tokens only (EAGLE-3's
recipe), which is ~3x cheaper per token on a CPU, and the head ships with that ``d2t``.

Checkpoints (``train_state.pt``: head, optimiser, step, RNG) are written every
``checkpoint_every`` steps, whenever ``checkpoint_minutes`` of wall time have passed since the last
one (a slow machine loses at most that much work when it stops), and at the end; a restart with the same arguments resumes from the
last one, never silently from scratch.

Training-time test (``ttt_passes`` > 1, as in HASS / EAGLE-3): at draft depth 2 and deeper the
engine feeds the head its *own* predicted features, which plain teacher forcing never shows it.
Pass k >= 2 re-runs the head on the features predicted by pass k - 1, with an attention mask
that reproduces the engine's exactly: the node sees the true-feature entries committed before
its chain and its own drafted ancestors (:func:`ttt_mask`). Pass k's loss is weighted
``ttt_decay ** (k - 1)``.

EAGLE-3 heads (:class:`~ddspec.draft.eagle3.Eagle3Head`, ``--arch eagle3``): pass 1 reads
``fc`` of the target states the data stage captured, later passes the head's own output ``h``;
the loss is the cross-entropy of ``lm_head(norm(h))`` against the target's distribution over the
draft vocabulary only (EAGLE-3's recipe, no feature regression, no input noise), weighted
``ttt_decay ** (k - 1)`` per pass as above. The head's ``lm_head`` stays the target's rows.

Held-out sequences (``val_sequences``, the last ones of the data, i.e. the newest shards, which
a warm start from an earlier round has never seen) are scored every ``eval_every`` steps without
noise; the head kept at the end is the one with the best held-out accuracy.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddspec.draft.checkpoint import head_config_for
from ddspec.draft.eagle3 import Eagle3Head
from ddspec.draft.head import EagleHead


@dataclass(frozen=True, slots=True)
class TrainSettings:
    epochs: float = 2.0
    lr: float = 1e-3
    warmup_steps: int = 100
    batch_tokens: int = 4096  # tokens per optimiser step (padded sequences)
    max_seq_len: int = 640
    noise: float = 0.1  # half-width of the uniform noise on input features
    p_weight: float = 0.1  # weight of the cross-entropy term
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    draft_vocab: int = 0  # 0 = full vocabulary; else the most frequent response tokens
    checkpoint_every: int = 200
    checkpoint_minutes: float = 10.0  # also checkpoint when this much wall time passed since the last one
    seed: int = 0
    ttt_passes: int = 1  # 1 = the EAGLE-1 objective; k > 1 also trains draft depths 2..k on own predictions
    ttt_decay: float = 0.8  # loss weight of pass k is ttt_decay ** (k - 1)
    val_sequences: int = 0  # held-out sequences (the last ones) scored every eval_every steps
    prompt_loss: bool = False  # also learn the target at prompt positions (free: their features exist)
    eval_every: int = 50


def split_validation(sequences: list[dict], n: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): the last ``n`` sequences are held out (the newest shards)."""
    if n <= 0:
        return sequences, []
    if n >= len(sequences):
        raise ValueError(f"cannot hold out {n} of {len(sequences)} sequences for validation")
    return sequences[:-n], sequences[-n:]


def ttt_mask(t: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Which keys pass ``k`` (1-based) attends to, over the keys of passes 1..k: [t, k * t] bool.

    Pass 1 is causal. In pass k >= 2 the entry at index i (position i) is the depth-(k-1) draft
    node of the chain whose first drafted node sits at c = i - (k - 2): it sees the true-feature
    (pass 1) entries before c and, of each pass j in 2..k, the chain's node at i - (k - j)
    (its ancestors, and itself for j = k).
    """
    i = torch.arange(t, device=device)
    if k == 1:
        return i.view(1, t) <= i.view(t, 1)
    blocks = [i.view(1, t) < (i - (k - 2)).view(t, 1)]
    blocks += [i.view(1, t) == (i - (k - j)).view(t, 1) for j in range(2, k + 1)]
    return torch.cat(blocks, dim=1)


def draft_vocabulary(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens, as sorted target ids [Vd]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        ids = s["input_ids"][s["prompt_len"]:].long()
        counts += torch.bincount(ids, minlength=vocab_size)
    return torch.sort(torch.topk(counts, size).indices).values


def ttt_passes(head: EagleHead | Eagle3Head, embeds: torch.Tensor, features: torch.Tensor, n_passes: int
               ) -> list[torch.Tensor]:
    """Predicted features (an EAGLE-3 head: its outputs h) of passes 1..n_passes, each [B, T, H]
    (pass k+1 reads pass k's output)."""
    t = embeds.shape[1]
    positions = torch.arange(t, device=embeds.device)
    keys: dict[int, list[torch.Tensor]] = defaultdict(list)  # per head layer, per pass
    values: dict[int, list[torch.Tensor]] = defaultdict(list)

    def attend(layer, k_, v_):
        keys[layer].append(k_)
        values[layer].append(v_)
        return torch.cat(keys[layer], dim=2), torch.cat(values[layer], dim=2)

    outs, inp = [], features
    for k in range(1, n_passes + 1):
        out = head(embeds, inp, positions, ttt_mask(t, k, embeds.device).view(1, 1, t, k * t), attend=attend)
        outs.append(out)
        inp = F.pad(out[:, :-1], (0, 0, 1, 0))  # pass k + 1 at index i reads pass k's output at i - 1
    return outs


def unroll(head: EagleHead | Eagle3Head, embed_weight: torch.Tensor, sequences: list[dict], batch: list[int],
           s: TrainSettings, *, noise: bool, n_passes: int, held_out: bool
           ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head over a batch, teacher-forced then on its own outputs: (per pass [B, T, H], the target's
    features at the counted rows [M, H], the counted rows' mask [B, T], each counted row's step index [M]).
    ``held_out``: score response tokens only (validation)."""
    eagle3 = isinstance(head, Eagle3Head)
    tokens_next, feats_in, feats_target, mask, layers_in = collate(
        sequences, batch, s.max_seq_len, s.prompt_loss and not held_out, extra="states" if eagle3 else "layers")
    t = feats_in.shape[1]
    if eagle3:  # committed positions read fc(captured states); no noise: the later passes are its own
        if layers_in is None:
            raise ValueError("an EAGLE-3 head trains on sequences with captured layer states (\"states\")")
        feats_in = head.fc(layers_in)
    else:
        if noise:
            feats_in = feats_in + (torch.rand_like(feats_in) * 2 - 1) * s.noise
        feats_in = head.fused_features(feats_in, layers_in)  # committed positions: + fused layers
    preds = ttt_passes(head, F.embedding(tokens_next, embed_weight), feats_in, n_passes)  # k x [B, T, H]
    index = torch.arange(t).expand_as(mask)[mask]  # [M] the step index of each counted row
    return preds, feats_target[mask], mask, index


def draft_logits(head: EagleHead | Eagle3Head, hidden: torch.Tensor, draft_lm_t: torch.Tensor) -> torch.Tensor:
    """The head's draft logits [M, Vd] for its outputs ``hidden`` [M, H]: an EAGLE-3 head's own lm_head
    over norm(h), an EAGLE-1/2 head's f̂ times the target's lm_head rows ``draft_lm_t`` [H, Vd]."""
    x = head.logits_input(hidden)
    return head.lm_head(x) if isinstance(head, Eagle3Head) else x @ draft_lm_t


# the greedy draft temperatures tried by fit_draft_temperature (then refined between neighbours)
TEMPERATURE_GRID = tuple(round(0.3 + 0.05 * i, 2) for i in range(27))  # 0.30 .. 1.60


def argmax_nll(logits: torch.Tensor, labels: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """Summed NLL of ``labels`` [N] under log_softmax(logits [N, V] * 1/T), for each 1/T in ``inv_t`` [G] -> [G]."""
    chosen = logits.gather(1, labels.view(-1, 1))[:, 0].double()
    return torch.stack([(torch.logsumexp(logits * b, dim=-1).double() - chosen * float(b)).sum() for b in inv_t])


def best_temperature(grid: tuple[float, ...], mean_nll: list[float]) -> float:
    """The grid's best T, refined to the vertex of the parabola through it and its neighbours."""
    best = min(range(len(grid)), key=mean_nll.__getitem__)
    if not 0 < best < len(grid) - 1:
        return float(grid[best])
    (x0, x1, x2), (y0, y1, y2) = grid[best - 1:best + 2], mean_nll[best - 1:best + 2]
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    return float(min(max(-b / (2 * a), x0), x2)) if a > 0 else float(x1)


@torch.no_grad()
def fit_draft_temperature(head: EagleHead | Eagle3Head, embed_weight: torch.Tensor, lm_head_t: torch.Tensor,
                          sequences: list[dict], s: TrainSettings, n_passes: int = 3,
                          grid: tuple[float, ...] = TEMPERATURE_GRID, progress=None) -> dict:
    """The temperature T whose draft log-probs, log_softmax(logits / T), best forecast greedy acceptance.

    Greedy decoding accepts a drafted token when it is the target's argmax. The head learnt the
    target's whole distribution, whose mass on the argmax is lower than how often a draft's top
    token *is* the argmax: its probabilities under-forecast acceptance. Standard temperature
    scaling (Guo et al. 2017): minimise the negative log-likelihood of the target's argmax under
    the draft over ``sequences`` (held-out ones: the head has not seen them), at draft depths
    1..n_passes (the head fed its own outputs, as in drafting), pooled token by token. Rows whose
    argmax lies outside the draft vocabulary are left out (no T changes their probability, 0).
    The NLL is convex in 1/T; the best grid point is refined by a parabola through its neighbours.

    lm_head_t: the target's full [H, V] lm_head. Returns {"greedy": T, "nll": {T: mean NLL}, "tokens": n,
    "depths": n_passes, "accuracy": top-1 per depth}.
    """
    was_training = head.training
    head.eval()
    ids = head.draft_token_ids
    vocab = lm_head_t.shape[1]
    draft_lm_t = lm_head_t if ids is None else lm_head_t[:, ids]
    inv = torch.arange(vocab) if ids is None else torch.full((vocab,), -1, dtype=torch.long).index_put_(
        (ids.cpu(),), torch.arange(ids.numel()))
    inv_t = torch.tensor(grid, dtype=torch.float32).reciprocal()
    nll = torch.zeros(len(grid), dtype=torch.float64)
    hits = torch.zeros(n_passes, dtype=torch.float64)
    counted = torch.zeros(n_passes, dtype=torch.float64)
    for batch in make_batches(sequences, s.batch_tokens, s.max_seq_len, random.Random(0)):
        preds, target, mask, index = unroll(head, embed_weight, sequences, batch, s, noise=False,
                                            n_passes=n_passes, held_out=True)
        want = inv[(target @ lm_head_t).argmax(-1)]  # the target's own next token, in draft ids (-1: outside)
        for k, pred in enumerate(preds):
            rows = (index >= k) & (want >= 0)  # pass k + 1 has no chain before index k
            logits = draft_logits(head, pred[mask][rows], draft_lm_t)
            w = want[rows]
            hits[k] += float((logits.argmax(-1) == w).sum())
            counted[k] += w.numel()
            nll += argmax_nll(logits, w, inv_t)
        if progress:
            progress.update(len(batch))
    head.train(was_training)
    n = float(counted.sum())
    if n == 0:
        raise ValueError("no held-out response tokens to fit the draft temperature on")
    mean = nll / n
    return {"greedy": round(best_temperature(grid, mean.tolist()), 3), "nll": {str(g): round(float(v), 5) for g, v in zip(grid, mean)},
            "tokens": int(n), "depths": n_passes,
            "accuracy": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counted)]}


def new_eagle3_head(target, draft_ids: torch.Tensor, capture_layers: tuple[int, ...]) -> Eagle3Head:
    """An EAGLE-3 head to train for ``target`` (a NativeLlama): the draft vocabulary ``draft_ids``
    (sorted target ids), its ``lm_head`` the target's rows for them (kept frozen in training), its
    ``norm`` a tenth of the target's final norm (random first outputs then make soft drafts rather
    than confident wrong ones), the rest random."""
    cfg = head_config_for(target.hf_config, layers=1)
    cfg.pop("bias", None)
    cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=int(draft_ids.numel()),
               target_hidden_size=target.arch.hidden_size)
    head = Eagle3Head(cfg, capture_layers, max_position=target.arch.max_position)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head_weight_t()[:, draft_ids].t())
        head.norm.weight.copy_(0.1 * target.norm)  # soft at first: a random h must not make confident drafts
        head.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.lm_head.weight.requires_grad_(False)  # trained against the target's own output map
    return head


def make_batches(sequences: list[dict], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[int]]:
    """Group sequence indices into batches of about batch_tokens padded tokens, similar lengths together."""
    order = sorted(range(len(sequences)), key=lambda i: (min(len(sequences[i]["input_ids"]), max_len), rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = min(len(sequences[i]["input_ids"]), max_len)
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(sequences: list[dict], idx: list[int], max_len: int, prompt_loss: bool = False, extra: str = "layers"):
    """Pad a batch. Head step t reads (f_t, x_{t+1}) and predicts f_{t+1} (token t+2).

    Returns tokens_next [B, T], feats_in [B, T, H], feats_target [B, T, H], loss_mask [B, T]
    with T = (longest sequence - 2), and layers_in [B, T, n * H] at t when the sequences carry
    ``extra``: ``"layers"``, the fused target layers (see :mod:`ddspec.train.layers`), or
    ``"states"``, an EAGLE-3 head's raw captured states (see :mod:`ddspec.train.generate`); else None."""
    lens = [min(len(sequences[i]["input_ids"]), max_len) for i in idx]
    t = max(lens) - 2
    h = sequences[idx[0]]["features"].shape[1]
    b = len(idx)
    tokens_next = torch.zeros(b, t, dtype=torch.long)
    feats_in = torch.zeros(b, t, h)
    feats_target = torch.zeros(b, t, h)
    mask = torch.zeros(b, t, dtype=torch.bool)
    first = sequences[idx[0]].get(extra)
    layers_in = None if first is None else torch.zeros(b, t, first.shape[1])
    for row, (i, n) in enumerate(zip(idx, lens)):
        s = sequences[i]
        ids, f = s["input_ids"][:n].long(), s["features"][: n - 1].float()  # f: [n-1, H]
        m = n - 2  # steps t = 0 .. n-3 have a target feature f_{t+1}
        tokens_next[row, :m] = ids[1 : m + 1]
        feats_in[row, :m] = f[:m]
        feats_target[row, :m] = f[1 : m + 1]
        if layers_in is not None:
            layers_in[row, :m] = s[extra][:m].float()
        # the step predicts token t+2: count it when that token is part of the response
        steps = torch.arange(m)
        mask[row, :m] = True if prompt_loss else steps + 2 >= s["prompt_len"]
    return tokens_next, feats_in, feats_target, mask, layers_in


class HeadTrainer:
    def __init__(self, head: EagleHead, embed_weight: torch.Tensor, lm_head_t: torch.Tensor,
                 sequences: list[dict], settings: TrainSettings, out_dir: Path, val: list[dict] | None = None) -> None:
        self.head, self.settings, self.out_dir = head, settings, out_dir
        self.sequences, self.val = sequences, val or []
        self.best: dict | None = None  # {"step", "score", "val", "head"}: the best held-out head so far
        self.embed_weight = embed_weight  # [V, H] frozen
        ids = head.draft_token_ids
        self.lm_head_t = lm_head_t if ids is None else lm_head_t[:, ids].contiguous()  # [H, Vd] frozen
        self.rng = random.Random(settings.seed)
        self.batches = make_batches(sequences, settings.batch_tokens, settings.max_seq_len, self.rng)
        self.total_steps = max(1, int(len(self.batches) * settings.epochs))
        self.opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr, betas=(0.9, 0.95),
                                     weight_decay=settings.weight_decay)
        self.step = 0
        self.wall_s = 0.0
        self.history: list[dict] = []

    # -- schedule / state ----------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        s = self.settings
        if step < s.warmup_steps:
            return s.lr * (step + 1) / s.warmup_steps
        progress = (step - s.warmup_steps) / max(1, self.total_steps - s.warmup_steps)
        return s.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def state_path(self) -> Path:
        return self.out_dir / "train_state.pt"

    def save_state(self) -> None:
        tmp = self.state_path().with_suffix(".tmp")
        torch.save({"head": self.head.state_dict(), "head_config": self.head.config,
                    "capture_layers": list(getattr(self.head, "capture_layers", ())),
                    "opt": self.opt.state_dict(), "step": self.step,
                    "wall_s": self.wall_s, "history": self.history, "settings": asdict(self.settings),
                    "torch_rng": torch.get_rng_state(), "best": self.best, "sequences": len(self.sequences)}, tmp)
        tmp.replace(self.state_path())

    def try_resume(self) -> bool:
        if not self.state_path().is_file():
            return False
        state = torch.load(self.state_path(), weights_only=False)
        trained = state.get("sequences")
        if trained is not None and trained != len(self.sequences):
            from ddspec.errors import DdspecError

            raise DdspecError(
                f"{self.state_path()} holds a fit over {trained} training sequences, and the run's data now gives "
                f"{len(self.sequences)} (it grew, or --val-sequences changed): resuming would continue that fit's "
                f"schedule on other data. To train on the new data from the head it made, move train_state.pt "
                f"aside and run `ddspec train fit ... --init-from {self.out_dir / 'head'}` (a warm start)")
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.wall_s, self.history = state["step"], state["wall_s"], state["history"]
        self.best = state.get("best")
        torch.set_rng_state(state["torch_rng"])
        return True

    # -- one step --------------------------------------------------------------------------
    def loss(self, batch: list[int], sequences: list[dict] | None = None, noise: bool = True,
             n_passes: int | None = None) -> tuple[torch.Tensor, dict]:
        s = self.settings
        held_out = sequences is not None  # validation scores response tokens only
        eagle3 = isinstance(self.head, Eagle3Head)
        preds, target, mask, index = unroll(self.head, self.embed_weight, sequences or self.sequences, batch, s,
                                            noise=noise, n_passes=n_passes or s.ttt_passes, held_out=held_out)
        with torch.no_grad():
            p = torch.softmax(target @ self.lm_head_t, dim=-1)  # [M, Vd]
            want = p.argmax(-1)
        total, weights, stats = 0.0, 0.0, {"tokens": int(mask.sum())}
        for k, pred in enumerate(preds, start=1):
            rows = index >= k - 1  # pass k has no chain before index k - 1
            pk = pred[mask][rows]
            suffix = "" if k == 1 else str(k)
            w = s.ttt_decay ** (k - 1)
            log_q = torch.log_softmax(draft_logits(self.head, pk, self.lm_head_t), dim=-1)
            if eagle3:  # EAGLE-3: only the draft distribution is learnt; h is free to be what helps
                p_loss = -(p[rows] * log_q).sum(-1).mean()
                total, weights = total + w * p_loss, weights + w
            else:
                v_loss = F.smooth_l1_loss(pk, target[rows])
                p_loss = -(p[rows] * log_q).sum(-1).mean()
                total, weights = total + w * (v_loss + s.p_weight * p_loss), weights + w
                stats[f"v_loss{suffix}"] = float(v_loss.detach())
            acc = float((log_q.argmax(-1) == want[rows]).float().mean())
            stats.update({f"p_loss{suffix}": float(p_loss.detach()), f"acc{suffix}": acc})
        return total / weights, stats

    @torch.no_grad()
    def validate(self) -> dict:
        """Token-weighted top-1 accuracy on the held-out sequences (no noise), for draft depth 1 and for
        depths 2.. max(2, ttt_passes) (the head fed its own predictions, as in drafting)."""
        self.head.eval()
        sums: dict[str, float] = {}
        n = 0
        for batch in make_batches(self.val, self.settings.batch_tokens, self.settings.max_seq_len, random.Random(0)):
            _, stats = self.loss(batch, self.val, noise=False, n_passes=max(2, self.settings.ttt_passes))
            for key, value in stats.items():
                if key.startswith("acc"):
                    sums[key] = sums.get(key, 0.0) + value * stats["tokens"]
            n += stats["tokens"]
        self.head.train()
        return {f"val_{k}": v / max(1, n) for k, v in sums.items()}

    @staticmethod
    def val_score(val: dict) -> float:
        accs = [v for k, v in val.items() if k.startswith("val_acc")]
        return sum(accs) / max(1, len(accs))

    def train(self, progress=None, log=None) -> None:
        self.head.train()
        epoch_len = len(self.batches)
        if self.val and self.step == 0:  # the starting point (a warm start's, or chance)
            start = {"step": 0}
            self._check_validation(start)
            self.history.append(start)
            if log:
                log(start)
        last_save = time.monotonic()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            if self.step % epoch_len == 0 and self.step > 0:  # a new epoch: reshuffle deterministically
                self.rng = random.Random(self.settings.seed + self.step // epoch_len)
                self.rng.shuffle(self.batches)
            batch = self.batches[self.step % epoch_len]
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.step)
            loss, stats = self.loss(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in self.head.parameters() if p.requires_grad], self.settings.grad_clip)
            self.opt.step()
            self.step += 1
            self.wall_s += time.perf_counter() - t0
            stats.update(step=self.step, lr=self.lr_at(self.step - 1), loss=float(loss.detach()))
            self.history.append(stats)
            if self.val and (self.step % self.settings.eval_every == 0 or self.step == self.total_steps):
                self._check_validation(stats)
            if progress:
                progress.update(1)
                shown = {"loss": stats["loss"], "acc": stats["acc"]}
                if self.best is not None:
                    shown["val_acc"] = self.best["val"].get("val_acc", 0.0)
                progress.set_postfix({k: f"{v:.3f}" for k, v in shown.items()})
            if log:
                log(stats)
            due = time.monotonic() - last_save >= 60 * self.settings.checkpoint_minutes
            if due or self.step % self.settings.checkpoint_every == 0 or self.step == self.total_steps:
                self.save_state()
                last_save = time.monotonic()
        if self.best is not None:  # keep the head that did best on held-out data
            self.head.load_state_dict(self.best["head"])
        self.head.eval()

    def _check_validation(self, stats: dict) -> None:
        val = self.validate()
        stats.update(val)
        score = self.val_score(val)
        if self.best is None or score > self.best["score"]:
            self.best = {"step": self.step, "score": score, "val": val,
                         "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()}}
