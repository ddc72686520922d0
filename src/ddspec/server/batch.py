"""Continuous batching: several requests decoded together, one target forward per step for all of them.

:class:`BatchWorker` is a drop-in for :class:`~ddspec.server.worker.EngineWorker` (the same jobs,
admission bound and events) that keeps ``slots`` generations running at once. Each slot is one
sequence: a handle on the target with a KV cache of its own (``NativeLlama.session``), its own
drafters (built per method on first use, sharing the one draft head), and an :class:`Engine` whose
:meth:`~ddspec.engine.Engine.steps` runs the request exactly as it runs alone, but hands out each
target forward it needs. The worker's loop:

1. admits waiting jobs into free slots, each into the one whose caches keep the longest prefix of
   its prompt (requests join between steps; a job cancelled while waiting is skipped, one
   cancelled while running is closed at its next step and frees its slot);
2. advances every slot's generation to its next forward (its drafter drafts, its chunks go out);
3. runs all those forwards as one (``forward_many``: the rows of every sequence through each weight
   once, each sequence's attention over its own cache), and hands each its output.

A long prompt is prefilled in chunks of 256 tokens, one per step, beside the other slots' steps,
so it delays them by one chunk's time per step rather than stalling them until it is done. Each
sequence's tokens are those of its own plain decoding (the same bits: see forward_many), whatever
else shares its steps; seeded sampling follows each request's own seed.

Load-aware speculation: every slot's cost-aware policy sizes its tree to maximise the batch's
expected tokens per second rather than its own (see ``CostAwarePolicy.batch``), priced beside the
plain batch: the other sequences' roots, one token each, no draft time. A node then earns its row
only if it beats what plain batched decoding gives per ms: as more sequences share a forward a row
costs the whole batch, and trees shrink; they grow back as the load falls. Where not even the
chain its head usually drafts could pay, a slot takes plain steps without trying a tree
(``CostAwarePolicy.may_pay``). (Priced beside the
others' own trees and draft times, a slot's extra rows look cheap next to a step the others make
long, and the slots grow their trees together: docs/performance.md, "The server".) Once the
forward has run, each policy learns from it with the rows it really verified. Over that, the
worker measures the batch's tokens per second with drafting allowed and with it held back, per
load class (2, 3-4, 5-8, 9-16, ... sequences), and allows drafting only where that has been faster
by about 10% (held back is where it starts; the other choice is tried for 4 steps after 64, that
wait doubling to 256 while it stays the worse), comparing the two where they meet (the 4 steps
before and after each change of choice: ``PairedRateChoice``, tree/choice.py), since this machine's
speed moves between one try and the next; so speculation costs the batch little where it does not
pay, and each choice learns from the cycle its trees ran in (see _run). Where
no sequence's tree or lookup chain could pay at the step's prices (``EagleDrafter.may_draft``),
drafting is not tried at all, and a held-back slot's step costs what a plain one does (its head
takes in the held-back positions when it next drafts, its policy learns nothing from them).
"""

from __future__ import annotations

import logging
import queue
import time

from ddspec.engine import Chunk, Engine, Forward, Request
from ddspec.errors import DdspecError
from ddspec.server.protocol import ApiError
from ddspec.server.worker import EngineWorker, Job, Outbox, kept_drafter
from ddspec.tree.choice import PairedRateChoice

log = logging.getLogger("ddspec.server")


class Slot:
    """One sequence of the batch: a target session, its drafters by method, its engine and job."""

    def __init__(self, session, make_drafter, default_method: str) -> None:
        self.session, self._make_drafter, self.default_method = session, make_drafter, default_method
        self.engine = Engine(session)
        self.drafters: dict[str, object] = {}
        self.job: Job | None = None
        self.request: Request | None = None  # the job's settings and drafter, as the engine reads them
        self.steps = None  # the job's Engine.steps generator
        self.pending: Forward | None = None  # the forward it waits for
        self.t0 = 0.0  # when its current (or last) job started: 0.0 until its first

    def drafter(self, method: str):
        return kept_drafter(self.drafters, method, lambda m: self._make_drafter(m, self.session), self.default_method)

    def start(self, job: Job) -> None:
        self.request = job.request(self.drafter(job.method))
        self.job, self.pending, self.t0 = job, None, time.perf_counter()
        self.steps = self.engine.steps(self.request)

    def close(self) -> None:
        if self.steps is not None:
            self.steps.close()
        self.job = self.request = self.steps = self.pending = None

    @property
    def policy(self):
        return None if self.request is None else getattr(self.request.drafter, "cost_policy", None)

    def may_draft(self) -> bool:
        """Whether this slot's drafter could draft a step that pays at the batch's prices (False for a
        slot without a cost policy, which the worker's choice does not steer)."""
        if self.policy is None:
            return False
        may = getattr(self.request.drafter, "may_draft", None)
        return may is None or may()


class BatchWorker(EngineWorker):
    """Runs jobs ``slots`` at a time on one target, their steps batched (see the module docstring)."""

    def __init__(self, target, make_drafter, default_method: str, slots: int, max_queue: int = 16,
                 on_step=None) -> None:
        """make_drafter(method, target) -> a drafter for that target handle, or None (vanilla)."""
        if slots < 1:
            raise DdspecError(f"--batch must be >= 1, got {slots}")
        if not hasattr(target, "forward_many"):
            raise DdspecError("--batch needs the native target (a model of a native family, --impl native)")
        self.model = target
        self.slots = [Slot(target.session(), make_drafter, default_method) for _ in range(slots)]
        # measured tokens per second of steps with drafting allowed / held back, per load class (_choose_drafting)
        self._choices: dict[int, PairedRateChoice] = {}
        self._step_tokens = 0
        self._cycle: tuple[bool, int, float] | None = None  # (choice, sequences, start) of the step whose trees come next
        self._outbox = Outbox()  # the step's events, handed to the handlers' loops once per step
        super().__init__(self.slots[0].engine, lambda method: make_drafter(method, self.slots[0].session),
                         default_method, max(max_queue, slots), on_step)
        self._thread.name = "ddspec-batch"

    @property
    def batch(self) -> int:
        return len(self.slots)

    def drafter(self, method: str):
        """Every slot's drafter for ``method`` (built on first use, for all slots at once: a request
        arriving later finds its drafter ready); returns the first slot's."""
        for slot in self.slots[1:]:
            slot.drafter(method)
        return self.slots[0].drafter(method)

    @property
    def _drafters(self) -> dict:
        """The first slot's drafters (the one a lone client's requests use)."""
        return self.slots[0].drafters

    @_drafters.setter
    def _drafters(self, value) -> None:  # EngineWorker's constructor sets its own: each slot keeps its drafters
        pass

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while True:
            self._outbox.flush()  # the last step's events (before any wait for a job)
            active = [s for s in self.slots if s.job is not None]
            if stopping and not active:
                return
            free = [s for s in self.slots if s.job is None]
            self.busy = bool(active)
            while free and not stopping:  # admission: block only when nothing runs
                if not active:  # (a job refused just now: its error goes out before the wait)
                    self._outbox.flush()
                try:
                    job = self._queue.get(block=not active)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                slot = self._begin(free, job)
                if slot is not None:
                    free.remove(slot)
                    active.append(slot)
            self.busy = bool(active)
            self._step_tokens = 0
            self._price(active)
            choice = self._choose_drafting(active)
            for slot in active:
                if slot.policy is not None:
                    slot.policy.plain_only = choice is False
            for slot in active:
                self._advance(slot, None)
            ready = [s for s in self.slots if s.job is not None and s.pending is not None]
            if not ready:
                self._cycle = None
                continue
            calls = [(s.session, f.tokens, f.positions, f.mask, f.hidden_layers, f.last_logits)
                     for s in ready for f in (s.pending,)]
            t = time.perf_counter()
            try:
                outs = self.model.forward_many(calls)
            except Exception as e:  # a bug: every job of the step answers 500, the server keeps serving
                log.exception("batched forward failed")
                self._cycle = None
                for s in ready:
                    self._fail(s, ApiError(500, f"internal error during generation: {type(e).__name__}: {e}",
                                           kind="server_error"))
                continue
            t_verify = time.perf_counter()
            seconds = t_verify - t
            total = sum(c[1].shape[-1] for c in calls)
            prefill = any(c[5] for c in calls)
            for s, out in zip(ready, outs):
                s.pending.seconds = seconds
                if s.policy is not None:  # its learning: the other rows this forward verified (a prompt
                    s.policy.verified_beside = total - s.pending.tokens.shape[-1]  # chunk's: no time learned)
                    s.policy.beside_prefill = prefill
                s.pending, value = None, out
                self._advance(s, value)
            # The trees this forward verified were drafted at the end of the previous step (each slot
            # drafts its next tree as soon as its last one is verified), under that step's choice: the
            # cycle from there to here (that drafting, admission, this forward) and the tokens it gave
            # are that choice's. A cycle that also prefilled a prompt chunk is not learned from.
            if self._cycle is not None:
                made, n, since = self._cycle
                self._learn_rate(n, made, self._step_tokens, t_verify - since, prefill)
            self._cycle = None if choice is None else (choice, len(active), t_verify)

    def _begin(self, free: list[Slot], job: Job) -> Slot | None:
        """Put a job into one of the ``free`` slots (tokenizing its prompt here): the one whose caches
        keep the longest prefix of its prompt (a chat's next turn finds its history in the slot
        that ran the turn before, whatever ran beside it); on ties the one used least recently, whose
        history is the least likely to be asked for again. The slot, or None when the job is
        cancelled or refused."""
        if job.cancelled.is_set():
            self._release(job)
            return None
        job.outbox = self._outbox
        try:
            if job.prepare is not None:
                job.prompt_ids, job.stop = job.prepare()
                job.prepare = None
            self.drafter(job.method)
            slot = free[0] if len(free) == 1 else max(
                free, key=lambda s: (s.engine.reusable(job.request(s.drafter(job.method))), -s.t0))
            slot.start(job)
        except ApiError as e:
            job.send("error", e)
            self._release(job)
            return None
        except DdspecError as e:
            job.send("error", ApiError(400, str(e)))
            self._release(job)
            return None
        except Exception as e:  # a bug: answer 500, keep serving
            log.exception("starting a generation failed")
            job.send("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
            self._release(job)
            return None
        return slot

    def _advance(self, slot: Slot, value) -> None:
        """Run a slot's generation up to its next forward (``value``: the output of the one it waited
        for, or None to start / resume it), sending its chunks; finish the job when it ends."""
        job = slot.job
        if job is None or (value is None and slot.pending is not None):
            return
        try:
            while True:
                if job.cancelled.is_set():
                    self._end(slot)
                    return
                item = slot.steps.send(value) if value is not None else next(slot.steps)
                value = None
                if isinstance(item, Forward):
                    slot.pending = item
                    return
                self._emit(slot, item)
        except StopIteration as done:
            if done.value.finish_reason != "cancelled":
                job.send("done", done.value)
            self._end(slot)
        except ApiError as e:
            self._fail(slot, e)
        except DdspecError as e:
            self._fail(slot, ApiError(400, str(e)))
        except Exception as e:  # a bug: answer 500, keep serving
            log.exception("generation failed")
            self._fail(slot, ApiError(500, f"internal error during generation: {type(e).__name__}: {e}",
                                      kind="server_error"))

    def _emit(self, slot: Slot, chunk: Chunk) -> None:
        if chunk.step is not None:
            step = chunk.step
            self._step_tokens += step.accepted + 1
            if self.on_step is not None:
                self.on_step(chunk.step)
        slot.job.send("chunk", chunk)

    def _fail(self, slot: Slot, error: ApiError) -> None:
        if slot.job is not None:
            slot.job.send("error", error)
        self._end(slot)

    def _end(self, slot: Slot) -> None:
        job = slot.job
        slot.close()
        if job is not None:
            self._release(job)
            if not job.cancelled.is_set():
                self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - slot.t0)

    explore_every, explore_steps, max_backoff, rate_decay, margin = 64, 4, 4, 0.95, 0.05  # see _choose_drafting
    draft_margin = 0.05  # drafting allowed only where it has been the faster by this much more (see _choose_drafting)

    def _choose_drafting(self, active: list[Slot]) -> bool | None:
        """Whether the cost-aware slots may draft this step: with several sequences, whichever of
        drafting allowed / held back has given more tokens per second at this load class (each
        tried first; the other again for ``explore_steps`` steps after every ``explore_every``, that
        wait doubling up to ``max_backoff`` times while it stays the worse: a try of the worse kind
        costs the whole batch). Held back is the kind in use at first, and drafting replaces it only
        where its rate has been better by ``margin`` and ``draft_margin`` (about 10%; it then stays
        while it is not the slower): rates measured at different moments carry the machine's noise,
        and where speculation gains a few percent under load, a mistaken choice of it costs as much.
        None: no choice to make (one sequence, whose own policy decides as outside a batch, or none
        with a cost-aware policy): such steps are not learned from, or plain decoding's steps would
        count as steps with drafting allowed."""
        n = len(active)
        if n < 2 or not any(s.policy is not None for s in active):
            return None
        load = self._load(n)
        choice = self._choices.get(load)
        if choice is None:
            choice = self._choices[load] = PairedRateChoice(self.explore_every, self.explore_steps, self.max_backoff,
                                                            self.rate_decay, self.margin, self.draft_margin,
                                                            in_use=False)
        # where no sequence's tree or lookup chain could pay at this step's prices, there is nothing to
        # try: the step is plain, and learned as such (allowed, such steps cost the batch the rows of the
        # policies' own explorations and measure nothing but the machine's noise)
        return choice.choose() and any(s.may_draft() for s in active)

    @staticmethod
    def _load(n: int) -> int:
        """The load class of ``n`` sequences: 2, 3-4, 5-8, 9-16, ... (sizes whose steps cost alike
        share their measurements: 16 clients keep 13-16 sequences running, each count seen too
        seldom for rates of its own)."""
        return 1 << (n - 1).bit_length()

    def _learn_rate(self, n: int, drafting: bool, tokens: int, seconds: float, prefill: bool = False) -> None:
        """A cycle's tokens and seconds (see _run) for the choice at the load class of ``n`` sequences,
        unless it ran a prefill chunk (whose rows cost the step much and give no token: whichever
        choice met it would look worse)."""
        choice = self._choices.get(self._load(n))  # made by _choose_drafting for that load
        if choice is not None and tokens and not prefill:
            choice.observe(drafting, tokens, seconds)

    @staticmethod
    def _price(active: list[Slot]) -> None:
        """Each cost-aware slot learns what its tree is priced beside: the plain batch of the others (a
        row and a token each, no draft time; see the module docstring)."""
        others = len(active) - 1
        for s in active:
            if s.policy is not None:
                s.policy.batch = (others, float(others), 0.0)

