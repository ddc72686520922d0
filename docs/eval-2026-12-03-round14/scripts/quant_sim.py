"""Held-out top-1 per draft depth of a head whose matmuls run on the engine's own draft copies.

    python quant_sim.py HEAD_DIR RUN_DIR N_VAL exact,q4_1a8,q8_0a8,q4_1a8:fc=q8_0a8:fuse=q8_0a8

Each variant names DDSPEC_DRAFT_WEIGHTS for every Linear of the head, optionally overridden for
modules whose name contains a key (``fc``, ``fuse``, ``mlp``, ``self_attn``, ``layers.0``). The
copies are made by ddspec.draft.packed._blocks (what PackedHead drafts on) and run by the native
kernels; with ``...a8`` the draft lm_head is the target's blocks with 8-bit activations, as
DraftLMHead runs it. The forward is the training unroll (the head fed its own outputs).
"""
import random, sys, torch
from pathlib import Path
from ddspec.cli import build_parser
from ddspec.train import pipeline
from ddspec.draft.checkpoint import load_head
from ddspec.draft.packed import _blocks
from ddspec.train.generate import load_shards, tail_shard_keys
from ddspec.train.layers import attach_layer_states
from ddspec.train.trainer import TrainSettings, make_batches, unroll

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
lm_blocks = target.lm_head_blocks(ids)
inv = torch.full((lm_head_t.shape[1],), -1, dtype=torch.long).index_put_((ids.cpu(),), torch.arange(ids.numel()))
batches = make_batches(val, s.batch_tokens, s.max_seq_len, random.Random(0))


def on_copy(mod: torch.nn.Linear, weights: str) -> None:
    """Run ``mod`` on the engine's ``weights`` copy of its matrix (plus its bias)."""
    w = _blocks({"w": mod.weight.detach()}, weights)["w"]
    mod.register_forward_hook(lambda m, inp, _: w(inp[0]).to(inp[0].dtype) + (0 if m.bias is None else m.bias))


for variant in variants:
    head = load_head(Path(head_dir), target.info)
    head.eval()
    kind, *rest = variant.split(":")
    over = dict(p.split("=") for p in rest)
    for name, mod in head.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.shape[1] % 32 == 0:
            k = next((v for key, v in over.items() if key in name), kind)
            if k != "exact":
                on_copy(mod, k)
    lm = lm_blocks.with_int8_activations() if kind.endswith("a8") and lm_blocks is not None else None
    hits, cnt = torch.zeros(5), torch.zeros(5)
    with torch.no_grad():
        for batch in batches:
            preds, tgt, mask, index = unroll(head, target.embed_tokens, val, batch, s, noise=False, n_passes=5, held_out=True)
            want = inv[(tgt @ lm_head_t).argmax(-1)]
            for k, pred in enumerate(preds):
                rows = (index >= k) & (want >= 0)  # pass k + 1 has no chain before index k
                x = head.logits_input(pred[mask][rows]).float()
                logits = lm(x) if lm is not None else x @ draft_lm_t
                w = want[rows]
                hits[k] += float((logits.argmax(-1) == w).sum())
                cnt[k] += w.numel()
    print(variant, " ".join(f"{h / c:.4f}" for h, c in zip(hits, cnt)), f"mean {float((hits / cnt).mean()):.4f}", flush=True)
