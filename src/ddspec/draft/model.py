"""A smaller model of the same tokenizer as the drafter: classic speculative decoding and its trees.

Speculative decoding began with a draft *model* (Leviathan et al. 2023, Chen et al. 2023): a small
model of the same vocabulary guesses the next tokens, the target verifies them in one forward.
Trees of its top-k guesses (SpecInfer, Sequoia) verify several continuations at once. Here the
draft model grows the same trees as a draft head (docs/design.md §2): ``chain`` drafts its greedy
continuation ``depth`` tokens deep (classic speculative decoding), ``eagle2`` the EAGLE-2 tree of its
top-k (``top_k`` children per expanded node, ``total_tokens`` verified), ``ddd`` that tree with
Dynamic Depth Decoding's stopping rule. Lossless like every method: the target verifies.

State between steps: the draft model's KV cache holds the committed tokens up to the current
root, or fewer (a chain's accepted drafts are kept; the rest are fed again at the next step, in one
forward with the new root: a *catch-up*). Tree nodes are written after the committed entries and
attend to them and to their drafted ancestors; they are dropped when the step ends.
"""

from __future__ import annotations

import math
import time

import torch

from ddspec.config import TreeConfig
from ddspec.draft.base import Drafter
from ddspec.draft.eagle import DraftSlots
from ddspec.errors import ConfigError, DdspecError
from ddspec.models.base import TargetOutput
from ddspec.tree import DraftTree, make_depth_policy
from ddspec.tree.choice import RateChoice
from ddspec.tree.host import HostCandidates
from ddspec.verify import Verdict


def check_same_vocabulary(target, draft) -> None:
    """Refuse a draft model whose token ids mean other strings than the target's: its drafts would be
    verified as other tokens (lossless still, but never accepted). Compares the two tokenizers'
    vocabularies (token -> id); the models' output sizes may differ (padded rows)."""
    name_t, name_d = target.info.name, draft.info.name
    vt = target.tokenizer.get_vocab() if hasattr(target.tokenizer, "get_vocab") else None
    vd = draft.tokenizer.get_vocab() if hasattr(draft.tokenizer, "get_vocab") else None
    if vt is None or vd is None:
        raise DdspecError(f"cannot compare the tokenizers of {name_t} and the draft model {name_d}")
    if vt != vd:
        differ = len(set(vt.items()) ^ set(vd.items()))
        raise DdspecError(f"the draft model {name_d} has another tokenizer than the target {name_t} ({len(vd)} against "
                          f"{len(vt)} tokens, {differ} entries differ): a draft model must share the target's "
                          "vocabulary; pass one of the target's family (e.g. a smaller size of it), or draft with a head")


class DraftModelDrafter(Drafter):
    def __init__(self, draft, target, tree: TreeConfig) -> None:
        """draft: a target-like model (TargetModel: its own KV cache, e.g. ``NativeLlama.session()``)
        sharing the target's tokenizer. tree: shape chain or dynamic, depth policy fixed or ddd."""
        if tree.shape == "static":
            raise ConfigError("a draft model grows chains (method chain) and dynamic trees (eagle2, ddd), not "
                              "EAGLE-1's static tree (method eagle)")
        check_same_vocabulary(target, draft)
        self.draft, self.target, self.cfg = draft, target, tree
        # ddspec: a chain as long as it pays, from the costs measured here (ChainCosts); else the tree's policy
        self.costs = ChainCosts(tree.max_depth) if tree.depth_policy == "cost" else None
        self.policy = None if self.costs is not None else make_depth_policy(tree)
        self.device = draft.device
        self.vocab = min(target.info.vocab_size, draft.info.vocab_size)  # rows past it are padding
        self.tokens: list[int] = []  # committed tokens by position, then the current root
        self._kept = 0  # draft-cache entries that hold committed tokens (the rest are fed again)
        self._long_catch_up_ms: float | None = None  # this step's catch-up, where it fed a backlog (_catch_up)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def max_tree_size(self) -> int:
        if self.costs is not None:
            return self.costs.max_depth + 1
        return self.cfg.depth + 1 if self.cfg.shape == "chain" else self.cfg.total_tokens

    def _max_slots(self) -> int:
        if self.costs is not None:
            return self.costs.max_depth
        if self.cfg.shape == "chain":
            return self.cfg.depth
        depth = self.cfg.depth if self.cfg.depth_policy == "fixed" else self.cfg.max_depth
        return depth * self.cfg.top_k

    # -- the Drafter protocol ------------------------------------------------------------
    def reset(self, max_length: int) -> None:
        self.draft.reset(max_length + self._max_slots() + 1)
        self.tokens, self._kept = [], 0

    def resume(self, max_length: int, length: int) -> None:
        self.draft.reserve(max_length + self._max_slots() + 1)
        self.tokens = self.tokens[:length]
        self._kept = min(self._kept, length)
        self.draft.truncate(self._kept)

    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        self.tokens += prompt.tolist() + [int(root)]  # the draft model reads them at its first proposal

    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        path = verdict.path.tolist()
        position = len(self.tokens) - 1  # the root's
        if self.cfg.shape == "chain":  # the drafted entries of a chain are its accepted path, as far as it is
            self._kept = min(self.draft.cache_length, position + len(path))
        else:
            self._kept = min(self._kept, position + 1)
        self.draft.truncate(self._kept)
        self.tokens += tree.tokens[path[1:]].tolist() + [int(verdict.bonus)]

    # -- drafting ------------------------------------------------------------------------
    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[..., : self.vocab].float(), dim=-1)

    @torch.inference_mode()
    def _catch_up(self, position: int) -> torch.Tensor:
        """Feed the committed tokens the draft cache lacks and the root; the root's log-probs [V].
        A catch-up longer than a drafted step leaves behind (the prompt, or the tokens of plain
        steps) is noted in ``_long_catch_up_ms``: the pricing counts it as a steady one."""
        start = self._kept
        new = torch.tensor(self.tokens[start: position + 1], dtype=torch.int64)
        t0 = time.perf_counter()
        out = self.draft.forward(new.to(self.device), torch.arange(start, position + 1, device=self.device),
                                 last_logits=True)
        if self.costs is not None and len(new) > 2:  # after a drafted step: its last draft and the bonus token
            self._long_catch_up_ms = (time.perf_counter() - t0) * 1e3
        self._kept = position + 1
        return self._logprobs(out.logits[-1])

    def propose(self, root: torch.Tensor, position: int) -> DraftTree:
        assert len(self.tokens) == position + 1 and int(root) == self.tokens[-1], "draft model out of step"
        room = min(self.target.info.max_position, self.draft.info.max_position) - 1 - position
        if room < 1:
            return DraftTree.root_only(root)
        if self.costs is not None and not self.costs.draft_now():
            return DraftTree.root_only(root)  # the draft cache stays behind: the next catch-up feeds the rest
        first = self._catch_up(position)
        if self.costs is not None:
            return self._chain(int(root), position, first, min(self.costs.max_depth, room), self.costs)
        if self.cfg.shape == "chain":
            return self._chain(int(root), position, first, min(self.cfg.depth, room))
        return self._tree(int(root), position, first, room)

    def observe_step(self, tokens: int, tree_size: int, draft_ms: float, verify_ms: float, gap_ms: float) -> None:
        if self.costs is not None:
            self.costs.observe_verify(verify_ms + gap_ms, tree_size)
            self.costs.observe_step(tokens, draft_ms + verify_ms + gap_ms, self._long_catch_up_ms)
            self._long_catch_up_ms = None

    @torch.inference_mode()
    def _chain(self, root: int, position: int, logprobs: torch.Tensor, depth: int,
               costs: "ChainCosts | None" = None) -> DraftTree:
        """The draft model's greedy continuation, ``depth`` tokens (its cache keeps all but the last);
        with ``costs``, only as far as another token pays (ChainCosts.more)."""
        drafts, scores, total = [], [], 0.0
        for level in range(depth):
            tok = int(logprobs.argmax())
            if costs is not None and not costs.more(total + float(logprobs[tok]), level):
                break
            total += float(logprobs[tok])
            drafts.append(tok)
            scores.append(total)
            if level + 1 < depth:
                pos = position + level + 1
                t0 = time.perf_counter()
                out = self.draft.forward(torch.tensor([tok], device=self.device), torch.tensor([pos], device=self.device),
                                         last_logits=True)
                logprobs = self._logprobs(out.logits[-1])
                if costs is not None:
                    costs.observe_level((time.perf_counter() - t0) * 1e3)
        if not drafts:
            return DraftTree.root_only(root)
        n = len(drafts) + 1
        return DraftTree.from_host([root] + drafts, list(range(-1, n - 1)), list(range(n)), [0.0] + scores,
                                   root_device(self.device))

    @torch.inference_mode()
    def _tree(self, root: int, position: int, logprobs: torch.Tensor, room: int) -> DraftTree:
        """EAGLE-2's dynamic tree from the draft model's top-k (tree/host.py), with the depth policy."""
        k = self.cfg.top_k
        values, ids = logprobs.topk(k)
        candidates = HostCandidates(ids.tolist(), values.tolist())
        frontier = list(range(candidates.size))
        committed = position + 1
        slots = DraftSlots(committed, torch.device("cpu"))  # the drafted nodes' ancestry in the draft cache
        slot_of: dict[int, int] = {}  # candidate -> its slot (after the committed entries)
        level = 1
        while level < room and self.policy.continue_after(level, [candidates.scores[f] for f in frontier]):
            n, base = len(frontier), slots.rows.shape[0]
            parents = [slot_of.get(candidates.parents[c], -1) for c in frontier]
            slot_of.update((c, base + j) for j, c in enumerate(frontier))
            mask = slots.add(torch.tensor(parents)).view(n, -1)
            tokens = torch.tensor([candidates.tokens[c] for c in frontier], device=self.device)
            positions = torch.full((n,), position + level, device=self.device)
            out = self.draft.forward(tokens, positions, mask.to(self.device))
            values, ids = self._logprobs(out.logits).topk(k, dim=-1)
            frontier = candidates.expand(frontier, values.tolist(), ids.tolist(), k)
            level += 1
        self.draft.truncate(committed)  # the tree's entries go; the root's stays
        tree, _ = candidates.tree(root, self.cfg.total_tokens, None, None, room, root_device(self.device))
        return tree


class ChainCosts:
    """Whether to draft at all, and how far, from costs measured on this machine (the ddspec method with a
    draft model).

    Whether: drafting costs a catch-up forward of the draft model before its first token is known,
    so the choice is made on what this drafter's own steps of each kind gave (tokens per ms of
    drafted steps against steps that verified the root alone, running sums); the worse kind is
    tried again every ``explore_every`` steps, the wait doubling up to ``max_backoff`` times while
    it stays worse. A plain step leaves the draft cache behind: the next catch-up feeds the skipped
    tokens in one forward.

    How far: a chain of k drafts is expected to give E_k = 1 + p_1 + p_1 p_2 + ... tokens for
    T_k = max(k, 1) c + V(k + 1) ms, where p_i is the draft model's probability of its i-th token
    (its confidence), c one draft forward (the catch-up gives the first token's) and V(n) a step's
    verification of n nodes with the step's other work (running means of this drafter's own steps;
    V a line fitted to the mean time of each size seen). Drafting one more token raises E / T
    exactly when its chance of being reached and accepted, P = p_1 ... p_k+1, exceeds E_k (a + dV) / T_k,
    with a = c past the first token and 0 for it: the chain stops where the draft's confidence falls
    below what a level and a verified row cost against what a step yields. Dynamic Depth Decoding's
    idea for a chain, priced by this machine's measured costs instead of a fixed threshold. Before
    the first measurements the chain is ``start`` tokens long."""

    explore_every, max_backoff, rate_decay = 8, 8, 0.9  # the draft-or-not choice (RateChoice)

    def __init__(self, max_depth: int, start: int = 4, weight: float = 0.1) -> None:
        self.max_depth, self.start, self.weight = max_depth, start, weight
        self.level_ms: float | None = None  # one draft level
        self.verify_by_size: dict[int, float] = {}  # nodes verified -> mean ms of the step's verification and rest
        self._line: tuple[float, float] | None = None  # V(n) = a + b n
        self._expected = 1.0
        self.drafting = True  # this step's choice (draft_now)
        self.choice = RateChoice(self.explore_every, 1, self.max_backoff, self.rate_decay)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def draft_now(self) -> bool:
        """Draft this step (catch the draft model up), or verify the root alone? See the class docstring."""
        self.drafting = self.choice.choose()
        return self.drafting

    def observe_step(self, tokens: int, ms: float, backlog_ms: float | None = None) -> None:
        """A step's tokens and whole time (draft, verification, the rest), for the kind it was.
        backlog_ms: the time of a catch-up that fed more than a drafted step leaves behind (the
        prompt after prefill, the tokens of the plain steps before it): drafting pays it once per
        switch, not per step, so the rates count it as one draft level (the time of the catch-up
        itself while no level was measured)."""
        if backlog_ms is not None and self.level_ms is not None:
            ms -= max(0.0, backlog_ms - self.level_ms)
        self.choice.observe(self.drafting, tokens, ms)

    def observe_level(self, ms: float) -> None:
        self.level_ms = self._mean(self.level_ms, ms)

    def observe_verify(self, ms: float, nodes: int = 1) -> None:
        self.verify_by_size[nodes] = self._mean(self.verify_by_size.get(nodes), ms)
        sizes = list(self.verify_by_size)
        if len(sizes) < 2:  # one size seen: no growth known yet
            self._line = (self.verify_by_size[sizes[0]], 0.0)
            return
        n_mean = sum(sizes) / len(sizes)
        v_mean = sum(self.verify_by_size.values()) / len(sizes)
        var = sum((n - n_mean) ** 2 for n in sizes)
        slope = max(0.0, sum((n - n_mean) * (self.verify_by_size[n] - v_mean) for n in sizes) / var)
        self._line = (v_mean - slope * n_mean, slope)

    def verify_ms(self, nodes: int) -> float:
        a, b = self._line
        return a + b * nodes

    def more(self, logp: float, level: int) -> bool:
        """Whether to draft the token at depth ``level + 1`` whose cumulative draft log-prob is ``logp``
        (the draft model caught up: the first token's log-probs came with it)."""
        if level == 0:
            self._expected = 1.0
        if level >= self.max_depth:
            return False
        p = math.exp(logp)
        if self.level_ms is None or self._line is None:
            go = level < self.start
        else:
            total_ms = max(level, 1) * self.level_ms + self.verify_ms(level + 1)
            added_ms = (self.level_ms if level else 0.0) + self._line[1]
            go = p * total_ms > added_ms * self._expected
        if go:
            self._expected += p
        return go


def root_device(device: torch.device) -> torch.device | None:
    """Where a drafted tree lives: beside the target on a GPU, host tensors on a CPU."""
    return device if device.type != "cpu" else None


_LOADED: dict[tuple, object] = {}


def load_draft_model(spec: str, target):
    """The draft model named by --draft-model (a .gguf file or a model folder), loaded once per process
    in the target's implementation, device, dtype and activations; each drafter gets a session of it
    (its own KV cache, the weights shared) where the implementation has sessions."""
    from ddspec.models.loading import load_target

    activations = getattr(target, "activations", "fp32")
    impl = "native" if hasattr(target, "session") else "auto"
    key = (str(spec), impl, str(target.device), target.dtype, activations)
    model = _LOADED.get(key) or load_target(str(spec), impl=impl, device=str(target.device), dtype=target.dtype,
                                            activations=activations)
    if not hasattr(model, "session"):  # no sessions: each drafter its own copy (a cache can serve one drafter)
        return model
    _LOADED[key] = model
    return model.session()
