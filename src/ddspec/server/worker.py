"""One engine, one thread: generations run one at a time, in the order they were admitted.

The engine is not re-entrant (its target and drafters hold one sequence's KV caches), so a
single worker thread owns it, its tokenizer and its drafters; request handlers only put
:class:`Job`s into a bounded queue and read the job's events. Beyond the bound a request is
refused at once (429), never queued without limit.

A job is admitted before any work is done for it: the handler checks the request's fields and
queues it; the prompt is tokenized (``Job.prepare``) here, on the worker's thread, so a long prompt
neither holds the event loop (every endpoint, /health too) nor gets past the queue bound.

A job's events reach the handler's event loop through ``call_soon_threadsafe``:
``("chunk", Chunk)``, then ``("done", RunStats)``, or ``("error", ApiError)``. A handler that
loses its client calls :meth:`Job.cancel`; the worker checks it before every decoding step and
closes the engine's stream, so the generation stops within one step and the engine is free; the
engine also asks it between prefill chunks, so a long prompt stops within one chunk.
Drafters are built on first use of each method (a tree method loads the draft head once, and
every drafter shares the one target), so a per-request method costs nothing until it is asked.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.engine import Engine, Request
from ddspec.errors import DdspecError
from ddspec.server.protocol import ApiError

log = logging.getLogger("ddspec.server")
MAX_DRAFTERS = 8  # methods whose drafters stay built


@dataclass(eq=False)
class Job:
    prompt_ids: list[int] | None  # None until ``prepare`` has run (on the worker's thread)
    stop: StopConfig | None
    sampling: SamplingConfig
    method: str
    prefix_reuse: bool
    trace: bool
    loop: asyncio.AbstractEventLoop
    prepare: object = None  # () -> (prompt_ids, StopConfig): tokenizes and checks the context; raises ApiError
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted: float = field(default_factory=time.perf_counter)
    release: object = None  # set by EngineWorker.submit: frees the job's place in the queue bound
    released: bool = False
    outbox: "Outbox | None" = None  # set by a batching worker: events wait there for the end of the step

    def request(self, drafter) -> Request:
        """The engine's request for this job (after ``prepare``), drafting with ``drafter`` (the job's
        method's, or None): the job's settings travel with it; nothing is written onto the engine."""
        return Request(self.prompt_ids, self.stop, self.sampling, drafter, self.method, self.prefix_reuse, self.trace,
                       self.cancelled.is_set)

    def cancel(self) -> None:
        """Stop the job (idempotent): a waiting job is skipped, a running one stops before its next step."""
        self.cancelled.set()
        if self.release is not None:
            self.release(self)

    def send(self, kind: str, payload) -> None:
        """From the worker thread: hand an event to the handler's loop (dropped if that loop closed),
        or to the job's :class:`Outbox`, which hands it over with the step's other events."""
        if self.outbox is not None:
            self.outbox.put(self, (kind, payload))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:
            pass


class Outbox:
    """Events of many jobs, handed to their event loops together: one ``call_soon_threadsafe`` per
    loop per :meth:`flush` instead of one per event. A batching worker's step emits a chunk for each
    of its sequences; each wake-up of the loop costs a write to its self-pipe and a turn of the loop
    (on a core the forward wants). Each job's events keep their order."""

    def __init__(self) -> None:
        self._events: dict[asyncio.AbstractEventLoop, list] = {}

    def put(self, job: Job, event: tuple) -> None:
        self._events.setdefault(job.loop, []).append((job.events, event))

    def flush(self) -> None:
        events, self._events = self._events, {}
        for loop, items in events.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop closed: its handlers are gone
                pass


def _deliver(items: list) -> None:
    for events, event in items:
        events.put_nowait(event)


class EngineWorker:
    """Runs jobs on one engine in a daemon thread; at most ``max_queue`` jobs wait or run."""

    def __init__(self, engine: Engine, make_drafter, default_method: str, max_queue: int = 16,
                 on_step=None) -> None:
        """make_drafter(method) -> a drafter or None (vanilla); on_step(StepStats) is called per step."""
        if max_queue < 1:
            raise DdspecError(f"--max-queue must be >= 1, got {max_queue}")
        self.engine, self._make_drafter, self.default_method = engine, make_drafter, default_method
        self.max_queue = max_queue
        self.on_step = on_step
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._admit = threading.Lock()
        self._depth = 0  # jobs admitted, neither finished nor cancelled (waiting + running)
        self._drafters: dict[str, object] = {}
        self.busy = False
        self.mean_job_s = 1.0  # running mean of job durations (for Retry-After)
        self._thread = threading.Thread(target=self._run, name="ddspec-engine", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        # What is alive now (the model, its tokenizer, the drafters built so far) lives as long as the
        # server: kept out of the cycle collector's full passes, which would otherwise walk all of it
        # (one such pass took 100 ms of a 4-second batched run of 16 requests, where a sequence's held-
        # back steps keep their forwards' outputs alive for its head and so set the passes off)
        gc.freeze()
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        gc.unfreeze()  # the process goes on (tests, a bench that stops one server of several)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def batch(self) -> int:
        """Requests decoded together at most (1: one at a time)."""
        return 1

    def drafter(self, method: str):
        """The drafter for ``method`` (built on first use; call from the worker thread or before start).
        At most ``MAX_DRAFTERS`` are kept (each holds a head KV cache): the least recently used other
        than the default method's goes first."""
        return kept_drafter(self._drafters, method, self._make_drafter, self.default_method)

    # -- admission ------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 429 ApiError when ``max_queue`` jobs are already waiting or running."""
        if not self.alive:
            raise ApiError(503, "the engine's worker thread has stopped: restart the server", kind="server_error")
        with self._admit:
            if self._depth >= self.max_queue:
                retry = max(1, round(self.mean_job_s * self._depth))
                raise ApiError(429, f"the server is busy: {self._depth} requests are queued or running (at most "
                                    f"{self.max_queue}); retry in about {retry} s", kind="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(retry)})
            self._depth += 1
        job.release = self._release
        self._queue.put(job)

    def _release(self, job: Job) -> None:
        """Give back a job's place (once): when it finishes, or when its client cancels it."""
        with self._admit:
            if not job.released:
                job.released = True
                self._depth -= 1

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                if not job.cancelled.is_set():
                    self.busy = True
                    self._generate(job)
            except ApiError as e:
                job.send("error", e)
            except DdspecError as e:
                job.send("error", ApiError(400, str(e)))
            except Exception as e:  # a bug: answer 500, keep serving (the engine re-prefills when unsure)
                log.exception("generation failed")
                job.send("error", ApiError(500, f"internal error during generation: {type(e).__name__}: {e}",
                                           kind="server_error"))
            finally:
                self.busy = False
                self._release(job)
                if not job.cancelled.is_set():
                    self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - t0)

    def _generate(self, job: Job) -> None:
        if job.prepare is not None:
            job.prompt_ids, job.stop = job.prepare()
            job.prepare = None
            if job.cancelled.is_set():
                return
        stream = self.engine.stream(job.request(self.drafter(job.method)))
        try:
            while not job.cancelled.is_set():
                try:
                    chunk = next(stream)
                except StopIteration as done:
                    if done.value.finish_reason != "cancelled":  # else: cancelled during the prefill
                        job.send("done", done.value)
                    return
                if chunk.step is not None and self.on_step is not None:
                    self.on_step(chunk.step)
                job.send("chunk", chunk)
        finally:
            stream.close()  # a cancelled job stops here, between two steps


def kept_drafter(drafters: dict, method: str, build, keep: str):
    """``drafters[method]``, built by ``build(method)`` on first use; at most ``MAX_DRAFTERS`` stay (each
    holds a head KV cache): the least recently used other than ``keep`` goes first."""
    if method not in drafters:
        if len(drafters) >= MAX_DRAFTERS:
            del drafters[next(m for m in drafters if m != keep)]
        drafters[method] = build(method)
    drafters[method] = drafters.pop(method)  # most recently used last
    return drafters[method]


def tree_drafter_factory(target, head_spec: str | None, tree: TreeConfig):
    """make_drafter(method[, handle]) for EngineWorker and BatchWorker: loads the draft head once, on the
    first tree method; a BatchWorker builds each slot's drafters on that slot's target handle."""
    from ddspec.methods import make_drafter, resolve_head, tree_config, uses_draft_model

    head = None
    shared: dict = {}  # the head's kernel-planned weights, built once for every slot and method

    def build(method: str, handle=None):
        """handle: the target handle the drafter serves (a batch slot's session; default the target)."""
        nonlocal head
        if tree_config(method, tree) is None:
            return None
        if head is None and not uses_draft_model(method, target, head_spec, tree):
            head = resolve_head(head_spec, target)
        return make_drafter(method, target if handle is None else handle, head, tree, shared=shared)

    return build
