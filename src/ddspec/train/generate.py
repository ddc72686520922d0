"""Stages 1+2: the target answers the training prompts; features are kept as they are computed.

Responses come from batched greedy decoding with the native target. Greedy, because the
shipped head is evaluated (and mostly used) with greedy decoding: it should learn the target's
own greedy trajectories. Every token's feature (post-norm hidden state) is produced by the
forward that processes it, so the prompt's features come from the batched prefill and each
response token's from its decoding step: one pass gives ids, loss mask and features (the last
response token is never run, so sequences keep ``len - 1`` usable features). This halves the
CPU cost of a separate feature pass; features match a full forward to ~1e-5.

Output: ``shard-NNNNN.pt`` files (written to a temp name, then renamed) each holding a list of
sequences ``{id, input_ids [T] int32, prompt_len, features [T-1, H] fp16}``, and
``manifest.json`` (target fingerprint, settings, shards done, token counts). A restart skips
the shards already written; a manifest from another target is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ddspec.errors import DdspecError
from ddspec.kv_cache import StaticKVCache
from ddspec.models.llama import NativeLlama, layer_forward
from ddspec.prompts import chat_prompt_ids
from ddspec.train.data import PromptRecord


def target_fingerprint(target) -> str:
    """Name + config + a few weight statistics: identifies the target a dataset came from."""
    h = hashlib.sha256(json.dumps(target.hf_config, sort_keys=True, default=str).encode())
    w = target.lm_head_weight_t()
    h.update(f"{float(w[:, :64].double().sum()):.6e}:{float(w.double().abs().mean()):.6e}".encode())
    return f"{target.info.name}:{h.hexdigest()[:16]}"


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    max_prompt_tokens: int = 384
    max_new_tokens: int = 256
    batch_size: int = 16
    shard_prompts: int = 64


@torch.inference_mode()
def generate_batch(target: NativeLlama, prompts: list[list[int]], max_new: int
                   ) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers to ``prompts`` (left-padded batch). Returns per prompt (response ids,
    features of prompt + response[:-1] as [P + R - 1, H] fp32)."""
    b = len(prompts)
    p_max = max(len(p) for p in prompts)
    a, dev = target.arch, target.device
    pad = torch.tensor([p_max - len(p) for p in prompts], device=dev)  # [B]
    tokens = torch.zeros(b, p_max, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        tokens[i, pad[i]:] = torch.tensor(p)
    cache = StaticKVCache(a.num_layers, a.num_kv_heads, a.head_dim, p_max + max_new, batch=b,
                          dtype=target.dtype, device=dev)
    eos = torch.tensor(sorted(target.info.eos_token_ids), device=dev)
    rows = torch.arange(b, device=dev)  # original index of each live row
    slots = torch.arange(p_max + max_new, device=dev)
    out_ids: list[list[int]] = [[] for _ in range(b)]
    feats: list[list[torch.Tensor]] = [[] for _ in range(b)]

    def step(x_tokens: torch.Tensor, start: int) -> torch.Tensor:
        n = x_tokens.shape[1]
        end = start + n
        q_slots = slots[start:end]
        positions = (q_slots.view(1, n) - pad[rows].view(-1, 1)).clamp(min=0)  # [B', N]
        visible = slots[:end].view(1, 1, end) >= pad[rows].view(-1, 1, 1)  # [B', 1, T]
        causal = slots[:end].view(1, end) <= q_slots.view(n, 1)  # [N, T]
        mask = (visible & causal.view(1, n, end)) | (slots[:end] == q_slots.view(n, 1)).view(1, n, end)
        x = target.embed(x_tokens)  # [B', N, H]
        for li, layer in enumerate(target.layers):
            x = layer_forward(layer, x, a, target.rotary, positions,
                              lambda k, v, li=li: cache.write(li, k, v), mask.unsqueeze(1))
        cache.advance(n)
        return target.final_norm(x)  # [B', N, H]

    h = step(tokens, 0)
    for i in range(b):
        feats[i].append(h[i, pad[i]:].float())
    nxt = target.lm_head(h[:, -1]).argmax(-1)  # [B]
    for t in range(max_new):
        for r, tok in zip(rows.tolist(), nxt.tolist()):
            out_ids[r].append(tok)
        done = torch.isin(nxt, eos)
        if t == max_new - 1:
            break
        if bool(done.any()):
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            rows, nxt = rows[keep], nxt[keep]
            cache.keys, cache.values = cache.keys[:, keep], cache.values[:, keep]
        h = step(nxt.view(-1, 1), cache.length)
        for j, r in enumerate(rows.tolist()):
            feats[r].append(h[j].float())
        nxt = target.lm_head(h[:, 0]).argmax(-1)
    return [(out_ids[i], torch.cat(feats[i])) for i in range(b)]


class ShardWriter:
    """Atomic shard files and a manifest that records what is done."""

    def __init__(self, out_dir: Path, fingerprint: str, settings: dict) -> None:
        self.dir = out_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "manifest.json"
        if self.path.is_file():
            self.manifest = json.loads(self.path.read_text())
            theirs = self.manifest.get("target")
            if theirs != fingerprint:
                raise DdspecError(
                    f"{out_dir} holds data from target {theirs}, not from {fingerprint}: "
                    "use another --out folder for this target"
                )
        else:
            self.manifest = {"target": fingerprint, "settings": settings, "shards": {}, "response_tokens": 0,
                             "sequences": 0, "wall_s": 0.0}

    def done(self, shard: int) -> bool:
        return f"{shard:05d}" in self.manifest["shards"] and (self.dir / f"shard-{shard:05d}.pt").is_file()

    def write(self, shard: int, sequences: list[dict], response_tokens: int, wall_s: float) -> None:
        name = f"shard-{shard:05d}.pt"
        tmp = self.dir / (name + ".tmp")
        try:
            torch.save(sequences, tmp)
            os.replace(tmp, self.dir / name)
            m = self.manifest
            m["shards"][f"{shard:05d}"] = {"sequences": len(sequences), "response_tokens": response_tokens}
            m["response_tokens"] += response_tokens
            m["sequences"] += len(sequences)
            m["wall_s"] += wall_s
            mtmp = self.path.with_suffix(".tmp")
            mtmp.write_text(json.dumps(m, indent=1))
            os.replace(mtmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise DdspecError(
                    f"disk full while writing {name} in {self.dir}: the {len(self.manifest['shards'])} shards "
                    "written so far are kept; free space and run the same command to resume"
                ) from e
            raise


def encode_prompts(target, records: list[PromptRecord], max_tokens: int) -> list[tuple[str, list[int]]]:
    out = []
    for r in records:
        ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": r.text}])
        if len(ids) <= max_tokens:
            out.append((r.id, ids))
    return out


def run_generation(target, records: list[PromptRecord], out_dir: Path, settings: GenerationSettings,
                   token_budget: int, progress=None) -> dict:
    """Generate shards until the prompts or the response-token budget run out; resumable."""
    if not isinstance(target, NativeLlama):
        raise DdspecError("training data generation needs the native implementation (--impl native)")
    writer = ShardWriter(out_dir, target_fingerprint(target), asdict(settings) | {"token_budget": token_budget})
    prompts = encode_prompts(target, records, settings.max_prompt_tokens)
    shards = [prompts[i: i + settings.shard_prompts] for i in range(0, len(prompts), settings.shard_prompts)]
    for s, shard in enumerate(shards):
        if writer.manifest["response_tokens"] >= token_budget:
            break
        if writer.done(s):
            if progress:
                progress.update(writer.manifest["shards"][f"{s:05d}"]["response_tokens"])
            continue
        t0 = time.perf_counter()
        sequences, n_resp = [], 0
        order = sorted(range(len(shard)), key=lambda i: len(shard[i][1]))  # similar lengths per batch
        for j in range(0, len(order), settings.batch_size):
            batch = [shard[i] for i in order[j: j + settings.batch_size]]
            results = generate_batch(target, [ids for _, ids in batch], settings.max_new_tokens)
            for (pid, ids), (resp, feats) in zip(batch, results):
                seq = ids + resp
                sequences.append({"id": pid, "input_ids": torch.tensor(seq, dtype=torch.int32),
                                  "prompt_len": len(ids), "features": feats[: len(seq) - 1].half()})
                n_resp += len(resp)
                if progress:
                    progress.update(len(resp))
        writer.write(s, sequences, n_resp, time.perf_counter() - t0)
    return writer.manifest


def load_shards(data_dir: Path) -> list[dict]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    seqs: list[dict] = []
    for key in sorted(manifest["shards"]):
        seqs += torch.load(data_dir / f"shard-{key}.pt", weights_only=True)
    return seqs


def check_features_match(target, features: torch.Tensor, input_ids: torch.Tensor) -> float:
    """Max abs difference between stored features and a fresh full forward (a sanity check)."""
    target.reset(len(input_ids) + 1)
    out = target.forward(input_ids.long(), torch.arange(len(input_ids)))
    return float((out.features[: features.shape[0]] - features.float()).abs().max())

