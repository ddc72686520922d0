"""A cost-aware draft policy: grow the tree while it pays, on the machine at hand (docs/design.md §2.4).

DDD and EAGLE-2 look only at draft confidence; neither knows that on a CPU a target forward
over 32 tokens costs several times one token, or that a draft level is not free. This policy
maximises expected tokens per second of the whole step:

    rate(N, L) = (1 + E(N)) / (t_draft(L) + t_verify(N) + t_other)

where E(N) = sum of a(score_i) over the N - 1 best-scoring drafted nodes (``a`` maps a node's
score to its observed chance of being accepted), L is the number of levels drafted, and the
times come from measurements of this target + head + device (:class:`CostModel`).

- *Depth*: after each level it compares the best rate now with the best rate it expects after
  one more level (each frontier node gets a child whose log-prob is the running mean of the
  best child's log-prob), and stops when one more level is not expected to pay.
- *Size*: the verified node count N is the argmax of the rate over the reranked candidates.

Only which nodes are drafted and verified changes (depth, size, the frontier's width; the drafter
may merge a lookup chain in), so verification, and losslessness, are untouched.
With a flat verification cost it grows EAGLE-2-sized trees; with a steep one it shrinks to a
short chain; with a costly draft level it stops earlier. No model imports; the per-step
arithmetic runs on Python floats (a few dozen tiny tensor ops would cost more than a draft level).
"""

from __future__ import annotations

import math

import torch

from ddspec.tree.acceptance import AcceptanceModel
from ddspec.tree.cost_model import CostModel, flat_cost, linear_cost
from ddspec.tree.host import host_list
from ddspec.tree.learned_costs import LearnedCosts

# what callers import from here: the policy's parts live in their own modules
__all__ = ["AcceptanceModel", "CostAwarePolicy", "CostModel", "LearnedCosts", "flat_cost", "linear_cost"]


class CostAwarePolicy:
    """The depth policy and size chooser described in the module docstring, plus the choice
    between drafting and a plain step (see :meth:`draft_now`).

    ``persist``: called once with the learned curve (in calibration terms) when it has drifted
    from the calibration by more than ``drift_limit`` (log ratio) after ``min_steps`` steps, so
    the cache entry is corrected for the next run. Only estimates observed ``drift_seen`` times
    (decayed counts) count: a tree size met once or twice in a run, at one slow or fast moment,
    used to rewrite the cache on most runs (and the next run, meeting another rare size, wrote
    it back).
    """

    drift_seen = 4.0

    explore_close, explore_far = 16, 64  # steps between tries of the other choice (rates close / far apart)
    max_backoff = 8  # drafting tried and still worse: the wait before the next try doubles, up to 8x
    min_drafted = 8  # drafted steps before the policy may prefer plain steps
    may_pay_every = 16  # steps a may_pay answer is kept for, at one batch pricing
    may_pay_within = 0.9  # may_pay: a chain forecast within 10% of plain decoding's rate may still pay
    forecast_decay = 0.5  # the drafted rate follows the newest forecasts (made with the newest knowledge)
    # drafted steps' measured rate against their forecasts (decayed sums over about 20 steps): what
    # the forecasts leave out (the head catching up after plain steps, feeding it the accepted
    # tokens, Python between the phases) scales the drafted rate the policy compares
    bias_decay = 0.95
    bias_bounds = (0.25, 2.0)
    plain_decay = 0.9  # the plain steps' measured rate: realised tokens are noisier than forecasts
    # ... of those that verified a lookup chain (1 to 4 tokens a step): over ~10 steps its estimate
    # swung by 2x (0.17-0.37 tokens/ms in one fp32 run) and dipped below the drafted rate on 1 chain
    # step in 10, each then drafted at a loss (0.22 against 0.26 tokens/ms measured); ~50 steps
    chain_decay = 0.98

    def __init__(self, cost: CostModel, acceptance: AcceptanceModel, max_depth: int, max_tokens: int,
                 child_logprob: float = -0.7, persist=None, drift_limit: float = math.log(1.5),
                 min_steps: int = 32) -> None:
        self.acceptance = acceptance
        self.costs = LearnedCosts(cost)
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.child_logprob = child_logprob  # running mean of the best child's log-prob
        self.persist, self.drift_limit, self.min_steps = persist, drift_limit, min_steps
        self.syncs = 0
        self.levels = 0
        self.next_size = max_tokens  # verified size expected after the next level (continue_after)
        self.drafting = True  # the choice made for the current step
        self.prediction: tuple[float, float] = (1.0, 0.0)  # (expected tokens, expected ms) of the current step
        # expected rate of drafted steps (the forecasts, with the costs and acceptance learned so
        # far): decayed sums of forecast tokens and ms, and the count of drafted steps
        self._draft_tokens = self._draft_ms = self._drafted = 0.0
        # drafted steps as measured and as forecast (the size they verified): decayed sums (see bias)
        self._real_tokens = self._real_ms = self._told_tokens = self._told_ms = 0.0
        # measured, of plain steps (lookup chains included): decayed sums of tokens, ms and steps
        self._plain_tokens = self._plain_ms_sum = self._plain_weight = 0.0
        self._plain_steps = 0
        self._chain_tokens = self._chain_ms = 0.0  # ... of the plain steps that verified a lookup chain
        self._chain_steps = 0
        self._since_plain = self._since_draft = 0
        self._backoff = 1  # multiplies the wait before drafting is tried again (see draft_now)
        self._since_size_probe = 0  # drafted steps since one verified a bigger tree than the best
        self._probe_size = False
        self._probe_extra = (0.0, 0.0)  # (tokens, ms) the current step's size probe adds to the best size's forecast
        # lookup chains merged into drafted trees (EagleDrafter): their accepted nodes per step so far
        self.graft_gain, self._graft_seen = 0.0, 0.0
        # lookup chains verified: per n-gram order, how often the j-th token was offered / accepted
        self._chain_stats: dict[int, tuple[list[float], list[float]]] = {}
        self._chain_cuts = 0
        self.remember = None  # remember(snapshot) every SAVE_EVERY steps (methods.remember_policy), or None
        self.steps_seen = 0  # steps observed in this process
        # continuous batching (server/batch.py): (rows, expected tokens, draft ms) the other sequences add
        # to the coming step (the worker tells their plain batch: a row and a token each, no draft ms).
        # With rows > 0 every rate is the batch's: (their tokens + this tree's) per ms of their drafting,
        # this draft and a forward over (their rows + this tree's), so a drafted node is worth its row only
        # if it adds more tokens than the row costs the whole batch; (0, 0.0, 0.0) alone
        self.batch: tuple[int, float, float] = (0, 0.0, 0.0)
        self.verified_beside = 0  # rows of the other sequences in the forward just verified (server/batch.py)
        self.beside_prefill = False  # that forward also ran another sequence's prompt chunk (server/batch.py)
        self.plain_only = False  # the batch worker measured that drafting does not pay at this load: plain steps
        self._before_memory: dict | None = None  # the state before restore(), while a memory is in use
        self._kept_for: tuple | None = None  # the (batch, step bucket) the answers in _kept_answers are for
        self._kept_answers: dict = {}  # beside a batch: may_pay, chain lengths, chains_may_pay (see _kept)
        self._chain_refusals = 0

    @property
    def cost(self) -> CostModel:
        """The costs the policy uses now (calibrated, corrected by observation)."""
        return self.costs.current

    @cost.setter
    def cost(self, cost: CostModel) -> None:  # a new calibration: start learning from it afresh
        self.costs = LearnedCosts(cost)

    # -- the rate ----------------------------------------------------------------------------
    # Python floats throughout: the policy prices sizes a few times per level, and on a CPU a few
    # dozen small tensor ops cost about a millisecond, as much as a draft level's matmuls
    def _gains(self, scores: list[float]) -> list[float]:
        """Expected tokens of verifying the root and the N - 1 best nodes, for N = 1, 2, ..."""
        best = sorted(scores, reverse=True)[: self.max_tokens - 1]
        gains = [1.0 + self.batch[1]]
        for p in self.acceptance.prob(best):
            gains.append(gains[-1] + p)
        return gains

    def _step_ms(self, levels: int, n_max: int) -> list[float]:
        """Expected ms of a step that drafts ``levels`` levels and verifies N = 1 .. n_max nodes (root
        included): the draft, the per-step rest and the verification."""
        cost, rows = self.cost, self.batch[0]
        fixed = cost.draft(levels) + cost.other_ms + self.batch[2]
        return [fixed + v for v in cost.verify_list(rows + n_max)[rows:rows + n_max]]

    def rates(self, scores: list[float], levels: int) -> list[float]:
        """Expected tokens per ms of verifying N = 1 .. min(M + 1, max_tokens) nodes (the root and the
        N - 1 best of the M drafted ``scores``), after ``levels`` draft levels."""
        gains = self._gains(scores)
        return [g / ms for g, ms in zip(gains, self._step_ms(levels, len(gains)))]

    def best(self, scores: torch.Tensor | list[float], levels: int) -> tuple[int, float]:
        """(N, rate) of the best verified size for these scores (the first N on ties)."""
        r = self.rates(host_list(scores), levels)  # a tensor's host sync: a decision point
        i = max(range(len(r)), key=r.__getitem__)
        return i + 1, r[i]

    # -- drafting or a plain step ---------------------------------------------------------------
    def plain_rate(self, chain: bool | None = None) -> float:
        """Tokens per ms of the steps that leave the head out: measured (decayed sums of their tokens
        and times, lookup chains included) once there are ``min_drafted`` of them, else one token
        per plain step's cost. ``chain``: whether this step has a lookup chain to verify (None:
        not known). Without one, a plain step is one token at a plain step's cost; with one, the
        measured rate of the plain steps that had a chain (the pooled rate until there are
        ``min_drafted`` of them): the choice is made for the step at hand, not on average."""
        if self.batch[0]:  # beside other sequences: a forecast in the batch's terms
            return (1.0 + self.batch[1]) / self._batch_plain_ms()
        if chain is False:
            return 1.0 / self._plain_step_ms()
        if chain and self._chain_steps >= self.min_drafted and self._chain_ms > 0:
            return self._chain_tokens / self._chain_ms
        if self._plain_steps >= self.min_drafted and self._plain_ms_sum > 0:
            return self._plain_tokens / self._plain_ms_sum
        return 1.0 / self._plain_step_ms()

    def _plain_step_ms(self) -> float:
        """ms of a plain step as the costs estimate it: its verify phase and the gap between steps."""
        return self.costs.plain_estimate() + self.costs.gap_ms

    def _batch_plain_ms(self) -> float:
        """ms of a step that adds one row to the other sequences' ``batch`` rows."""
        return self._plain_step_ms() + self.batch[2] + self.cost.verify_one(self.batch[0] + 1) - self.cost.verify_one(1)

    def may_pay(self) -> bool:
        """Whether a drafted step can be expected to beat a plain one beside the coming batch: the
        chain the head usually drafts (each level its running mean best child, ``child_logprob``),
        1 to ``max_depth`` levels deep, priced as :meth:`tree_size` prices trees (no gap between
        steps, which the plain step's price includes: the generous side). It pays when the tokens it
        adds to the batch's step, per ms it adds, reach plain decoding's rate in the batch's terms
        (the margin, not the whole step's rate: beside 15 sequences any tree moves that by a few
        percent); within ``may_pay_within`` of it, draft_now's measured rates decide. Alone (no
        batch) always True: the single-stream choice is draft_now's. Beside many sequences, on a
        machine where a forward's cost grows with every row, no tree pays whatever it drafts: the
        slot then takes plain steps without trying drafted ones (a try costs the whole batch a
        catch-up of the head over all it has not seen). Kept for ``may_pay_every`` steps (the costs
        and acceptance it reads move slowly), recomputed when the batch changes."""
        if not self.batch[0]:
            return True
        return self._kept(("may_pay",), self._chain_pays)

    def _chain_pays(self) -> bool:
        """may_pay's answer, computed."""
        gains = self._gains([self.child_logprob * (i + 1) for i in range(self.max_depth)])  # the chain's
        plain_ms = self._batch_plain_ms()
        bar = self.may_pay_within * gains[0] / plain_ms  # tokens per added ms that pay
        for levels in range(1, len(gains)):  # verifying the root and that many levels of the chain
            added = self._step_ms(levels, levels + 1)[levels] - plain_ms
            if added <= 0.0 or (gains[levels] - gains[0]) / added >= bar:
                return True
        return False

    def draft_rate(self) -> float | None:
        """Tokens per ms expected of recent drafted steps (None before ``min_drafted`` of them).

        The forecasts' rate times :meth:`bias`, not the realised rate: the forecasts use the costs
        and acceptance learned from every step, so they track what steps take, without the noise
        of single verdicts (one unlucky step must not switch drafting off); the slow bias adds what
        they cannot price (the head's catch-up, Python between the phases)."""
        if self._drafted < self.min_drafted:
            return None
        return self._draft_tokens / self._draft_ms * self.bias()

    def bias(self) -> float:
        """Measured over forecast tokens per ms of recent drafted steps (1.0 before ``min_drafted`` of
        them; within ``bias_bounds``). The forecasts price a step's draft levels, verification and
        the usual gap; a drafted step also pays the head's catch-up over the plain steps before it
        and its commit of the accepted tokens, which the measurement holds. Slow (``bias_decay``):
        one step's luck with acceptance hardly moves it."""
        if self._drafted < self.min_drafted or min(self._real_ms, self._told_tokens) <= 0.0:
            return 1.0
        ratio = (self._real_tokens / self._real_ms) / (self._told_tokens / self._told_ms)
        low, high = self.bias_bounds
        return min(max(ratio, low), high)

    def hold(self) -> bool:
        """A plain step without a choice (held back by the batch, or no tree may pay): its forecast
        is plain decoding's; False."""
        self.drafting, self.levels, self._probe_size, self._probe_extra = False, 0, False, (0.0, 0.0)
        if self.batch[0]:  # beside a batch every sequence holds each step: its price kept as may_pay keeps its answer
            self.prediction = self._kept(("hold",), lambda: (1.0 + self.batch[1], self._batch_plain_ms()))
        else:
            self.prediction = (1.0 + self.batch[1], self._plain_step_ms())
        return False

    def draft_now(self, chain: bool | None = None) -> bool:
        """Draft this step, or verify the root alone without touching the head (plain decoding's
        cost; with the lookup's chain when ``chain``, see :meth:`plain_rate`)? Whichever has the
        higher expected rate (costs and acceptance as learned so far; the first ``min_drafted``
        steps with a chain verify it, to learn what such steps yield); the
        other is tried every ``explore_close`` steps when the two are within 25%, every
        ``explore_far`` otherwise, so neither estimate goes stale. A drafted try costs a catch-up
        of the head and a tree (about two plain steps): while drafting stays the worse choice
        after each try, the wait before the next one doubles (up to ``max_backoff`` times)."""
        if self.plain_only or not self.may_pay():
            return self.hold()
        drafted = self.draft_rate()
        explore = False
        if chain and self._chain_steps < self.min_drafted:
            choice = False  # verifying a lookup chain costs about a plain step: learn what such steps yield
        elif drafted is None:
            choice = True
        else:
            plain = self.plain_rate(chain)
            ratio = drafted / plain
            every = self.explore_close if 0.8 <= ratio <= 1.25 else self.explore_far
            choice = ratio >= 1.0
            if choice:
                self._backoff = 1
            if choice and self._since_plain >= every or not choice and self._since_draft >= every * self._backoff:
                if not choice:
                    self._backoff = min(2 * self._backoff, self.max_backoff)
                choice, explore = not choice, True
        # a drafted step now and then verifies the next calibrated size above the best one, so
        # that costs believed too high for bigger trees get measured (and corrected) too
        self._probe_size = choice and (explore or self._since_size_probe >= self.explore_close)
        self._probe_extra = (0.0, 0.0)
        self.drafting = choice
        if not choice:
            self.levels = 0
            if self.batch[0]:
                self.prediction = (1.0 + self.batch[1], self._batch_plain_ms())
            elif self._plain_weight > 0:  # what recent plain steps (with their lookup chains) took
                self.prediction = (self._plain_tokens / self._plain_weight, self._plain_ms_sum / self._plain_weight)
            else:
                self.prediction = (1.0, self._plain_step_ms())
        return choice

    # -- lookup chains -------------------------------------------------------------------------
    chain_prior, chain_prior_weight = 0.5, 4.0  # before observations: the j-th token accepted with 0.5**j
    chain_explore = 16  # every so many cut chains, one more token is verified (its acceptance stays known)

    def chain_length(self, order: int, available: int) -> int:
        """How many of a lookup continuation's ``available`` tokens to verify (0: none), for a
        continuation found by an n-gram of ``order`` tokens.

        The L that maximises the expected rate (1 + sum of P(first j accepted), j <= L) /
        (plain verify phase of 1 + L nodes + gap), with those probabilities learned per order
        (:meth:`observe_chain`) and the verify phases measured on this machine's plain steps
        (:meth:`LearnedCosts.plain_verify`). A match on the context's last token alone guesses
        worse than one on its last three; where verifying a few more tokens is dear (fp32 here)
        such chains are cut, where it is nearly free (8-bit activations) they are verified."""
        if order <= 0 or available <= 0 or self.plain_only:
            return 0
        if self.batch[0]:  # beside a batch, per step and sequence: its prices kept as may_pay keeps its answer
            best = self._kept((order, available), lambda: self._best_chain(order, available))
        else:
            best = self._best_chain(order, available)
        if best < available:
            self._chain_cuts += 1
            if self._chain_cuts % self.chain_explore == 0:
                best += 1
        return best

    def _best_chain(self, order: int, available: int) -> int:
        """chain_length's L before its exploration (no state changes)."""
        seen, accepted = self._chain_counts(order, available)
        costs, gap = self.costs, max(self.costs.gap_ms, 0.0)
        rows, others, drafting = self.batch

        def ms(nodes: int) -> float:  # beside other sequences: the batch's step over their rows and these
            if rows:
                return drafting + gap + self.cost.verify_one(rows + nodes)
            return costs.plain_verify(nodes) + gap

        best_l, best = 0, (1.0 + others) / ms(1)
        expected, w = 0.0, self.chain_prior_weight
        for l in range(1, available + 1):
            expected += (accepted[l - 1] + w * self.chain_prior ** l) / (seen[l - 1] + w)
            rate = (1.0 + others + expected) / ms(1 + l)
            if rate > best:
                best_l, best = l, rate
        return best_l

    def _kept(self, what: tuple, compute):
        """``compute()`` for ``what``, kept while the batch pricing stays and for ``may_pay_every``
        steps (beside a batch every sequence asks each step; the costs and acceptance move slowly);
        everything kept is dropped when either changes."""
        at = (self.batch, self.steps_seen // self.may_pay_every)
        if self._kept_for != at:
            self._kept_for, self._kept_answers = at, {}
        value = self._kept_answers.get(what)
        if value is None:
            value = self._kept_answers[what] = compute()
        return value

    def chains_may_pay(self, orders: tuple[int, ...], available: int) -> bool:
        """Beside other sequences: whether a continuation of any of these n-gram ``orders`` (up to
        ``available`` tokens) could have a token worth verifying at the batch's prices, so that the
        lookup need not search where none could (a search of the n-gram table costs tens of
        microseconds a step with its arrays out of the caches, per sequence of the batch). Kept as
        :meth:`may_pay` keeps its answer; every ``chain_explore``-th refusal answers True, so cut
        orders still meet chain_length's exploration. Alone always True (chain_length decides)."""
        if not self.batch[0]:
            return True
        if self.plain_only:
            return False
        answer = self.chains_pay(orders, available)
        if not answer:
            self._chain_refusals += 1
            return self._chain_refusals % self.chain_explore == 0
        return True

    def chains_pay(self, orders: tuple[int, ...], available: int) -> bool:
        """Whether a continuation of any of these n-gram ``orders`` (up to ``available`` tokens) has a
        token worth verifying at the coming step's prices, without exploration (kept as :meth:`may_pay`
        keeps its answer beside a batch)."""
        return self._kept((orders, available, "any"), lambda: any(self._best_chain(o, available) > 0 for o in orders))

    def _chain_counts(self, order: int, length: int) -> tuple[list[float], list[float]]:
        """(offered, accepted) counts of an order's continuation tokens 1 .. at least ``length``."""
        seen, accepted = self._chain_stats.setdefault(order, ([], []))
        while len(seen) < length:
            seen.append(0.0)
            accepted.append(0.0)
        return seen, accepted

    def observe_chain(self, order: int, offered: int, accepted: int) -> None:
        """A verified lookup chain: ``offered`` tokens of an ``order``-gram's continuation, the first
        ``accepted`` of them accepted."""
        if order <= 0 or offered <= 0:
            return
        seen, acc = self._chain_counts(order, offered)
        for j in range(offered):
            seen[j] += 1.0
            acc[j] += 1.0 if accepted > j else 0.0

    # -- the DepthPolicy protocol -------------------------------------------------------------
    def continue_after(self, level: int, frontier_scores: torch.Tensor | list[float],
                       candidate_scores: torch.Tensor | list[float] | None = None,
                       level_logprobs: torch.Tensor | list[float] | None = None) -> bool:
        """candidate_scores: every drafted node so far [M]; level_logprobs: the best child
        log-prob of each parent expanded at this level (updates the running estimate). Tensors or
        host lists (a CPU drafter's, tree/host.py)."""
        self.levels = level
        if level_logprobs is not None and len(level_logprobs):
            best = host_list(level_logprobs)
            self.child_logprob = 0.9 * self.child_logprob + 0.1 * (sum(best) / len(best))
        if level >= self.max_depth:
            return False
        frontier = host_list(frontier_scores)
        scores = frontier if candidate_scores is None else host_list(candidate_scores)
        self.syncs += 1
        _, now = self.best(scores, level)
        self.next_size, after = self.best(scores + [s + self.child_logprob for s in frontier], level + 1)
        return after > now

    def frontier_rows(self, candidate_scores: list[float], frontier: list[int]) -> list[int]:
        """The positions in ``frontier`` (candidate indices) of the nodes worth running the head on,
        ascending.

        A child never scores above its parent, so a frontier node ranked below the best
        ``next_size`` drafted candidates (the size :meth:`continue_after` expects to verify after
        the next level, plus one node of slack; ties ranked by index) cannot have a child in that
        tree: its row would only make the level dearer. The best frontier node is always kept."""
        size = self.next_size
        if size >= len(candidate_scores):
            return list(range(len(frontier)))
        order = sorted(range(len(candidate_scores)), key=lambda i: -candidate_scores[i])
        rank = [0] * len(candidate_scores)
        for r, i in enumerate(order):
            rank[i] = r
        ranks = [rank[f] for f in frontier]
        best = ranks.index(min(ranks))
        return [j for j, r in enumerate(ranks) if r < size or j == best]

    def tree_size(self, candidate_scores: torch.Tensor | list[float]) -> int:
        """Total verified nodes (root included) that maximise the rate for the drafted levels."""
        levels = max(1, self.levels)
        scores = host_list(candidate_scores)
        n, _ = self.best(scores, levels)
        gains, best = self._gains(scores), n
        if self._probe_size:
            bigger = [m for m in self.costs.sizes if m > n]
            n = min(bigger[0] if bigger else n + 1, len(scores) + 1, self.max_tokens)
            self._since_size_probe = 0
        else:
            self._since_size_probe += 1
        step_ms = self._step_ms(levels, max(n, best))
        self.prediction = (gains[n - 1], step_ms[n - 1])
        # a probe is a measurement, not the choice: what drafting yields is the best size's forecast
        self._probe_extra = (gains[n - 1] - gains[best - 1], self.prediction[1] - step_ms[best - 1])
        return n

    def observe(self, scores: torch.Tensor | list[float], accepted: torch.Tensor | list[bool]) -> None:
        """A verified tree's drafted nodes: their scores [M] and whether each lay on the accepted path [M]."""
        self.acceptance.update(scores, accepted)

    def note_graft(self, size: int, added: int) -> None:
        """This step verifies ``added`` nodes of a lookup chain beyond the ``size`` chosen: its
        forecast gains what such chains have yielded per step so far, and their verify cost."""
        tokens, ms = self.prediction
        rows = self.batch[0]
        verify = self.cost.verify_list(rows + size + added)
        self.prediction = (tokens + self.graft_gain, ms + verify[rows + size + added - 1] - verify[rows + size - 1])

    def observe_graft(self, accepted: int) -> None:
        """How many merged lookup nodes the step just verified accepted (decayed mean)."""
        self._graft_seen = self._graft_seen * 0.9 + 1.0
        self.graft_gain += (accepted - self.graft_gain) / self._graft_seen

    def observe_step(self, tokens: int, tree_size: int, draft_ms: float | None, verify_ms: float,
                     gap_ms: float, phase_ms: float | None = None) -> None:
        """The measured times of the step just finished (the engine's clock); ``draft_ms`` None when the
        draft phase also did other work (the head's catch-up), ``phase_ms`` then the whole phase's time.
        Beside other sequences the forward verified their rows too (``verified_beside``, as the
        forward had them) and the step's tokens count theirs (``batch``'s expected tokens): both are
        kept in the batch's terms, as the forecasts are. A forward that also ran another sequence's
        prompt chunk (``beside_prefill``) teaches no time: its rows are a prompt's, priced by no curve
        of verification (learned as such, beside 16-row batches, they are the only forwards that reach
        the curve's largest sizes, which a serving run had learned at 2.5x their calibrated cost and the
        drift check then wrote into the calibration cache)."""
        if self.plain_only:  # held back beside a batch: its root's row among theirs, nothing to learn (a plain
            # step alone is priced by the costs, beside a batch by the forecast; see plain_rate), nothing to save
            self._since_plain, self._since_draft = 0, self._since_draft + 1
            self.steps_seen += 1
            return
        rows, others = self.verified_beside, self.batch[1]
        timed = not self.beside_prefill  # another sequence's prompt chunk shared the forward: no step's time
        if timed and (self.drafting or not rows):  # (a plain step's time beside others teaches no plain step's cost)
            self.costs.observe(rows + tree_size, self.levels, draft_ms, verify_ms, gap_ms, self.drafting)
        tokens = tokens + others
        if self.drafting:
            d = self.forecast_decay
            told_tokens, told_ms = self.prediction
            predicted_tokens, predicted_ms = told_tokens - self._probe_extra[0], told_ms - self._probe_extra[1]
            self._draft_tokens = self._draft_tokens * d + predicted_tokens
            self._draft_ms = self._draft_ms * d + predicted_ms
            if timed:
                b = self.bias_decay
                spent = (draft_ms if draft_ms is not None else phase_ms or 0.0) + verify_ms + max(gap_ms, 0.0)
                self._real_tokens = self._real_tokens * b + tokens
                self._real_ms = self._real_ms * b + spent
                self._told_tokens = self._told_tokens * b + told_tokens
                self._told_ms = self._told_ms * b + told_ms
            self._drafted += 1
            self._since_draft, self._since_plain = 0, self._since_plain + 1
        else:
            if timed:
                d = self.plain_decay
                self._plain_tokens = self._plain_tokens * d + tokens
                self._plain_ms_sum = self._plain_ms_sum * d + verify_ms + (draft_ms or 0.0) + max(gap_ms, 0.0)
                self._plain_weight = self._plain_weight * d + 1.0
                self._plain_steps += 1
                if tree_size > 1:  # it verified a lookup chain
                    step_ms = verify_ms + (draft_ms or 0.0) + max(gap_ms, 0.0)
                    c = self.chain_decay
                    self._chain_tokens = self._chain_tokens * c + tokens
                    self._chain_ms = self._chain_ms * c + step_ms
                    self._chain_steps += 1
            self._since_plain, self._since_draft = 0, self._since_draft + 1
        self.steps_seen += 1
        if self.remember is not None and self.steps_seen % self.SAVE_EVERY == 0:
            self.remember(self.snapshot())
        if (self.persist is not None and self.costs.steps >= self.min_steps
                and self.costs.drift(self.drift_seen) > self.drift_limit):
            persist, self.persist = self.persist, None  # once per run
            why = "no estimate observed often enough"
            drifts = self.costs.drifts(self.drift_seen)
            if drifts:
                what, calibrated, learned = drifts[0]
                why = f"{what}: {calibrated:.2f} ms calibrated, {learned:.2f} ms in this run's steps"
            persist(self.costs.as_calibration(), why)

    # -- memory across runs ----------------------------------------------------------------
    # the rates, counts and decayed sums a run learns; a one-shot `ddspec generate` is a new process
    # each time, and without them every run paid for its own exploration (min_drafted head steps)
    _SNAPSHOT = ("child_logprob", "_draft_tokens", "_draft_ms", "_drafted", "_real_tokens", "_real_ms",
                 "_told_tokens", "_told_ms", "_plain_tokens", "_plain_ms_sum", "_plain_weight", "_plain_steps",
                 "_chain_tokens", "_chain_ms", "_chain_steps", "_backoff", "graft_gain", "_graft_seen")
    SAVE_EVERY = 256  # steps between saves of what was learned (and once at exit)
    memory_cap = 200.0  # restored acceptance counts are scaled down to at most this many per bin (they stay adaptive)

    def snapshot(self) -> dict:
        """What this policy learned (rates, acceptance counts, chain statistics, costs), as JSON-able
        data for :meth:`restore` in a later run on the same set-up."""
        data = {k: getattr(self, k) for k in self._SNAPSHOT}
        data["acceptance"] = self.acceptance.state()
        data["chains"] = {str(order): [list(seen), list(acc)] for order, (seen, acc) in self._chain_stats.items()}
        data["costs"] = self.costs.snapshot()
        return data

    def restore(self, data: dict, costs: bool = True) -> None:
        """Start from what an earlier run learned (:meth:`snapshot`): its rates and counts, scaled so
        that none weighs more than ``memory_cap`` observations, and (``costs``) its corrections of the
        calibrated costs; the timers between tries start afresh. :meth:`forget_memory` undoes it."""
        if self._before_memory is None:
            self._before_memory = self.snapshot()
        self._take(data, costs)

    def forget_memory(self) -> None:
        """Back to the state before :meth:`restore` (no-op without one, or once this process's own steps
        were learned from)."""
        if self._before_memory is not None and not self.steps_seen:
            self._take(self._before_memory, True)
        self._before_memory = None

    def _take(self, data: dict, costs: bool) -> None:
        for k in self._SNAPSHOT:
            setattr(self, k, type(getattr(self, k))(data[k]))
        acc = data["acceptance"]
        if acc["edges"] == self.acceptance.edges:
            scale = min(1.0, self.memory_cap / max(float(max(acc["seen"])), 1.0))
            self.acceptance.seen = [float(x) * scale for x in acc["seen"]]
            self.acceptance.accepted = [float(x) * scale for x in acc["accepted"]]
        chains = {}
        for order, (seen, accepted) in data.get("chains", {}).items():
            scale = min(1.0, self.memory_cap / max(max(seen, default=0.0), 1.0))
            chains[int(order)] = ([x * scale for x in seen], [x * scale for x in accepted])
        self._chain_stats = chains
        if costs:
            self.costs.restore(data["costs"])
        self._since_plain = self._since_draft = 0

    def __repr__(self) -> str:
        return f"CostAwarePolicy(max_depth={self.max_depth}, max_tokens={self.max_tokens})"
