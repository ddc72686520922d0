"""The one generation loop: prefill, then (draft, verify, commit) per step.

Streaming is the primitive (:meth:`Engine.stream` yields :class:`Chunk`s as tokens are
decided); :meth:`Engine.generate` collects a stream. Plain decoding is this same loop with no
drafter: every step verifies a tree of one node (the root) and emits its bonus token.

Token bookkeeping (docs/design.md §1): the *root* is the newest chosen token whose own target
forward has not run yet. It is emitted as soon as it is chosen; a step then runs the root and
its drafted descendants through the target, emits the accepted ones and the bonus token, and
the bonus token becomes the next root. A step therefore emits ``accepted + 1`` tokens.

Prefix reuse (``Engine(..., reuse_prefix=True)``): the engine remembers which tokens its
target's KV cache holds after a generation. The next prompt keeps the longest common prefix of
the caches and prefills only the rest (a follow-up chat turn runs only its new tokens). The
head's entry at position t reads (f_t, token_{t+1}), so a drafter keeps one position less than
the common prefix with (held tokens + the last root); the target is cut at the same place and
re-runs from there, which also gives a fused head the target layers it reads. Outputs are the
same with and without reuse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ddspec.config import SamplingConfig, StopConfig
from ddspec.draft.base import Drafter
from ddspec.errors import DdspecError
from ddspec.models.base import TargetModel, TargetOutput
from ddspec.sampling import PositionNoise, next_token
from ddspec.tree import DraftTree
from ddspec.verify import Verdict, verify_greedy, verify_sampling


@dataclass(slots=True)
class Forward:
    """A target forward a generation asks for (:meth:`Engine.steps` yields it and is sent the output):
    whoever drives the generation runs it, alone (:meth:`Engine.stream`) or beside other sequences'
    (server/batch.py), and sets ``seconds`` to the time it took."""

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    hidden_layers: tuple[int, ...]
    last_logits: bool = False
    seconds: float = 0.0

    def run(self, target, clock=time.perf_counter) -> TargetOutput:
        """Run on ``target`` alone and time it (``clock``: seconds as a float)."""
        t = clock()
        out = target.forward(self.tokens, self.positions, self.mask, self.hidden_layers, last_logits=self.last_logits)
        self.seconds = clock() - t
        return out


@dataclass(slots=True)
class StepStats:
    accepted: int  # drafted tokens the target agreed with (the step emitted accepted + 1)
    tree_size: int  # nodes verified, root included
    draft_ms: float
    verify_ms: float  # target forward + acceptance decision
    depth: int = 0  # deepest level of the proposed tree
    gap_ms: float = 0.0  # time since the previous step outside draft and verify (emitting, the consumer)
    predicted_tokens: float = 0.0  # what the cost-aware method expected this step to emit (0: no prediction)
    predicted_ms: float = 0.0  # ... and to take


@dataclass(slots=True)
class StepTrace:
    """The verified tree of one step, for display (``stream(..., trace=True)`` only)."""

    tokens: list[int]  # [N] node tokens, tokens[0] = the root
    parents: list[int]  # [N] parents[0] = -1
    scores: list[float]  # [N] draft log-probability of the path to each node
    path: list[int]  # node indices of the accepted path, root first


@dataclass(slots=True)
class RunStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt positions whose KV came from the previous generation (reuse_prefix)
    new_tokens: int = 0
    prefill_s: float = 0.0
    wall_s: float = 0.0  # whole generation call, prefill included
    finish_reason: str = ""  # eos | stop_string | length
    steps: list[StepStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def tau_histogram(self) -> dict[int, int]:
        """How many steps emitted 1, 2, ... tokens."""
        hist: dict[int, int] = {}
        for s in self.steps:
            hist[s.accepted + 1] = hist.get(s.accepted + 1, 0) + 1
        return hist

    @property
    def tau(self) -> float:
        """Mean accepted length: new tokens per target forward (docs/design.md §1)."""
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps) if self.steps else 0.0


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]  # tokens decided by this step (possibly empty near a stop)
    text: str  # printable text added by them (may lag by a partial UTF-8 character)
    step: StepStats | None  # None for the prefill's first token
    tree: StepTrace | None = None  # the step's tree and accepted path, when asked for (trace=True)


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: RunStats


class TextAssembler:
    """Incremental detokenisation with stop-string detection, O(new tokens) per step.

    The text of the newest tokens is the difference of two decodes that start at the same
    ``prefix_offset`` (so tokenizers that treat a leading space specially decode consistently);
    a partial UTF-8 character is held back until the token that completes it arrives.
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        # a fast (Rust) tokenizer without transformers' clean-up decodes to the same text straight from its
        # backend, without the wrapper's argument conversions (two decodes per step and sequence)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = (backend if type(backend).__module__.startswith("tokenizers")
                         and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None)
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.decoded = ""  # text of ids[:read_offset]
        self.text = ""  # text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.decoded += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def add(self, ids: list[int]) -> str:
        """Text to hand out after ``ids``: held back while it could still start a stop string."""
        if self.stopped:
            return ""
        self.ids += ids
        before = len(self.decoded)
        self._advance()
        full = self.decoded
        longest = max((len(s) for s in self.stop_strings), default=0)
        for s in self.stop_strings:
            cut = full.find(s, max(0, before - longest))
            if cut >= 0:
                self.stopped = True
                full = full[:cut]
        ready = full if self.stopped else full[: len(full) - self._held_back(full)]
        delta, self.text = ready[len(self.text) :], ready
        return delta

    def _held_back(self, full: str) -> int:
        """Length of the tail that is a prefix of some stop string."""
        longest = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(full)), longest, -1):
                if full.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """At the end of generation: whatever was held back (no stop string completed it)."""
        if self.stopped:
            return ""
        full = self.decoded + self._decode(self.ids[self.read_offset :]) if self.read_offset < len(self.ids) else self.decoded
        delta, self.text = full[len(self.text) :], full
        return delta


@dataclass(slots=True)
class Request:
    """One generation as a value: what to answer and how. :meth:`Engine.steps` reads it and writes none
    of it onto the engine, so one engine (or one slot of a batch) serves requests of any method and
    sampling one after another, and a scheduler holds each running request's settings in the request.
    The drafter is the request's: it holds that method's draft state (a head's KV cache)."""

    prompt_ids: list[int]
    stop: StopConfig = field(default_factory=StopConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    drafter: Drafter | None = None  # None: plain decoding
    method: str = "vanilla"  # the method's name, for reports
    reuse_prefix: bool = False  # keep the cached positions this prompt shares with the last generation
    trace: bool = False  # attach each step's tree and accepted path to its chunk
    cancelled: Callable[[], bool] | None = None  # asked between prefill chunks: True ends the generation


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        sampling: SamplingConfig = SamplingConfig(),
        reuse_prefix: bool = False,
        clock=time.perf_counter,
        method: str | None = None,
    ) -> None:
        """drafter, sampling, reuse_prefix, method: the defaults of a :meth:`request` built from a bare
        prompt (the CLI's and the bench's single-method engines); a :class:`Request` carries its own.
        clock: seconds as a float (time.perf_counter); tests inject a deterministic one."""
        self.target, self.drafter, self.sampling, self.clock = target, drafter, sampling, clock
        self.method = method or ("vanilla" if drafter is None else type(drafter).__name__)
        self.reuse_prefix = reuse_prefix
        # what the caches hold after the last generation: the target's tokens, the last root (the
        # head's newest entry reads it) and the drafter that holds the head entries; None = unknown
        self._held: list[int] | None = None
        self._held_root = -1
        self._held_drafter: Drafter | None = None

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _choose(out: TargetOutput, noise: PositionNoise, position: int, sampling: SamplingConfig) -> torch.Tensor:
        """The first root (the token at ``position``, the prompt's length), from the prefill's last row."""
        if sampling.greedy and out.argmax is not None:
            return out.argmax[-1]
        return next_token(out.logits[-1], sampling, noise.uniform(position))

    @staticmethod
    def _verify(tree: DraftTree, out: TargetOutput, noise: PositionNoise, position: int,
                sampling: SamplingConfig) -> Verdict:
        """The verdict on a tree whose root sits at ``position``. Sampling draws each token with the
        uniform of its position (docs/design.md §2.5): the same tokens whatever the tree."""
        if sampling.greedy:
            return verify_greedy(tree, out.logits, out.argmax)
        return verify_sampling(tree, out.logits, sampling, noise.after(position))

    def _budget(self, prompt_len: int, stop: StopConfig) -> int:
        window = self.target.info.max_position
        if prompt_len >= window:
            raise DdspecError(
                f"the prompt is {prompt_len} tokens but the model's context window is {window}: "
                "shorten the prompt (or the chat history)"
            )
        return min(stop.max_new_tokens, window - prompt_len)

    # -- prefix reuse --------------------------------------------------------------------
    def reusable(self, req: Request) -> int:
        """Prompt positions the caches can keep from the last generation (0 = prefill all)."""
        held, prompt_ids = self._held, req.prompt_ids
        if not req.reuse_prefix or held is None or self._held_drafter is not req.drafter:
            return 0
        if self.target.cache_length != len(held):  # someone else ran the target meanwhile
            return 0
        seq = held + [self._held_root] if req.drafter else held
        n = 0
        for a, b in zip(seq, prompt_ids):
            if a != b:
                break
            n += 1
        if req.drafter:
            n -= 1  # the head's entry at n - 1 read token n, which must match too
        return max(0, min(n, len(prompt_ids) - 1))  # the last prompt token always runs (its logits)

    def _restore(self, req: Request, max_length: int) -> int:
        """Make the caches ready for the request's prompt; return how many positions they keep."""
        keep = self.reusable(req)
        self._held = None  # unknown until this generation has committed something
        if keep:
            self.target.reserve(max_length)
            self.target.truncate(keep)
            if req.drafter:
                req.drafter.resume(max_length, keep)
        else:
            self.target.reset(max_length)
            if req.drafter:
                req.drafter.reset(max_length)
        return keep

    def _remember(self, held: list[int], root: int, drafter: Drafter | None) -> None:
        self._held, self._held_root, self._held_drafter = held, root, drafter

    # -- the loop ------------------------------------------------------------------------
    def request(self, prompt_ids: list[int], stop: StopConfig = StopConfig(), trace: bool = False,
                cancelled=None) -> Request:
        """A :class:`Request` for ``prompt_ids`` with this engine's defaults (drafter, sampling, method,
        prefix reuse)."""
        return Request(list(prompt_ids), stop, self.sampling, self.drafter, self.method, self.reuse_prefix, trace,
                       cancelled)

    def stream(self, prompt_ids: "list[int] | Request", stop: StopConfig = StopConfig(), trace: bool = False,
               cancelled=None) -> Iterator[Chunk]:
        """Generate a :class:`Request` (or after ``prompt_ids`` with this engine's defaults), yielding
        chunks; returns the RunStats (StopIteration.value).

        trace: attach each step's tree and accepted path to its chunk (for display; costs host syncs).
        Closing the generator between chunks stops the generation and leaves the engine ready.
        cancelled: a callable asked between prefill chunks (a long prompt takes seconds before its
        first chunk): when it returns True the stream ends at once, with no chunk and finish_reason
        "cancelled", and the engine is ready for the next prompt.
        """
        steps = self.steps(prompt_ids, stop, trace, cancelled)
        try:
            item = next(steps)
            while True:
                if isinstance(item, Forward):
                    item = steps.send(item.run(self.target, self.clock))
                else:
                    yield item
                    item = next(steps)
        except StopIteration as done:
            return done.value
        finally:
            steps.close()

    def steps(self, prompt_ids: "list[int] | Request", stop: StopConfig = StopConfig(), trace: bool = False,
              cancelled=None) -> Iterator["Chunk | Forward"]:
        """:meth:`stream` with its target forwards handed out: yields a :class:`Forward` wherever the
        generation needs one (send it the output) and a :class:`Chunk` wherever it emits tokens
        (resume it with next()). A scheduler drives several of these and runs their forwards together."""
        req = prompt_ids if isinstance(prompt_ids, Request) else self.request(prompt_ids, stop, trace, cancelled)
        prompt_ids, stop, trace, cancelled = req.prompt_ids, req.stop, req.trace, req.cancelled
        drafter, sampling = req.drafter, req.sampling
        clock = self.clock
        t0 = clock()
        stats = RunStats(prompt_tokens=len(prompt_ids))
        if not prompt_ids:
            raise DdspecError("the prompt is empty: give at least one token of input")
        budget = self._budget(len(prompt_ids), stop)
        noise = PositionNoise(sampling.seed)  # a position's uniform: the same in every method
        eos = set(self.target.info.eos_token_ids) if stop.stop_on_eos else set()
        text = TextAssembler(self.target.tokenizer, stop.stop_strings)
        tree_room = drafter.max_tree_size if drafter else 1
        if drafter:
            drafter.score_for(sampling)
        hidden_layers = drafter.hidden_layers if drafter else ()

        # 1. Prefill: run the prompt (past what the caches keep, with reuse_prefix), choose the
        #    first root, let the drafter take the prompt in.
        start = stats.reused_tokens = self._restore(req, len(prompt_ids) + budget + tree_room)
        prompt = torch.tensor(prompt_ids[start:], dtype=torch.long)
        out = yield from self._prefill(prompt, start, hidden_layers, cancelled)
        if out is None:  # cancelled between chunks: the caches hold an unknown prefix (_restore forgot it)
            stats.finish_reason, stats.wall_s = "cancelled", clock() - t0
            return stats
        root = self._choose(out, noise, len(prompt_ids), sampling)
        if drafter:
            drafter.prefill(prompt, out, root)
        stats.prefill_s = clock() - t0
        emitted = [int(root)]
        held = list(prompt_ids)  # the tokens whose KV the target holds
        self._remember(held, emitted[0], drafter)
        finish = self._finish(emitted, eos, budget)
        yield Chunk(emitted[:], text.add(emitted[:]), None)
        t_done = clock()

        while not finish and not text.stopped:
            # 2. Draft: a tree rooted at the newest chosen token.
            t_draft = clock()
            position = self.target.cache_length
            tree = drafter.propose(root, position) if drafter else DraftTree.root_only(root)
            t_verify = clock()
            # 3. Verify: one target forward over the whole tree, then the acceptance rule.
            mask = tree.attention_mask() if tree.size > 1 else None
            forward = Forward(tree.tokens, tree.positions(position), mask, hidden_layers)
            out = yield forward
            t_resumed = clock()  # the forward took forward.seconds (beside other sequences' when batched)
            verdict = self._verify(tree, out, noise, position, sampling)
            # 4. Commit: keep the accepted path's KV; the drafter refreshes its own state.
            self.target.commit(verdict.path)
            if drafter:
                drafter.observe(tree, verdict, out)
            gap_ms, t_done = (t_draft - t_done) * 1e3, clock()
            # 5. Emit: the accepted drafted tokens and the bonus token (the next root).
            accepted = tree.tokens[verdict.path[1:]].tolist()
            held += [self._held_root] + accepted
            root = verdict.bonus
            new = accepted + [int(root)]
            self._remember(held, new[-1], drafter)
            step = StepStats(
                verdict.accepted, tree.size, (t_verify - t_draft) * 1e3, (forward.seconds + t_done - t_resumed) * 1e3,
                int(tree.depths.max()), gap_ms,
            )
            self._learn_costs(step, drafter)
            stats.steps.append(step)
            shown = self._trace(tree, verdict) if trace else None
            new = new[: budget - len(emitted)]
            new = self._cut_at_eos(new, eos)
            emitted += new
            finish = self._finish(emitted, eos, budget)
            yield Chunk(new, text.add(new), step, shown)

        tail = text.flush()
        if tail:
            yield Chunk([], tail, None)
        stats.new_tokens = len(emitted)
        stats.finish_reason = "stop_string" if text.stopped else finish
        stats.wall_s = clock() - t0
        return stats

    # rows per prefill forward: a cancellation waits at most one chunk (a fraction of a second on a
    # CPU for a small model); chunks of this size keep the matmuls as efficient as one forward
    prefill_chunk = 256

    def _prefill(self, prompt: torch.Tensor, start: int, hidden_layers: tuple[int, ...],
                 cancelled=None) -> Iterator[Forward]:
        """Run the prompt's uncached tokens (positions from ``start``) through the target in chunks of
        ``prefill_chunk``, asking ``cancelled()`` before each; None when it said stop. The result is the
        whole prompt's features and hidden states (the drafter reads every row) and the last logits.
        A generator: yields each chunk's :class:`Forward` and returns the result."""
        n, size = prompt.numel(), max(1, self.prefill_chunk)
        outs: list[TargetOutput] = []
        for a in range(0, n, size):
            if cancelled is not None and cancelled():
                return None
            b = min(n, a + size)
            outs.append((yield Forward(prompt[a:b], torch.arange(start + a, start + b), None, hidden_layers,
                                       last_logits=True)))
        if len(outs) == 1:
            return outs[0]
        last = outs[-1]
        return TargetOutput(
            logits=last.logits, argmax=last.argmax,
            features=torch.cat([o.features for o in outs]),
            hidden_states={k: torch.cat([o.hidden_states[k] for o in outs]) for k in last.hidden_states},
        )

    @staticmethod
    def _learn_costs(step: StepStats, drafter: Drafter | None) -> None:
        """Record the drafter's prediction of the step and hand it the step's timing (Drafter's hooks)."""
        if not drafter:
            return
        predicted = drafter.prediction
        if predicted is not None:
            step.predicted_tokens, step.predicted_ms = predicted
        drafter.observe_step(step.accepted + 1, step.tree_size, step.draft_ms, step.verify_ms, step.gap_ms)

    @staticmethod
    def _trace(tree: DraftTree, verdict: Verdict) -> StepTrace:
        return StepTrace(tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist(), verdict.path.tolist())

    @staticmethod
    def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[: i + 1]
        return tokens

    @staticmethod
    def _finish(emitted: list[int], eos: set[int], budget: int) -> str:
        if emitted and emitted[-1] in eos:
            return "eos"
        return "length" if len(emitted) >= budget else ""

    def generate(self, prompt_ids: list[int], stop: StopConfig = StopConfig()) -> GenerationResult:
        ids: list[int] = []
        text: list[str] = []
        stream = self.stream(prompt_ids, stop)
        while True:
            try:
                chunk = next(stream)
            except StopIteration as done:
                return GenerationResult(ids, "".join(text), done.value)
            ids += chunk.token_ids
            text.append(chunk.text)
