"""Stage 3: train an EAGLE-1/2 head on the target's own answers (DESIGN.md §2.1).

Objective (EAGLE-1): SmoothL1(f̂_{t+1}, f_{t+1}) + 0.1 · CE(softmax(lm_head(f_{t+1})),
log_softmax(lm_head(f̂_{t+1}))), on response positions only, with uniform noise U(-a, a) on
the input features. AdamW (β 0.9/0.95), linear warm-up then cosine decay, gradient clipping.
With a reduced draft vocabulary the cross-entropy runs over those tokens only (EAGLE-3's
recipe), which is ~3x cheaper per token on a CPU, and the head ships with that ``d2t``.

Checkpoints (``train_state.pt``: head, optimiser, step, RNG) are written every
``checkpoint_every`` steps and at the end; a restart with the same arguments resumes from the
last one, never silently from scratch.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

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
    seed: int = 0


def draft_vocabulary(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens, as sorted target ids [Vd]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        ids = s["input_ids"][s["prompt_len"]:].long()
        counts += torch.bincount(ids, minlength=vocab_size)
    return torch.sort(torch.topk(counts, size).indices).values


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


def collate(sequences: list[dict], idx: list[int], max_len: int):
    """Pad a batch. Head step t reads (f_t, x_{t+1}) and predicts f_{t+1} (token t+2).

    Returns tokens_next [B, T], feats_in [B, T, H], feats_target [B, T, H], loss_mask [B, T]
    with T = (longest sequence - 2)."""
    lens = [min(len(sequences[i]["input_ids"]), max_len) for i in idx]
    t = max(lens) - 2
    h = sequences[idx[0]]["features"].shape[1]
    b = len(idx)
    tokens_next = torch.zeros(b, t, dtype=torch.long)
    feats_in = torch.zeros(b, t, h)
    feats_target = torch.zeros(b, t, h)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row, (i, n) in enumerate(zip(idx, lens)):
        s = sequences[i]
        ids, f = s["input_ids"][:n].long(), s["features"][: n - 1].float()  # f: [n-1, H]
        m = n - 2  # steps t = 0 .. n-3 have a target feature f_{t+1}
        tokens_next[row, :m] = ids[1 : m + 1]
        feats_in[row, :m] = f[:m]
        feats_target[row, :m] = f[1 : m + 1]
        # the step predicts token t+2: count it when that token is part of the response
        steps = torch.arange(m)
        mask[row, :m] = steps + 2 >= s["prompt_len"]
    return tokens_next, feats_in, feats_target, mask


class HeadTrainer:
    def __init__(self, head: EagleHead, embed_weight: torch.Tensor, lm_head_t: torch.Tensor,
                 sequences: list[dict], settings: TrainSettings, out_dir: Path) -> None:
        self.head, self.settings, self.out_dir = head, settings, out_dir
        self.sequences = sequences
        self.embed_weight = embed_weight  # [V, H] frozen
        ids = head.draft_token_ids
        self.lm_head_t = lm_head_t if ids is None else lm_head_t[:, ids].contiguous()  # [H, Vd] frozen
        self.rng = random.Random(settings.seed)
        self.batches = make_batches(sequences, settings.batch_tokens, settings.max_seq_len, self.rng)
        self.total_steps = max(1, int(len(self.batches) * settings.epochs))
        self.opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95),
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
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "wall_s": self.wall_s, "history": self.history, "settings": asdict(self.settings),
                    "torch_rng": torch.get_rng_state()}, tmp)
        tmp.replace(self.state_path())

    def try_resume(self) -> bool:
        if not self.state_path().is_file():
            return False
        state = torch.load(self.state_path(), weights_only=False)
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.wall_s, self.history = state["step"], state["wall_s"], state["history"]
        torch.set_rng_state(state["torch_rng"])
        return True

    # -- one step --------------------------------------------------------------------------
    def loss(self, batch: list[int]) -> tuple[torch.Tensor, dict]:
        s = self.settings
        tokens_next, feats_in, feats_target, mask = collate(self.sequences, batch, s.max_seq_len)
        b, t, _ = feats_in.shape
        noisy = feats_in + (torch.rand_like(feats_in) * 2 - 1) * s.noise
        pred = self.head(F.embedding(tokens_next, self.embed_weight), noisy, torch.arange(t))  # [B, T, H]
        pred, target = pred[mask], feats_target[mask]  # [M, H]
        v_loss = F.smooth_l1_loss(pred, target)
        with torch.no_grad():
            p = torch.softmax(target @ self.lm_head_t, dim=-1)  # [M, Vd]
        log_q = torch.log_softmax(pred @ self.lm_head_t, dim=-1)
        p_loss = -(p * log_q).sum(-1).mean()
        acc = (log_q.argmax(-1) == p.argmax(-1)).float().mean()
        return v_loss + s.p_weight * p_loss, {"v_loss": float(v_loss.detach()), "p_loss": float(p_loss.detach()),
                                               "acc": float(acc), "tokens": int(mask.sum())}

    def train(self, progress=None, log=None) -> None:
        self.head.train()
        epoch_len = len(self.batches)
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
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.settings.grad_clip)
            self.opt.step()
            self.step += 1
            self.wall_s += time.perf_counter() - t0
            stats.update(step=self.step, lr=self.lr_at(self.step - 1), loss=float(loss.detach()))
            self.history.append(stats)
            if progress:
                progress.update(1)
                progress.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}")
            if log:
                log(stats)
            if self.step % self.settings.checkpoint_every == 0 or self.step == self.total_steps:
                self.save_state()
        self.head.eval()
