"""Stages 1+2: the target answers the training prompts; features are kept as they are computed.

Responses come from batched greedy decoding with the native target. Greedy, because the
shipped head is evaluated (and mostly used) with greedy decoding: it should learn the target's
own greedy trajectories. Once every prompt has its greedy answer, optional *sampled passes*
(``pass`` 1, 2, ...) answer chosen prompts again with temperature sampling: new contexts from
the same prompts, still written by the target, for when the prompt mix is used up. Every token's feature (post-norm hidden state) is produced by the
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

from ddspec.draft.features import fusion_input
from ddspec.errors import DdspecError
from ddspec.fileio import write_json_atomic
from ddspec.kv_cache import StaticKVCache
from ddspec.models.llama import NativeLlama, layer_forward
from ddspec.prompts import chat_prompt_ids
from ddspec.train.data import PromptRecord, length_groups


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
    batch_size: int = 32  # rows decoded together
    shard_prompts: int = 256
    capture_layers: tuple[int, ...] = ()  # also keep the residual streams entering these layers (EAGLE-3)
    fuse_layers: tuple[int, ...] = ()  # a fused head's layers: their normalised states go to layers-*.pt


PREFILL_TOKENS = 4096  # padded prompt tokens run together at most


def _layers_forward(target: NativeLlama, x: torch.Tensor, positions: torch.Tensor, attend, mask: torch.Tensor,
                    capture: tuple[int, ...] = (), local_mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All decoder layers + final norm; ``attend(layer)`` gives the layer's cache writer; the layers
    with a sliding window attend through ``local_mask`` (None: ``mask``).
    Returns the features and, with ``capture``, the residual streams entering those layers (HF
    ``hidden_states`` indices) concatenated in that order: [..., len(capture) * H], else None."""
    states: dict[int, torch.Tensor] = {}
    for li, layer in enumerate(target.layers):
        if li in capture:
            states[li] = x
        x = layer_forward(layer, x, target.arch, target.rotary, positions, attend(li), mask, local_mask=local_mask)
    return target.final_norm(x), (torch.cat([states[i] for i in capture], dim=-1) if capture else None)


class _Rows:
    """What both batchers share: how a row's next token is chosen and how its features are kept."""

    def __init__(self, target: NativeLlama, temperature: float, seed: int, capture: tuple[int, ...],
                 fuse: bool) -> None:
        """``capture``: keep the residual streams entering these layers, raw (``fuse`` False) or as
        a fused head reads them (``fuse``: each RMS-normalised, :func:`fusion_input`), in fp16."""
        self.target, self.temperature, self.capture, self.fuse = target, temperature, tuple(capture), fuse
        self.generator = torch.Generator(device=target.device).manual_seed(seed)

    def _keep(self, states: torch.Tensor) -> torch.Tensor:
        """Captured states [..., n * H] as stored: fp16, normalised per layer for a fused head."""
        if self.fuse:
            return fusion_input(list(states.split(self.target.arch.hidden_size, dim=-1))).half()
        return states.half()

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token per row: greedy, or sampled at ``temperature`` (seeded)."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        return sample_rows(logits, self.temperature, self.generator)


class ContinuousBatcher(_Rows):
    """Greedy decoding of many prompts with a fixed number of rows, refilled as answers finish.

    All rows write their newest token's KV at the same cache slot ``s``; row r's sequence
    occupies slots [start[r], s], so its positions are ``slot - start[r]`` and its mask hides
    everything before start[r]. A finished row is refilled with the next prompts (prefilled
    together, then copied in so that they end at slot s). When the slots run out, the cache is
    shifted left by the space no live row needs.
    """

    def __init__(self, target: NativeLlama, rows: int, max_prompt: int, max_new: int,
                 temperature: float = 0.0, seed: int = 0, capture: tuple[int, ...] = (), fuse: bool = False) -> None:
        super().__init__(target, temperature, seed, capture, fuse)
        a = target.arch
        self.rows, self.max_prompt, self.max_new = rows, max_prompt, max_new
        self.capacity = 2 * (max_prompt + max_new)
        self.keys = torch.zeros(a.num_layers, rows, a.num_kv_heads, self.capacity, a.head_dim,
                                dtype=target.dtype, device=target.device)  # [L, R, Hkv, T, D]
        self.values = torch.zeros_like(self.keys)
        self._scratch: torch.Tensor | None = None  # one layer's cache, for shifting
        self.start = torch.zeros(rows, dtype=torch.long, device=target.device)  # [R]
        self.s = max_prompt  # the next write slot; >= any prompt length, so prompts fit before it
        self.eos = torch.tensor(sorted(target.info.eos_token_ids), device=target.device)

    def _prefill(self, prompts: list[list[int]], rows: list[int]
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
        """Run new prompts, place their KV in ``rows`` ending at slot s. Prompts of similar length
        run together (left-padded), at most PREFILL_TOKENS padded tokens at a time, so one long
        prompt does not pad every short one to its length."""
        first = torch.zeros(len(prompts), dtype=torch.long, device=self.target.device)
        feats: list = [None] * len(prompts)
        states: list = [None] * len(prompts)
        for group in length_groups([len(x) for x in prompts], PREFILL_TOKENS):
            f, fs, ss = self._prefill_group([prompts[i] for i in group], [rows[i] for i in group])
            for j, i in enumerate(group):
                first[i], feats[i], states[i] = f[j], fs[j], ss[j]
        return first, feats, states

    def _prefill_group(self, prompts: list[list[int]], rows: list[int]
                       ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
        """Run new prompts (left-padded), place their KV in ``rows`` ending at slot s."""
        t, dev = self.target, self.target.device
        p = max(len(x) for x in prompts)
        pad = torch.tensor([p - len(x) for x in prompts], device=dev)
        tokens = torch.zeros(len(prompts), p, dtype=torch.long, device=dev)
        for i, x in enumerate(prompts):
            tokens[i, pad[i]:] = torch.tensor(x)
        idx = torch.arange(p, device=dev)
        positions = (idx.view(1, p) - pad.view(-1, 1)).clamp(min=0)
        mask = (idx.view(1, 1, p) <= idx.view(1, p, 1)) & (idx.view(1, 1, p) >= pad.view(-1, 1, 1))
        mask = (mask | torch.eye(p, dtype=torch.bool, device=dev)).unsqueeze(1)  # [B, 1, P, P]
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(li):
            def store(k, v):
                kv.append((k, v))
                return k, v
            return store

        window = t.arch.window  # a sliding window: keys at positions > p - window (the diagonal stays)
        local = None if not window else mask & ((positions.view(-1, 1, 1, p) > positions.view(-1, 1, p, 1) - window)
                                                | torch.eye(p, dtype=torch.bool, device=dev))
        h, st = _layers_forward(t, t.embed(tokens), positions, attend, mask, self.capture, local)  # [B, P, H]
        r = torch.tensor(rows, device=dev)
        for li, (k, v) in enumerate(kv):
            self.keys[li, r, :, self.s - p : self.s] = k
            self.values[li, r, :, self.s - p : self.s] = v
        self.start[r] = self.s - p + pad
        first = self._pick(t.lm_head(h[:, -1]))  # [B]
        return (first, [h[i, pad[i]:].float() for i in range(len(prompts))],
                [None if st is None else self._keep(st[i, pad[i]:]) for i in range(len(prompts))])

    def _shift(self) -> None:
        live = self.start[self.live]
        shift = int(min(int(live.min()) if live.numel() else self.s, self.s - self.max_prompt))
        n = self.s - shift
        for cache in (self.keys, self.values):  # layer by layer through one scratch buffer (no big allocations)
            for li in range(cache.shape[0]):
                if self._scratch is None or self._scratch.shape[0] != cache.shape[1]:
                    self._scratch = torch.empty_like(cache[0])
                self._scratch[:, :, :n].copy_(cache[li, :, :, shift : self.s])
                cache[li, :, :, :n].copy_(self._scratch[:, :, :n])
        self.start -= shift
        self.s = n

    def _step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token for every row at slot s; returns features [R, H] and captured states [R, n * H]."""
        t, dev, s = self.target, self.target.device, self.s
        lo = int(self.start[self.live].min())
        slots = torch.arange(lo, s + 1, device=dev)
        keep = slots.view(1, 1, 1, -1) >= self.start.view(-1, 1, 1, 1)  # [R, 1, 1, T]
        mask = torch.zeros(keep.shape, dtype=self.keys.dtype, device=dev).masked_fill_(~keep, float("-inf"))
        positions = (s - self.start).clamp(min=0).view(-1, 1)  # [R, 1]

        def attend(li):
            def store(k, v):
                self.keys[li, :, :, s] = k[:, :, 0]
                self.values[li, :, :, s] = v[:, :, 0]
                return self.keys[li, :, :, lo : s + 1], self.values[li, :, :, lo : s + 1]
            return store

        window = t.arch.window  # every row's position is its slot minus its start: the window is s - window on
        local = None if not window else mask.masked_fill(slots.view(1, 1, 1, -1) <= s - window, float("-inf"))
        h, st = _layers_forward(t, t.embed(tokens.view(-1, 1)), positions, attend, mask, self.capture, local)
        self.s += 1
        return h[:, 0], (None if st is None else st[:, 0])

    @torch.inference_mode()
    def run(self, prompts: list[list[int]]):
        """Yield (prompt index, response ids, features [P + R - 1, H], captured states [P + R - 1,
        n * H] fp16 or None) as answers finish."""
        queue = list(range(len(prompts)))[::-1]
        item = [-1] * self.rows  # prompt index per row, -1 = free
        out: dict[int, list[int]] = {}
        feats: dict[int, list[torch.Tensor]] = {}
        states: dict[int, list[torch.Tensor]] = {}
        nxt = torch.zeros(self.rows, dtype=torch.long, device=self.target.device)
        eos = set(self.eos.tolist())
        while True:
            free = [r for r in range(self.rows) if item[r] < 0]
            if free and queue:
                take = [queue.pop() for _ in free[: len(queue)]]
                rows = free[: len(take)]
                first, prompt_feats, prompt_states = self._prefill([prompts[i] for i in take], rows)
                for r, i, f0, pf, ps in zip(rows, take, first.tolist(), prompt_feats, prompt_states):
                    item[r], out[i], feats[i], states[i] = i, [f0], [pf], [ps]
                    nxt[r] = f0
            self.live = torch.tensor([r for r in range(self.rows) if item[r] >= 0], dtype=torch.long)
            finished = [r for r in self.live.tolist() if out[item[r]][-1] in eos or len(out[item[r]]) >= self.max_new]
            for r in finished:
                i = item[r]
                yield i, out.pop(i), _rows(feats.pop(i)), (_rows(states.pop(i)) if self.capture else None)
                item[r] = -1
            if finished:
                continue  # refill before stepping
            if not self.live.numel():
                return
            if not queue and 2 * self.live.numel() <= self.rows:  # draining: stop computing free rows
                # (once half of them are free: each compaction copies the whole cache)
                keep = self.live
                for j, r in enumerate(keep.tolist()):  # in place (keep is ascending): no new multi-GB tensors,
                    if r != j:                         # whose first touch costs more than the copy
                        self.keys[:, j].copy_(self.keys[:, r])
                        self.values[:, j].copy_(self.values[:, r])
                self.keys, self.values = self.keys[:, : keep.numel()], self.values[:, : keep.numel()]
                self.start, nxt = self.start[keep], nxt[keep]
                item = [item[r] for r in keep.tolist()]
                self.rows = keep.numel()
                self.live = torch.arange(self.rows)
            if self.s >= self.capacity:
                self._shift()
            h, st = self._step(nxt)
            nxt = self._pick(self.target.lm_head(h))
            # per row: views of this step's tensors, stacked once the answer is done
            toks, h_rows = nxt.tolist(), h.float().unbind(0)
            st_rows = self._keep(st).unbind(0) if st is not None else None
            for r in self.live.tolist():
                i = item[r]
                out[i].append(toks[r])
                feats[i].append(h_rows[r])
                if st_rows is not None:
                    states[i].append(st_rows[r])


class SessionBatcher(_Rows):
    """Greedy (or sampled) decoding of many prompts, each row a session of the target with a KV cache
    of its own (:meth:`NativeLlama.session`), every step one :meth:`NativeLlama.forward_many` over
    the live rows: the decoder layers run as one C call for all of them, in the mode (fp32 or int8)
    the engine decodes in, so each row's tokens and features are its own plain decoding's, bit for
    bit. Finished rows are refilled with the next prompts, each prefilled on its own.

    On the C kernels this is several times faster than :class:`ContinuousBatcher`'s torch layers (the
    same 16 rows of Qwen2.5-Coder-0.5B Q4_K_M in int8: 305 against about 70 tokens/s decoding, AMD
    EPYC family 25 model 17, 2 cores); that one serves targets whose layers do not run on the kernels.
    """

    def __init__(self, target: NativeLlama, rows: int, max_prompt: int, max_new: int,
                 temperature: float = 0.0, seed: int = 0, capture: tuple[int, ...] = (), fuse: bool = False) -> None:
        super().__init__(target, temperature, seed, capture, fuse)
        self.rows, self.max_new = rows, max_new
        self.room = max_prompt + max_new
        self.eos = set(target.info.eos_token_ids)

    def _states(self, out) -> torch.Tensor | None:
        if not self.capture:
            return None
        return self._keep(torch.cat([out.hidden_states[i] for i in self.capture], dim=-1))

    @torch.inference_mode()
    def run(self, prompts: list[list[int]]):
        """As :meth:`ContinuousBatcher.run`: yield (prompt index, response ids, features [P + R - 1, H],
        captured states [P + R - 1, n * H] fp16 or None) as answers finish."""
        t = self.target
        queue = list(range(len(prompts)))[::-1]
        free = [t.session() for _ in range(min(self.rows, len(prompts)))]
        live: list[list] = []  # [session, prompt index, response ids, feature rows, state rows]
        while queue or live:
            while free and queue:
                s, i = free.pop(), queue.pop()
                ids = prompts[i]
                s.reset(max(self.room, len(ids) + self.max_new))
                out = s.forward(torch.tensor(ids), torch.arange(len(ids)), None, self.capture, True)
                first = int(self._pick(out.logits[-1:])[0])
                live.append([s, i, [first], [out.features.float()], [self._states(out)]])
            done = [row for row in live if row[2][-1] in self.eos or len(row[2]) >= self.max_new]
            for row in done:
                s, i, resp, feats, states = row
                live.remove(row)
                free.append(s)
                yield i, resp, torch.cat(feats), (torch.cat(states) if self.capture else None)
            if done or not live:
                continue  # refill before stepping
            calls = [(s, torch.tensor(resp[-1:]), torch.tensor([s.cache_length]), None, self.capture, False)
                     for s, _, resp, _, _ in live]
            outs = t.forward_many(calls)
            picks = self._pick(torch.cat([o.logits for o in outs])).tolist()
            for row, o, tok in zip(live, outs, picks):
                row[2].append(tok)
                row[3].append(o.features.float())
                row[4].append(self._states(o))


def sample_rows(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] from softmax(logits / temperature), by inverting
    the cumulative distribution at a seeded uniform draw. ``torch.multinomial`` takes ~37 ms for
    32 rows of a 49k vocabulary on these CPUs (a quarter of a 32-row decoding step); this takes ~1 ms.
    The fp32 running sum errs by ~1e-5 in a token's probability, far below what training data notices."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    total = probs.cumsum_(dim=-1)
    u = torch.rand(total.shape[0], 1, generator=generator, device=total.device) * total[:, -1:]
    return torch.searchsorted(total, u, right=True).clamp_(max=total.shape[-1] - 1).view(-1)


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The prompt's [P, W] block followed by one [W] row per decoding step: [P + steps, W]."""
    return torch.cat([parts[0], torch.stack(parts[1:])]) if len(parts) > 1 else parts[0]


def generate_batch(target: NativeLlama, prompts: list[list[int]], max_new: int, rows: int = 16,
                   max_prompt: int | None = None, temperature: float = 0.0, seed: int = 0,
                   capture: tuple[int, ...] = (), fuse: bool = False, sessions: bool | None = None
                   ) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Answers to all ``prompts`` (greedy, or sampled at ``temperature`` > 0): (response ids,
    features of prompt + response[:-1], the ``capture`` layers' input states there or None;
    normalised as a fused head reads them with ``fuse``). ``sessions``: decode with
    :class:`SessionBatcher` (True) or :class:`ContinuousBatcher` (False); None: the first where the
    target's layers run on the C kernels."""
    kind = (SessionBatcher if target.native_layers else ContinuousBatcher) if sessions is None else (
        SessionBatcher if sessions else ContinuousBatcher)
    batcher = kind(target, rows, max_prompt or max(len(p) for p in prompts), max_new,
                   temperature=temperature, seed=seed, capture=capture, fuse=fuse)
    results: dict[int, tuple[list[int], torch.Tensor, torch.Tensor | None]] = {}
    for i, ids, f, st in batcher.run(prompts):
        results[i] = (ids, f, st)
    return [results[i] for i in range(len(prompts))]


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

    def write(self, shard: int, sequences: list[dict], response_tokens: int, wall_s: float, *, first: int,
              prompts: int, pass_id: int = 0, turn: int = 1) -> None:
        name = f"shard-{shard:05d}.pt"
        tmp = self.dir / (name + ".tmp")
        try:
            torch.save(sequences, tmp)
            os.replace(tmp, self.dir / name)
            m = self.manifest
            m["shards"][f"{shard:05d}"] = {"sequences": len(sequences), "response_tokens": response_tokens,
                                          "first": first, "prompts": prompts}
            if pass_id:
                m["shards"][f"{shard:05d}"]["pass"] = pass_id
            if turn > 1:
                m["shards"][f"{shard:05d}"]["turn"] = turn
            m["response_tokens"] += response_tokens
            m["sequences"] += len(sequences)
            m["wall_s"] += wall_s
            write_json_atomic(self.path, m)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise DdspecError(
                    f"disk full while writing {name} in {self.dir}: the {len(self.manifest['shards'])} shards "
                    "written so far are kept; free space and run the same command to resume"
                ) from e
            raise


def encode_prompts(target, records: list[PromptRecord], max_tokens: int) -> list[tuple[str, list[int]]]:
    """(id, chat-template ids) of each record (its history, then its user turn) that fits ``max_tokens``."""
    out = []
    for r in records:
        messages = [{"role": role, "content": text} for role, text in r.history]
        ids = chat_prompt_ids(target.tokenizer, messages + [{"role": "user", "content": r.text}])
        if len(ids) <= max_tokens:
            out.append((r.id, ids))
    return out


def run_generation(target, records: list[PromptRecord], out_dir: Path, settings: GenerationSettings,
                   token_budget: int, progress=None, pass_id: int = 0, temperature: float = 0.0,
                   log=None, turn: int = 1) -> dict:
    """Generate shards until the prompts or the response-token budget run out; resumable.
    ``log(line)``, when given, hears about every shard written (for runs whose progress bar
    nobody sees: a background job's log file).

    ``pass_id`` 0 is the greedy pass over ``records``; pass k >= 1 answers ``records`` again,
    sampled at ``temperature`` with a seed per shard (a rerun writes the same shard). The budget
    counts the response tokens of every pass together. ``turn`` 2 marks a greedy pass over second
    turns (records with a first exchange as history, :func:`second_turn_records`): its shards and
    sequence ids (``<first turn's id>#t2``) are told apart from the first turns'.
    """
    if pass_id and temperature <= 0:
        raise DdspecError(f"sampled pass {pass_id} needs a temperature > 0")
    if not isinstance(target, NativeLlama):
        raise DdspecError("training data generation needs the native implementation (--impl native)")
    writer = ShardWriter(out_dir, target_fingerprint(target), asdict(settings) | {"token_budget": token_budget})
    if settings.capture_layers and settings.fuse_layers:
        raise DdspecError("an EAGLE-3 head's data (--arch eagle3) and a fused head's layers (--fuse-layers) "
                          "go to different --out folders: give one of them")
    fuse = tuple(settings.fuse_layers)
    if fuse:
        from ddspec.train.layers import layer_state, write_layer_shard

        layer_state(out_dir, fuse, writer.manifest["target"])  # before any work: refuses other layers on disk
    kept = list(writer.manifest["settings"].get("capture_layers", []))
    if kept != list(settings.capture_layers):
        raise DdspecError(f"{out_dir} holds data {'with the states of layers ' + str(kept) if kept else 'without layer states'}, "
                          f"not {'layers ' + str(list(settings.capture_layers)) if settings.capture_layers else 'without'}: "
                          "use another --out folder, or the same --arch as the run that made it")
    prompts = encode_prompts(target, records, settings.max_prompt_tokens)
    every = writer.manifest["shards"]
    done = {k: e for k, e in every.items()  # this pass's own shards only
            if e.get("pass", 0) == pass_id and e.get("turn", 1) == turn and "merged_from" not in e}
    if progress and progress.n == 0:
        progress.update(writer.manifest["response_tokens"])
    # each shard records the prompt range it answered, so a resumed run may use another shard size
    legacy = writer.manifest["settings"].get("shard_prompts", settings.shard_prompts)
    first = max((e.get("first", int(k) * legacy) + e.get("prompts", legacy) for k, e in done.items()), default=0)
    index = len(every)
    while first < len(prompts) and writer.manifest["response_tokens"] < token_budget:
        shard = prompts[first: first + settings.shard_prompts]
        t0 = time.perf_counter()
        sequences, n_resp = [], 0
        results = generate_batch(target, [ids for _, ids in shard], settings.max_new_tokens,
                                 rows=settings.batch_size, max_prompt=settings.max_prompt_tokens,
                                 temperature=temperature if pass_id else 0.0, seed=1_000_003 * pass_id + index,
                                 capture=settings.capture_layers or fuse, fuse=bool(fuse))
        fused = []
        for (pid, ids), (resp, feats, states) in zip(shard, results):
            seq = ids + resp
            sid = (f"{pid}#s{pass_id}" if pass_id else pid) + (f"#t{turn}" if turn > 1 else "")
            sequences.append({"id": sid, "input_ids": torch.tensor(seq, dtype=torch.int32),
                              "prompt_len": len(ids), "features": feats[: len(seq) - 1].half()})
            if fuse:
                fused.append(states[: len(seq) - 1].clone())
            elif states is not None:
                sequences[-1]["states"] = states[: len(seq) - 1]
            n_resp += len(resp)
        if progress:
            progress.update(n_resp)
        writer.write(index, sequences, n_resp, time.perf_counter() - t0, first=first, prompts=len(shard),
                     pass_id=pass_id, turn=turn)
        if fuse:  # after the shard: a shard without its layers file is filled by `train layers`
            write_layer_shard(out_dir, f"{index:05d}", fused, fuse, writer.manifest["target"], 0.0)
        if log:
            wall = time.perf_counter() - t0
            done = writer.manifest["response_tokens"]
            kind = f"sampled pass {pass_id}" if pass_id else "greedy" + (f", turn {turn}" if turn > 1 else "")
            log(f"shard {index:05d} ({kind}, prompts {first}-"
                f"{first + len(shard) - 1} of {len(prompts)}): {n_resp} response tokens in {wall:.0f} s "
                f"({n_resp / max(wall, 1e-9):.0f}/s); {done} of the {token_budget} budget ({100 * done / token_budget:.0f}%)")
        first, index = first + len(shard), index + 1
    return writer.manifest


def second_turn_records(data_dir: Path, records: list[PromptRecord], tokenizer, limit: int) -> list[PromptRecord]:
    """Second turns for up to ``limit`` greedy first answers on disk whose prompt is one of ``records``.

    Each becomes a chat of [user: its prompt, assistant: its greedy answer, user: another prompt of
    ``records``], answered by a later greedy pass (``turn`` 2), so that the head also learns contexts
    that hold an earlier exchange, as a conversation's later turns do. The other prompt is picked by a
    hash of the first turn's id: a topic change, as users make, chosen the same way on every resume.
    First answers are taken in shard order, so a run whose greedy pass grew keeps its earlier choices."""
    if limit <= 0 or len(records) < 2:
        return []
    position = {r.id: i for i, r in enumerate(records)}
    manifest = json.loads((data_dir / "manifest.json").read_text())
    keys = [k for k, e in sorted(manifest["shards"].items())
            if not e.get("pass", 0) and e.get("turn", 1) == 1 and "merged_from" not in e]
    out: list[PromptRecord] = []
    for key in keys:
        # mmap: only the ids are read here, not the shard's features
        for seq in torch.load(data_dir / f"shard-{key}.pt", weights_only=True, mmap=True):
            i = position.get(seq["id"])
            if i is None:
                continue
            first = records[i]
            pick = int(hashlib.sha256(first.id.encode()).hexdigest(), 16) % (len(records) - 1)
            other = records[pick + (pick >= i)]  # any prompt but its own
            answer = tokenizer.decode(seq["input_ids"][seq["prompt_len"]:].tolist(), skip_special_tokens=True)
            out.append(PromptRecord(first.id, first.source, other.text,
                                    history=(("user", first.text), ("assistant", answer))))
            if len(out) >= limit:
                return out
    return out


def load_manifest_sequences(data_dir: Path) -> int:
    """How many sequences the data folder's manifest lists (a clear error when there is no data)."""
    path = data_dir / "manifest.json"
    if not path.is_file():
        raise DdspecError(f"no training data in {data_dir}: run `ddspec train data --out {data_dir.parent}` first")
    return int(json.loads(path.read_text())["sequences"])


def load_shards(data_dir: Path, keys: list[str] | None = None) -> list[dict]:
    """The sequences of every shard (or of ``keys``), in shard order."""
    if keys is None:
        keys = json.loads((data_dir / "manifest.json").read_text())["shards"]
    seqs: list[dict] = []
    for key in sorted(keys):
        seqs += torch.load(data_dir / f"shard-{key}.pt", weights_only=True)
    return seqs


def tail_shard_keys(data_dir: Path, n: int) -> list[str]:
    """The newest shards that together hold at least ``n`` sequences (all of them if they hold fewer):
    enough to read the last ``n`` sequences without loading the rest of a large run."""
    shards = json.loads((data_dir / "manifest.json").read_text())["shards"]
    keys, held = [], 0
    for key in sorted(shards, reverse=True):
        if held >= n:
            break
        keys.append(key)
        held += int(shards[key]["sequences"])
    return sorted(keys)


def check_features_match(target, features: torch.Tensor, input_ids: torch.Tensor) -> float:
    """Max abs difference between stored features and a fresh full forward (a sanity check)."""
    target.reset(len(input_ids) + 1)
    out = target.forward(input_ids.long(), torch.arange(len(input_ids)))
    return float((out.features[: features.shape[0]] - features.float()).abs().max())

