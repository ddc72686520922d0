"""Per-depth greedy draft temperature: NLL of the target argmax at each depth over a grid."""
import random, sys, json, torch
from pathlib import Path
from ddspec.cli import build_parser
from ddspec.train import pipeline
from ddspec.draft.checkpoint import load_head
from ddspec.train.generate import load_shards, tail_shard_keys
from ddspec.train.layers import attach_layer_states
from ddspec.train.trainer import (TrainSettings, make_batches, unroll, draft_logits, argmax_nll, TEMPERATURE_GRID, best_temperature)

head_dir, data_run, n_val, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
args = build_parser().parse_args(["train", "calibrate", "--out", data_run])
out, target = pipeline._setup(args)
head = load_head(Path(head_dir), target.info)
keys = tail_shard_keys(out / "data", n_val)
seqs = load_shards(out / "data", keys)
attach_layer_states(seqs, out / "data", head.fuse_layers, keys)
val = seqs[-n_val:]
s = TrainSettings(batch_tokens=4096)
head.eval()
lm_head_t = target.lm_head_weight_t()
ids = head.draft_token_ids
draft_lm_t = lm_head_t[:, ids]
vocab = lm_head_t.shape[1]
inv = torch.full((vocab,), -1, dtype=torch.long).index_put_((ids.cpu(),), torch.arange(ids.numel()))
grid = TEMPERATURE_GRID
inv_t = torch.tensor(grid, dtype=torch.float32).reciprocal()
nll = torch.zeros(passes, len(grid), dtype=torch.float64)
cnt = torch.zeros(passes); hits = torch.zeros(passes)
with torch.no_grad():
    for batch in make_batches(val, s.batch_tokens, s.max_seq_len, random.Random(0)):
        preds, tgt, mask, index = unroll(head, target.embed_tokens, val, batch, s, noise=False, n_passes=passes, held_out=True)
        want = inv[(tgt @ lm_head_t).argmax(-1)]
        for k, pred in enumerate(preds):
            rows = (index >= k) & (want >= 0)
            logits = draft_logits(head, pred[mask][rows], draft_lm_t)
            w = want[rows]
            hits[k] += float((logits.argmax(-1) == w).sum()); cnt[k] += w.numel()
            nll[k] += argmax_nll(logits, w, inv_t)
for k in range(passes):
    m = (nll[k] / cnt[k]).tolist()
    print(f"depth {k+1}: n {int(cnt[k])} top1 {hits[k]/cnt[k]:.4f} best T {best_temperature(grid, m):.3f}  nll@T=1 {m[grid.index(1.0)]:.4f} min {min(m):.4f}")
tot = (nll.sum(0) / cnt.sum()).tolist()
print("pooled best T", best_temperature(grid, tot))
