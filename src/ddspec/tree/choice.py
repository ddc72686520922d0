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
"""

from __future__ import annotations


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

    def choose(self) -> bool:
        """True: draft this step; False: a plain step."""
        if min(self.tried) < self.explore_steps:  # each kind tried first, drafting first
            return self.tried[0] < self.explore_steps
        drafted_tokens, drafted_time, plain_tokens, plain_time = self.rates
        drafted, plain = drafted_tokens / drafted_time, plain_tokens / plain_time * (1.0 + self.draft_margin)
        best = drafted >= plain * (1.0 + self.margin) if self._best is False else drafted * (1.0 + self.margin) >= plain
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
