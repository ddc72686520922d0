"""Draft or not, from what each kind of step gave: the choice shared by the draft model's priced chain
(draft/model.py) and the batch worker (server/batch.py).

Drafting is worth its cost only where drafted steps give more tokens per unit of time than plain
steps, and which does depends on things a forecast leaves out (a catch-up forward of the draft
model, the Python around a batch of rows). :class:`RateChoice` keeps decayed sums of the tokens and
time of each kind as measured, picks the kind with the better rate, and tries the other again now
and then so that its estimate does not go stale: ``explore_steps`` steps after every
``explore_every``, the wait doubling (up to ``max_backoff`` times) while the other kind stays the
worse. It starts with ``explore_steps`` measured steps of each kind, drafted ones first: one
step of each is a poor sample where step times vary (a batch's sequences come and go).
:class:`PairedRateChoice` (the batch worker's) compares the kinds where they meet instead, so that
the machine's speed moving between the windows of the kind not in use does not decide.
"""

from __future__ import annotations

import math


class RateChoice:
    def __init__(self, explore_every: int, explore_steps: int = 1, max_backoff: int = 8, decay: float = 0.9,
                 margin: float = 0.0, draft_margin: float = 0.0, in_use: bool | None = None) -> None:
        """margin: the kind in use stays until the other's rate is better by this fraction (noisy
        rates otherwise flip the choice back and forth). draft_margin: drafting counts as better only
        where its rate beats plain steps' by this fraction too (where a wrong choice of drafting costs
        others, as in a batch, and rates measured at different moments carry the machine's noise).
        in_use: the kind taken to be in use before the first choice (None: whichever the rates say,
        drafting on a tie within the margin)."""
        self.explore_every, self.explore_steps, self.max_backoff, self.decay = (explore_every, explore_steps,
                                                                                max_backoff, decay)
        self.margin, self.draft_margin = margin, draft_margin
        self.rates = [0.0, 0.0, 0.0, 0.0]  # decayed tokens, time of drafted steps; tokens, time of plain steps
        self.tried = [0, 0]  # drafted, plain steps measured
        self._best: bool | None = in_use
        self._since, self._backoff, self._exploring = 0, 1, 0

    def ratio(self) -> float:
        """Drafted steps' rate over plain steps' (both kinds measured)."""
        drafted_tokens, drafted_time, plain_tokens, plain_time = self.rates
        return (drafted_tokens / drafted_time) / (plain_tokens / plain_time)

    def choose(self) -> bool:
        """True: draft this step; False: a plain step."""
        if min(self.tried) < self.explore_steps:  # each kind tried first, drafting first
            return self.tried[0] < self.explore_steps
        ratio = self.ratio() / (1.0 + self.draft_margin)
        best = ratio >= 1.0 + self.margin if self._best is False else ratio * (1.0 + self.margin) >= 1.0
        if best != self._best:
            self._best, self._since, self._backoff, self._exploring = best, 0, 1, 0
        if self._exploring:
            self._exploring -= 1
            return not best
        self._since += 1
        if self._since >= self.explore_every * self._backoff:
            self._since, self._exploring = 0, self.explore_steps - 1
            self._backoff = min(2 * self._backoff, self.max_backoff)
            return not best
        return best

    def observe(self, drafted: bool, tokens: float, time: float) -> None:
        """A step's tokens and time, for the kind it was."""
        r, i = self.rates, 0 if drafted else 2
        r[i], r[i + 1] = r[i] * self.decay + tokens, r[i + 1] * self.decay + time
        self.tried[i // 2] += 1


class PairedRateChoice(RateChoice):
    """A :class:`RateChoice` that compares the two kinds where they meet: at each change of kind, the
    last ``explore_steps`` steps of the one against the first ``explore_steps`` of the other, and
    the decayed mean of those pairs' log rate ratios decides. The plain rates compare a kind measured
    in windows minutes apart (the kind not in use is tried for a few steps every few hundred) with
    one measured throughout, and this machine's speed moves by 10-30% from minute to minute; a pair's
    two sides run a few steps apart, so the drift cancels, and each window of the kind not in use
    gives two pairs (the steps before it and after it). Until a first pair, the plain rates decide."""

    def __init__(self, *args, pair_decay: float = 0.5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pair_decay = pair_decay
        self.pairs = [0.0, 0.0]  # decayed sum of log(drafted rate / plain rate) over pairs, decayed count
        self._kind: bool | None = None  # the kind of the run of steps under way
        self._head: list[tuple[float, float]] = []  # its first explore_steps steps (tokens, time)
        self._tail: list[tuple[float, float]] = []  # its last explore_steps steps
        self._before: tuple[bool, list[tuple[float, float]]] | None = None  # the run before it, not yet paired

    def ratio(self) -> float:
        if not self.pairs[1]:
            return super().ratio()
        return math.exp(self.pairs[0] / self.pairs[1])

    def observe(self, drafted: bool, tokens: float, time: float) -> None:
        super().observe(drafted, tokens, time)
        k = self.explore_steps
        if drafted != self._kind:
            if self._before is not None and self._head:  # a run shorter than k steps: paired as it is
                self._pair(self._before, (self._kind, self._head))
            self._before = None if self._kind is None else (self._kind, self._tail)
            self._kind, self._head, self._tail = drafted, [], []
        if len(self._head) < k:
            self._head.append((tokens, time))
        self._tail = (self._tail + [(tokens, time)])[-k:]
        if self._before is not None and len(self._head) == k:
            self._pair(self._before, (self._kind, self._head))
            self._before = None

    def _pair(self, a: tuple[bool, list], b: tuple[bool, list]) -> None:
        def rate(steps: list[tuple[float, float]]) -> float:
            seconds = sum(s for _, s in steps)
            return sum(t for t, _ in steps) / seconds if seconds > 0.0 else 0.0

        (drafted, plain) = (a[1], b[1]) if a[0] else (b[1], a[1])
        d, p = rate(drafted), rate(plain)
        if d > 0.0 and p > 0.0:
            self.pairs[0] = self.pairs[0] * self.pair_decay + math.log(d / p)
            self.pairs[1] = self.pairs[1] * self.pair_decay + 1.0
