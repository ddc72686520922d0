"""The EAGLE drafter: grows chain, static (EAGLE-1) or dynamic (EAGLE-2 / DDD) trees with a head.

State between steps: the head's KV cache holds one entry per committed position, computed from
the target's *true* features (docs/design.md §2.6), and ``root_hidden`` is the head's prediction
f̂ at the current root, whose lm_head gives the root's children. During drafting, entries for
tree nodes are appended after the committed ones; ``observe`` drops them and recomputes the
newly committed positions from the verification forward's features. With prefix reuse
(``resume``) the entries of a kept prefix stay and ``prefill`` computes only the positions after it.

Head input pairs: the entry at position t reads (f_t, token_{t+1}). A tree node at depth L
(token at position root + L) is run as (f̂ of its parent, its token) at position root + L - 1,
attending to the committed entries and to its drafted ancestors.
"""

from __future__ import annotations

import torch

from ddspec import native as native_lib
from ddspec.config import SamplingConfig, TreeConfig
from ddspec.draft.base import Drafter
from ddspec.draft.context_vocab import ContextVocab
from ddspec.draft.head import EagleHead
from ddspec.draft.packed import DraftingForward, DraftLMHead, draft_weights
from ddspec.errors import ConfigError
from ddspec.models.base import TargetOutput
from ddspec.tree.cost import CostAwarePolicy
from ddspec.tree.host import HostCandidates
from ddspec.tree import (
    DEFAULT_STATIC_PATHS,
    DraftTree,
    StaticShape,
    expand_level,
    expand_root,
    fill_level,
    make_depth_policy,
    rerank,
)
from ddspec.verify import Verdict


def head_draft_temperature(head) -> float:
    """The temperature fitted for a head's greedy tree scores (``ddspec train calibrate``), from its
    config's ``ddspec.draft_temperature.greedy``; 1 for heads without one (e.g. published heads)."""
    entry = head.config.get("ddspec", {}).get("draft_temperature") or {}
    t = entry.get("greedy", 1.0) if isinstance(entry, dict) else 1.0
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 10:
        raise ConfigError(f"the head's config has ddspec.draft_temperature.greedy = {t!r}: it must be a number in "
                          "(0, 10]; delete the entry (the raw head) or fit it again with `ddspec train calibrate`")
    return float(t)


class DraftSlots:
    """Ancestry of the tree nodes written to the head cache during one propose()."""

    def __init__(self, committed: int, device: torch.device) -> None:
        self.committed, self.device = committed, device
        self.rows = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [S, S] ancestors-or-self

    def add(self, parent_slots: torch.Tensor) -> torch.Tensor:
        """Register n new slots whose parents sit at ``parent_slots`` [n] (-1 = the root).

        Returns their attention mask over (committed + all slots) as [1, 1, n, committed + S].
        """
        n, s = parent_slots.numel(), self.rows.shape[0]
        rows = torch.zeros(n, s + n, dtype=torch.bool, device=self.device)
        has_parent = parent_slots >= 0
        if s:
            rows[:, :s] = self.rows[parent_slots.clamp(min=0)] & has_parent.view(n, 1)
        rows[:, s:] = torch.eye(n, dtype=torch.bool, device=self.device)
        self.rows = torch.cat([torch.nn.functional.pad(self.rows, (0, n)), rows])
        prefix = torch.ones(n, self.committed, dtype=torch.bool, device=self.device)
        return torch.cat([prefix, rows], dim=1).view(1, 1, n, -1)


def drafting_parts(head, target, draft_ids: torch.Tensor | None,
                   shared: dict | None = None) -> tuple[DraftingForward, DraftLMHead]:
    """The head's drafting forward and the draft lm_head [Vd, H] for ``target``: copies of their
    weights planned for the kernels, which hold no sequence's state (each drafter passes its own
    cache). With ``shared`` (one dict per head and model, e.g. a server's for its slots) they are
    built once and handed to every drafter that passes the same dict: sixteen slots would otherwise
    hold sixteen copies and take sixteen times as long to start. Rebuilt when the head object or the
    DDSPEC_DRAFT_WEIGHTS setting differs from the one they were built for."""
    key = ("drafting", draft_weights())
    entry = None if shared is None else shared.get(key)
    if entry is not None and entry[0] is head:
        return entry[1], entry[2]
    packed = head.drafting_forward()
    blocks = target.lm_head_blocks(draft_ids) if hasattr(target, "lm_head_blocks") else None
    lm_head = DraftLMHead(head.draft_lm_head_weight(target, draft_ids), blocks, packed.weights)
    if shared is not None:
        shared[key] = (head, packed, lm_head)
    return packed, lm_head


class EagleDrafter(Drafter):
    def __init__(self, head: EagleHead, target, tree: TreeConfig, cost_policy=None, lookup=None,
                 shared: dict | None = None) -> None:
        """head: an EagleHead (EAGLE-1/2, fused) or an Eagle3Head; both offer config, hidden_layers,
        committed_features, drafting_forward, draft_lm_head_weight, logits_input and
        shares_target_lm_head.
        lookup: a LookupDrafter whose chain (if any) a plain step of the cost policy verifies
        instead of the root alone: drafts that cost nothing to make.
        shared: a dict that drafters of one head on one model (its sessions: a batch's slots) pass
        alike, so that they build the head's kernel-planned weights once (see drafting_parts)."""
        if head.hidden_size != target.info.hidden_size:
            raise ConfigError(f"head hidden size {head.hidden_size} != target hidden size {target.info.hidden_size}")
        vocab = target.info.vocab_size
        if tree.shape == "dynamic" and tree.top_k > vocab:
            raise ConfigError(f"top_k (--tree-top-k) {tree.top_k} is larger than the vocabulary ({vocab})")
        deepest = max(head.hidden_layers, default=0)
        if deepest > target.info.num_layers:
            raise ConfigError(f"the draft head reads target layer {deepest} (HF hidden_states index), but the "
                              f"target has {target.info.num_layers} layers (indices 0..{target.info.num_layers}): "
                              "this head was trained for another model; pass the head made for this target")
        self.head, self.target, self.cfg = head, target, tree
        self.hidden_layers = head.hidden_layers  # the target layers a fused / EAGLE-3 head reads (asked of each forward)
        self.device = target.device
        self.embed = head.embed_tokens if hasattr(head, "embed_tokens") else target.embed
        ids = head.draft_token_ids
        self.draft_ids = None if ids is None else ids.to(self.device)  # [Vd] target ids
        self._draft_id_list: list[int] | None = None  # the same, listed on the host when first needed
        draft_vocab = target.info.vocab_size if ids is None else ids.numel()
        if tree.shape == "dynamic" and tree.top_k > draft_vocab:
            raise ConfigError(f"top_k (--tree-top-k) {tree.top_k} exceeds the draft vocabulary ({draft_vocab})")
        # the drafting fast path: the head's layers and the draft lm_head on kernel-planned weights
        self.packed, self.lm_head = drafting_parts(head, target, self.draft_ids, shared)
        self._features = self.packed.committed_features
        # how the head's matmul weights are held (packed.DRAFT_WEIGHTS): part of what a draft level costs
        self.draft_weights: str = self.packed.weights
        # the context's tokens beside a reduced draft vocabulary, where the head's logits are the target's lm_head
        self.context = None
        if self.draft_ids is not None and tree.context_vocab and head.shares_target_lm_head:
            self.context = ContextVocab(self.draft_ids, target.lm_head_weight_t().t(), tree.context_vocab)
        self.head_temperature = head_draft_temperature(head)  # fitted for greedy decoding; 1 when absent
        self.temperature = self.greedy_temperature  # until score_for() says otherwise
        self.static = StaticShape.from_paths(tree.static_paths or DEFAULT_STATIC_PATHS) if tree.shape == "static" else None
        if (tree.depth_policy == "cost") != (cost_policy is not None):
            raise ConfigError("the cost depth policy and a CostAwarePolicy go together")
        self.cost_policy = cost_policy  # kept across steps: it learns acceptance online
        self.lookup = lookup
        if lookup is not None and lookup.max_position is None:  # its chains must stay in the window too
            lookup.max_position = target.info.max_position
        self.cache = None
        self.root_hidden: torch.Tensor | None = None  # [H] f̂ at the root
        self.last_policy = None
        # committed positions whose head entries wait for the next drafted step (the cost-aware
        # method's plain steps skip the head): a forward's features and hidden states, the rows of
        # them committed (None: all), and the next tokens ([n], or a plain step's next root []), which
        # the context vocabulary has not seen yet when ``unseen`` (a plain step leaves all of it to
        # the catch-up: it only records, a few microseconds per sequence and step)
        self._pending: list[tuple[torch.Tensor, dict, torch.Tensor | None, torch.Tensor, bool]] = []
        self._plain_step = False
        self._caught_up = False  # this step's draft time includes catching the head up
        self._head_nodes = 1  # nodes of this step's tree that the head drafted (a lookup chain may follow)
        self._chain: list[int] = []  # the lookup's chain for this step (propose)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def max_tree_size(self) -> int:
        if self.static is not None:
            size = self.static.size
        elif self.cfg.shape == "chain":
            size = self.cfg.depth + 1
        else:
            size = self.cfg.total_tokens
        return size if self.lookup is None else size + self.lookup.max_drafts  # a drafted tree may carry its chain

    def _max_draft_slots(self) -> int:
        if self.static is not None:
            return sum(len(level.expand) for level in self.static.levels)
        depth = self.cfg.depth if self.cfg.depth_policy == "fixed" else self.cfg.max_depth
        width = 1 if self.cfg.shape == "chain" else self.cfg.top_k
        return depth * width

    # -- head calls ----------------------------------------------------------------------
    def score_for(self, sampling: SamplingConfig) -> None:
        """Set the temperature the tree's scores use for this generation (the engine calls it).

        Greedy decoding accepts a drafted token when it is the target's argmax, which happens more
        often than the head's probability for it says: the head learnt the target's whole
        distribution. Its logits divided by a fitted T < 1 forecast acceptance better, and the
        tree (EAGLE-2's reranking, DDD's stopping rule, the cost-aware forecasts) is grown from
        those forecasts. Sampling accepts a token with about the target's probability of it: T = 1.
        (A seeded sample needs nothing here: its tokens do not depend on the trees, docs/design.md
        §2.5, so the cost-aware policy keeps its memory and goes on learning under a seed.)"""
        self.temperature = self.greedy_temperature if sampling.greedy else 1.0

    @property
    def greedy_temperature(self) -> float:
        """--draft-temperature when given, else the head's fitted value."""
        return self.cfg.draft_temperature or self.head_temperature

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probs over the draft vocabulary (the tree's scores): hidden [n, H] -> [n, Vd]
        (Vd + E with E context tokens added, see context_vocab.py)."""
        logits, extra = self._draft_logits(hidden)
        logits = logits.float()
        if extra is not None:
            logits = torch.cat([logits, extra], dim=-1)
        if self.temperature != 1.0:
            logits = logits * (1.0 / self.temperature)
        return torch.log_softmax(logits, dim=-1)

    def _draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft lm_head's logits of hidden [n, H] and the context tokens' (None without any)."""
        x = self.head.logits_input(hidden)
        extra = self.context.logits(x) if self.context is not None and self.context.size else None
        return self.lm_head(x), extra

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """Target id of each draft id (None: the full vocabulary, draft id = target id)."""
        return self.draft_ids if self.context is None else self.context.all_ids

    def to_target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = self.vocab_ids
        return tokens if ids is None else ids[tokens]

    def _see(self, tokens: torch.Tensor) -> None:
        """Committed context tokens, position after position (the prompt, then each step's accepted
        tokens and bonus)."""
        if self.context is not None:
            self.context.add(tokens)

    @torch.inference_mode()
    def _run(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Append head entries for (features [n, H], tokens [n]) and return f̂ [n, H]."""
        n = tokens.numel()
        embeds = self.embed(tokens).view(1, n, -1)
        return self.packed(embeds, features.view(1, n, -1).to(embeds.dtype), positions, mask, self.cache)[0]

    def _commit_entries(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Head entries for committed positions: pairs (f_t, token_{t+1}), causal."""
        start, n = self.cache.length, next_tokens.numel()
        mask = None
        if n > 1:  # causal: row i sees the committed entries and the new ones up to its own
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril_(start).view(1, 1, n, -1)
        hidden = self._run(features, next_tokens, torch.arange(start, start + n, device=self.device), mask)
        self.cache.pending = 0
        self.root_hidden = hidden[-1]

    # -- the Drafter protocol ------------------------------------------------------------
    def reset(self, max_length: int) -> None:
        need = max_length + self._max_draft_slots()
        if self.cache is None or self.cache.max_length < need:
            self.cache = self.head.new_cache(need)
        self.cache.truncate(0)
        self._committed = 0
        if self.context is not None:
            self.context.clear()
        self._pending.clear()
        self._plain_step = False
        if self.lookup is not None:
            self.lookup.reset(max_length)

    def resume(self, max_length: int, length: int) -> None:
        # the kept prefix may include plain steps' positions: the head takes in those, not the rest
        # (a server's next request keeps a prefix of the last one's sequence, often none of it)
        covered, needed = self.cache.length, 0
        for entry in self._pending:
            if covered >= length:
                break
            covered, needed = covered + entry[3].numel(), needed + 1
        del self._pending[needed:]
        self._flush_pending()
        self.cache.reserve(max_length + self._max_draft_slots())
        self.cache.truncate(length)
        self._committed = length
        if self.context is not None:
            self.context.keep(length)
        if self.lookup is not None:
            self.lookup.resume(max_length, length)

    @torch.inference_mode()
    def _committed_features(self, target_out: TargetOutput, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input features at committed positions (``rows`` of the forward; None = all)."""
        return self._features(target_out, rows)

    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        if self.lookup is not None:
            self.lookup.prefill(prompt, target_out, root)
        nxt = torch.cat([prompt[1:].to(self.device), root.view(1).to(self.device)])
        self._see(torch.cat([prompt[:1].to(self.device), nxt]))
        if self.cost_policy is not None:  # the head takes the prompt in when it first drafts: on a machine
            # where drafting does not pay, the policy keeps to plain steps and the head never runs
            self._pending.append((target_out.features, dict(target_out.hidden_states), None, nxt, False))
            return
        self._commit_entries(self._committed_features(target_out), nxt)

    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        if self.lookup is not None:
            self.lookup.observe(tree, verdict, target_out)
        if self._plain_step:  # the head did not draft: keep its input for the next drafted step
            if self.cost_policy is not None and tree.size > 1:  # it verified a lookup chain
                self.cost_policy.observe_chain(self.lookup.order, tree.size - 1, verdict.accepted)
            # the raw forward only (not its logits): the committed rows are picked, the head's input
            # features computed and the context vocabulary told, for all pending steps at once
            if tree.size > 1:  # (a lookup chain's accepted tokens too)
                path = verdict.path
                nxt = torch.cat([tree.tokens[path[1:]], verdict.bonus.view(1)])
            else:  # the root's row alone: the forward's only row
                path, nxt = None, verdict.bonus
            self._pending.append((target_out.features, dict(target_out.hidden_states), path, nxt, True))
            return
        if self.cost_policy is not None and tree.size > 1:
            n = self._head_nodes  # the acceptance map learns from the head's nodes only
            path = verdict.path.tolist()  # host lists: a handful of numbers (a tensor op each cost more)
            on_path = set(path)
            self.cost_policy.observe(tree.scores[1:n].tolist(), [i in on_path for i in range(1, n)])
            if tree.size > n:
                self.cost_policy.observe_graft(sum(1 for i in path if i >= n))
        self.cache.truncate(self.committed)
        path = verdict.path
        nxt = torch.cat([tree.tokens[path[1:]], verdict.bonus.view(1)])
        self._see(nxt)
        self._commit_entries(self._committed_features(target_out, path), nxt)

    def observe_step(self, tokens: int, tree_size: int, draft_ms: float, verify_ms: float, gap_ms: float) -> None:
        """The engine's timing of the step just finished (the cost-aware method learns from it)."""
        if self.cost_policy is not None:  # a catch-up forward is not a draft level: keep it out of the draft costs
            self.cost_policy.observe_step(tokens, tree_size, None if self._caught_up else draft_ms, verify_ms, gap_ms,
                                          phase_ms=draft_ms)

    @property
    def prediction(self) -> tuple[float, float] | None:
        """(expected tokens, expected ms) of the last proposed step, for the cost-aware method."""
        return None if self.cost_policy is None else self.cost_policy.prediction

    def _flush_pending(self) -> None:
        """Catch the head up over the plain steps' positions, in one forward."""
        self._caught_up = bool(self._pending)
        if self._pending:
            features, hidden, picks, tokens, unseen = zip(*self._pending)
            self._pending.clear()
            tokens = [t.reshape(-1) for t in tokens]

            def rows(x: torch.Tensor, pick: torch.Tensor | None) -> torch.Tensor:
                return x if pick is None else x[pick]

            new = [t for t, u in zip(tokens, unseen) if u]
            if new:
                self._see(torch.cat(new))
            committed = TargetOutput(None, torch.cat([rows(f, p) for f, p in zip(features, picks)]),
                                     {i: torch.cat([rows(h[i], p) for h, p in zip(hidden, picks)]) for i in hidden[0]})
            self._commit_entries(self._committed_features(committed), torch.cat(tokens))

    @property
    def committed(self) -> int:
        return self._committed

    def may_draft(self) -> bool:
        """Whether a drafted step could pay at the coming step's prices (its policy's ``batch`` set
        beside other sequences): the head's usual chain (``CostAwarePolicy.may_pay``) or a lookup
        chain of any order. The batch worker tries drafting at a load only where some sequence's
        could; without a cost policy always True."""
        policy = self.cost_policy
        if policy is None or policy.may_pay():
            return True
        return self.lookup is not None and policy.chains_pay(self.lookup.orders, self.lookup.max_drafts)

    def propose(self, root: torch.Tensor, position: int) -> DraftTree:
        if self.cost_policy is not None and self.cost_policy.plain_only:  # held back by a batch: plain
            # decoding's step, no search (the lookup indexes its tokens later), the head's input kept (observe)
            self.cost_policy.hold()
            self._chain, self._plain_step, self._caught_up, self._head_nodes = [], True, False, 1
            return DraftTree.root_only(root)
        # a node at depth d sits at position + d, which must stay inside the context window
        self._room = self.target.info.max_position - 1 - position
        too_deep = self._room < 1 or (self.static is not None and len(self.static.levels) > self._room)
        # merged into a drafted tree (beside a batch where no table chain could pay, the table is not searched)
        if self.lookup is None:
            self._chain = []
        else:
            orders = self.lookup.table_orders
            self._chain = self.lookup.continuation(
                not orders or self.cost_policy is None
                or self.cost_policy.chains_may_pay(orders, self.lookup.depth))
        if self._chain and self.cost_policy is not None:  # as many of its tokens as pay on this machine
            self._chain = self._chain[:self.cost_policy.chain_length(self.lookup.order, len(self._chain))]
        chain = None if self.lookup is None else bool(self._chain)
        self._plain_step = too_deep or (self.cost_policy is not None and not self.cost_policy.draft_now(chain))
        self._caught_up = False
        self._head_nodes = 1
        if self._plain_step:
            if too_deep and self.cost_policy is not None:
                self.cost_policy.drafting, self.cost_policy.levels = False, 0
            if self.lookup is not None:  # free drafts: what followed the context's ending earlier on
                return self.lookup.propose(root, position, self._chain)
            return DraftTree.root_only(root)
        self._flush_pending()
        self._committed = self.cache.length
        assert self._committed == position, "head cache out of step with the target"
        if self.static is not None:
            return self._propose_static(root, position)
        if self.device.type == "cpu":
            return self._propose_dynamic_host(root, position)
        return self._propose_dynamic(root, position)

    def _dynamic_setup(self):
        """A dynamic tree's (children per node, verified size unless the cost policy sizes it, the cost
        policy or None, the depth policy, the head cache's slots for this proposal)."""
        cfg = self.cfg
        k = 1 if cfg.shape == "chain" else cfg.top_k
        total = cfg.depth + 1 if cfg.shape == "chain" else cfg.total_tokens
        cost = self.cost_policy
        policy = self.last_policy = cost if cost is not None else make_depth_policy(cfg)
        return k, total, cost, policy, DraftSlots(self._committed, self.device)

    def _propose_dynamic(self, root: torch.Tensor, position: int) -> DraftTree:
        k, total, cost, policy, slots = self._dynamic_setup()
        candidates, frontier = expand_root(self.logprobs(self.root_hidden.view(1, -1))[0], k)
        parent_hidden = self.root_hidden.expand(frontier.numel(), -1)  # [k, H] f̂ of each frontier node's parent
        parent_slot = torch.full((frontier.numel(),), -1, dtype=torch.long, device=self.device)
        level = 1
        best_child = candidates.scores[:1]  # the best root child's log-prob
        while level < self._room and self._continue(policy, level, candidates.scores[frontier], candidates.scores,
                                                    best_child):
            if cost is not None:  # the head runs only on the frontier nodes whose children could be verified
                rows = cost.frontier_rows(candidates.scores.tolist(), frontier.tolist())
                if len(rows) < frontier.numel():
                    keep = torch.tensor(rows, device=self.device)
                    frontier, parent_hidden, parent_slot = frontier[keep], parent_hidden[keep], parent_slot[keep]
            mask = slots.add(parent_slot)
            first_slot = slots.rows.shape[0] - frontier.numel()
            hidden = self._run(parent_hidden, self.to_target_ids(candidates.tokens[frontier]),
                               torch.full((frontier.numel(),), position + level - 1, device=self.device), mask)
            row_of = torch.full((candidates.size,), -1, dtype=torch.long, device=self.device)
            row_of[frontier] = torch.arange(frontier.numel(), device=self.device)
            logprobs = self.logprobs(hidden)  # [k, Vd]
            best_child = logprobs.max(dim=-1).values
            candidates, frontier = expand_level(candidates, frontier, logprobs, k)
            row = row_of[candidates.parents[frontier]]  # the new frontier's parents: rows of the old one
            parent_hidden, parent_slot = hidden[row], first_slot + row
            level += 1
        if cost is not None:
            total = cost.tree_size(candidates.scores)
        tree = self._to_target_vocab(rerank(candidates, root, total))
        self._head_nodes = tree.size
        if cost is not None and self.lookup is not None:
            # the lookup's chain, where the context's ending occurred before, costs nothing to draft:
            # merged into the tree it adds a few verified rows and often tokens the head missed
            tree, added = tree.with_chain(self._chain, max_depth=self._room)
            if added:
                cost.note_graft(self._head_nodes, added)
        return tree

    def _propose_dynamic_host(self, root: torch.Tensor, position: int) -> DraftTree:
        """:meth:`_propose_dynamic` with the candidates on host lists (tree/host.py), for a drafter on a
        CPU: the same levels, choices and tree, at a fraction of the tensor ops' dispatch cost."""
        k, total, cost, policy, slots = self._dynamic_setup()
        logprobs, ids = self._draft_top(self.root_hidden.view(1, -1), k)
        candidates = HostCandidates(ids[0], logprobs[0])
        frontier = list(range(candidates.size))
        parent_hidden = self.root_hidden.expand(len(frontier), -1)  # [f, H] f̂ of each frontier node's parent
        parent_slot = [-1] * len(frontier)
        level = 1
        best_child = [logprobs[0][0]]
        while level < self._room:
            scores = candidates.scores
            if not self._continue(policy, level, [scores[f] for f in frontier], scores, best_child):
                break
            if cost is not None:  # the head runs only on the frontier nodes whose children could be verified
                rows = cost.frontier_rows(scores, frontier)
                if len(rows) < len(frontier):
                    frontier, parent_slot = [frontier[j] for j in rows], [parent_slot[j] for j in rows]
                    parent_hidden = parent_hidden[rows]
            mask = slots.add(torch.tensor(parent_slot))
            first_slot = slots.rows.shape[0] - len(frontier)
            tokens = torch.tensor(self._target_id_list([candidates.tokens[f] for f in frontier]))
            hidden = self._run(parent_hidden, tokens, torch.full((len(frontier),), position + level - 1), mask)
            logprobs, ids = self._draft_top(hidden, k)
            best_child = [row[0] for row in logprobs]
            row_of = {f: j for j, f in enumerate(frontier)}
            frontier = candidates.expand(frontier, logprobs, ids, k)
            rows = [row_of[candidates.parents[c]] for c in frontier]  # the new frontier's parents: rows of the old one
            parent_hidden, parent_slot = hidden[rows], [first_slot + j for j in rows]
            level += 1
        if cost is not None:
            total = cost.tree_size(candidates.scores)
        # the lookup's chain merged in as in _propose_dynamic (free drafts where the context's ending occurred before)
        chain = self._chain if cost is not None and self.lookup is not None else None
        tree, added = candidates.tree(int(root), total, self._target_id_list, chain, self._room, self.device)
        self._head_nodes = tree.size - added
        if added:
            cost.note_graft(self._head_nodes, added)
        return tree

    def draft_top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best draft log-probs of each row of ``hidden`` [n, H] ([n, k] float32, descending)
        and their draft ids [n, k]: :meth:`logprobs` and ``topk``, in one C pass per row on a CPU
        where the kernels are built (native.top_logprobs: 0.01 ms a row instead of about 0.1 ms of
        tensor ops). What a draft level computes after the head's forward (calibrate.py times it)."""
        if hidden.device.type != "cpu" or not native_lib.available():
            logprobs = self.logprobs(hidden)
            return logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        logits, extra = self._draft_logits(hidden)
        k = min(k, logits.shape[-1] + (0 if extra is None else extra.shape[-1]))
        return native_lib.top_logprobs(logits, extra, 1.0 / self.temperature, k)

    def _draft_top(self, hidden: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """:meth:`draft_top` as host lists."""
        values, ids = self.draft_top(hidden, k)
        return values.tolist(), ids.tolist()

    def _target_id_list(self, tokens: list[int]) -> list[int]:
        """Draft ids -> target ids, on host lists (the draft vocabulary's ids listed once; the
        context's few added ones read where a token is one of them)."""
        if self.draft_ids is None:
            return tokens
        if self._draft_id_list is None:
            self._draft_id_list = self.draft_ids.tolist()
        base, vd = self._draft_id_list, len(self._draft_id_list)
        if all(t < vd for t in tokens):
            return [base[t] for t in tokens]
        return self.vocab_ids[tokens].tolist()

    @staticmethod
    def _continue(policy, level: int, frontier_scores, scores, best_child) -> bool:
        """Whether to draft another level. frontier_scores: the frontier's scores; scores: every
        candidate's; best_child: the best child log-prob of each node expanded at this level
        (tensors, or host lists from _propose_dynamic_host)."""
        if isinstance(policy, CostAwarePolicy):
            return policy.continue_after(level, frontier_scores, scores, best_child)
        return policy.continue_after(level, frontier_scores)

    def _to_target_vocab(self, tree: DraftTree) -> DraftTree:
        ids = self.vocab_ids
        if ids is None:
            return tree
        tokens = torch.cat([tree.tokens[:1], ids[tree.tokens[1:]]])
        return DraftTree(tokens, tree.parents, tree.depths, tree.scores)

    def _propose_static(self, root: torch.Tensor, position: int) -> DraftTree:
        shape = self.static
        n = shape.size
        slots = DraftSlots(self._committed, self.device)
        hidden_of = torch.zeros(n, self.head.hidden_size, dtype=self.root_hidden.dtype, device=self.device)
        hidden_of[0] = self.root_hidden
        slot_of = torch.full((n,), -1, dtype=torch.long, device=self.device)
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        scores = torch.zeros(n, dtype=torch.float32, device=self.device)
        parents = torch.tensor(shape.parents, device=self.device)
        for level in shape.levels:
            expand = torch.tensor(level.expand, device=self.device)  # nodes at depth - 1
            if level.depth == 1:
                parent_logprobs = self.logprobs(self.root_hidden.view(1, -1))
            else:  # run the head on the expanded nodes to get their children's distribution
                mask = slots.add(slot_of[parents[expand]])
                slot_of[expand] = slots.rows.shape[0] - expand.numel() + torch.arange(expand.numel(), device=self.device)
                hidden = self._run(hidden_of[parents[expand]], self.to_target_ids(tokens[expand]),
                                   torch.full((expand.numel(),), position + level.depth - 2, device=self.device), mask)
                hidden_of[expand] = hidden
                parent_logprobs = self.logprobs(hidden)
            level_tokens, level_scores = fill_level(level, scores[expand], parent_logprobs)
            idx = slice(level.first, level.first + len(level.ranks))
            tokens[idx], scores[idx] = level_tokens, level_scores
        tree = shape.tree(root, tokens[1:], scores[1:])
        return self._to_target_vocab(tree)
