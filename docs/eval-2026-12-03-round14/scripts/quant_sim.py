"""Held-out top-1 per depth of a head under simulated draft numerics (Q4_1 / Q8_0 weights, 8-bit activations)."""
import random, sys, torch
from pathlib import Path
from ddspec.cli import build_parser
from ddspec.train import pipeline
from ddspec.draft.checkpoint import load_head
from ddspec.train.generate import load_shards, tail_shard_keys
from ddspec.train.layers import attach_layer_states
from ddspec.train.trainer import TrainSettings, make_batches, unroll, draft_logits

def q4_1(w):
    o, i = w.shape; b = w.view(o, i // 32, 32)
    mn, mx = b.min(-1, keepdim=True).values, b.max(-1, keepdim=True).values
    d = ((mx - mn) / 15).half().float(); m = mn.half().float()
    q = torch.where(d > 0, ((b - m) / d).round().clamp(0, 15), torch.zeros_like(b))
    return (m + q * d).view(o, i)

def q8_0(w):
    o, i = w.shape; b = w.view(o, i // 32, 32)
    d = (b.abs().max(-1, keepdim=True).values / 127).half().float()
    q = torch.where(d > 0, (b / d).round().clamp(-127, 127), torch.zeros_like(b))
    return (q * d).view(*w.shape)

def a8(x):
    shp = x.shape; b = x.reshape(-1, shp[-1] // 32, 32)
    d = b.abs().max(-1, keepdim=True).values / 127
    q = torch.where(d > 0, (b / d).round(), torch.zeros_like(b))
    return (q * d).view(shp)

head_dir, data_run, n_val = sys.argv[1], sys.argv[2], int(sys.argv[3])
variants = sys.argv[4].split(",")
args = build_parser().parse_args(["train", "calibrate", "--out", data_run])
out, target = pipeline._setup(args)
keys = tail_shard_keys(out / "data", n_val)
seqs = load_shards(out / "data", keys)
base = load_head(Path(head_dir), target.info)
attach_layer_states(seqs, out / "data", base.fuse_layers, keys)
val = seqs[-n_val:]
s = TrainSettings(batch_tokens=4096)
lm_head_t = target.lm_head_weight_t()
ids = base.draft_token_ids
draft_lm_t = lm_head_t[:, ids]
inv = torch.full((lm_head_t.shape[1],), -1, dtype=torch.long).index_put_((ids.cpu(),), torch.arange(ids.numel()))
batches = make_batches(val, s.batch_tokens, s.max_seq_len, random.Random(0))
for variant in variants:  # e.g. exact, q4_1a8, q4_1a8:fc=q8_0, ...
    head = load_head(Path(head_dir), target.info); head.eval()
    parts = variant.split(":"); kind = parts[0]; over = dict(p.split("=") for p in parts[1:])
    hooks = []
    if kind != "exact":
        for name, mod in head.named_modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight.shape[1] % 32 == 0:
                k = next((v for key, v in over.items() if key in name), kind)
                if k == "exact":
                    continue
                with torch.no_grad():
                    mod.weight.copy_((q4_1 if k.startswith("q4_1") else q8_0)(mod.weight.float()).to(mod.weight.dtype))
                if k.endswith("a8"):
                    hooks.append(mod.register_forward_pre_hook(lambda m, inp: (a8(inp[0]),)))
    lm = draft_lm_t
    hits = torch.zeros(5); cnt = torch.zeros(5)
    with torch.no_grad():
        for batch in batches:
            preds, tgt, mask, index = unroll(head, target.embed_tokens, val, batch, s, noise=False, n_passes=5, held_out=True)
            want = inv[(tgt @ lm_head_t).argmax(-1)]
            for k, pred in enumerate(preds):
                rows = (index >= k) & (want >= 0)
                x = head.logits_input(pred[mask][rows])
                if kind.endswith("a8") and over.get("lm") != "exact":
                    x = a8(x)
                logits = x @ lm
                w = want[rows]
                hits[k] += float((logits.argmax(-1) == w).sum()); cnt[k] += w.numel()
    print(variant, " ".join(f"{h/c:.4f}" for h, c in zip(hits, cnt)), f"mean {float((hits/cnt).mean()):.4f}", flush=True)
