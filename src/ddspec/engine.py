"""The one generation loop: prefill, then (draft, verify, commit) per step.

Streaming is the primitive (:meth:`Engine.stream` yields :class:`Chunk`s as tokens are
decided); :meth:`Engine.generate` collects a stream. Plain decoding is this same loop with no
drafter: every step verifies a tree of one node (the root) and emits its bonus token.

Token bookkeeping (DESIGN.md §1): the *root* is the newest chosen token whose own target
forward has not run yet. It is emitted as soon as it is chosen; a step then runs the root and
its drafted descendants through the target, emits the accepted ones and the bonus token, and
the bonus token becomes the next root. A step therefore emits ``accepted + 1`` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ddspec.config import SamplingConfig, StopConfig
from ddspec.draft.base import Drafter
from ddspec.errors import DdspecError
from ddspec.models.base import TargetModel
from ddspec.sampling import make_generator, next_token
from ddspec.tree import DraftTree
from ddspec.verify import Verdict, verify_greedy, verify_sampling


@dataclass(slots=True)
class StepStats:
    accepted: int  # drafted tokens the target agreed with (the step emitted accepted + 1)
    tree_size: int  # nodes verified, root included
    draft_ms: float
    verify_ms: float  # target forward + acceptance decision
    depth: int = 0  # deepest level of the proposed tree


@dataclass(slots=True)
class RunStats:
    prompt_tokens: int = 0
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
        """Mean accepted length: new tokens per target forward (DESIGN.md §1)."""
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps) if self.steps else 0.0


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]  # tokens decided by this step (possibly empty near a stop)
    text: str  # printable text added by them (may lag by a partial UTF-8 character)
    step: StepStats | None  # None for the prefill's first token


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
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.decoded = ""  # text of ids[:read_offset]
        self.text = ""  # text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
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


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        sampling: SamplingConfig = SamplingConfig(),
    ) -> None:
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.method = "vanilla" if drafter is None else type(drafter).__name__

    # -- helpers -------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return next_token(logits, self.sampling, generator)

    def _verify(self, tree: DraftTree, logits: torch.Tensor, generator: torch.Generator) -> Verdict:
        if self.sampling.greedy:
            return verify_greedy(tree, logits)
        return verify_sampling(tree, logits, self.sampling, generator)

    def _budget(self, prompt_len: int, stop: StopConfig) -> int:
        window = self.target.info.max_position
        if prompt_len >= window:
            raise DdspecError(
                f"the prompt is {prompt_len} tokens but the model's context window is {window}: "
                "shorten the prompt (or the chat history)"
            )
        return min(stop.max_new_tokens, window - prompt_len)

    # -- the loop ------------------------------------------------------------------------
    def stream(self, prompt_ids: list[int], stop: StopConfig = StopConfig()) -> Iterator[Chunk]:
        """Generate after ``prompt_ids``, yielding chunks; returns the RunStats (StopIteration.value)."""
        t0 = time.perf_counter()
        stats = RunStats(prompt_tokens=len(prompt_ids))
        if not prompt_ids:
            raise DdspecError("the prompt is empty: give at least one token of input")
        budget = self._budget(len(prompt_ids), stop)
        generator = make_generator(self.sampling.seed, self.target.device)
        eos = set(self.target.info.eos_token_ids) if stop.stop_on_eos else set()
        text = TextAssembler(self.target.tokenizer, stop.stop_strings)
        tree_room = self.drafter.max_tree_size if self.drafter else 1
        hidden_layers = self.drafter.hidden_layers if self.drafter else ()

        # 1. Prefill: run the prompt, choose the first root, let the drafter take the prompt in.
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        self.target.reset(len(prompt_ids) + budget + tree_room)
        out = self.target.forward(prompt, torch.arange(len(prompt_ids)), None, hidden_layers)
        root = self._choose(out.logits[-1], generator)
        if self.drafter:
            self.drafter.reset(len(prompt_ids) + budget + tree_room)
            self.drafter.prefill(prompt, out, root)
        stats.prefill_s = time.perf_counter() - t0
        emitted = [int(root)]
        finish = self._finish(emitted, eos, budget)
        yield Chunk(emitted[:], text.add(emitted[:]), None)

        while not finish and not text.stopped:
            # 2. Draft: a tree rooted at the newest chosen token.
            t_draft = time.perf_counter()
            position = self.target.cache_length
            tree = self.drafter.propose(root, position) if self.drafter else DraftTree.root_only(root)
            t_verify = time.perf_counter()
            # 3. Verify: one target forward over the whole tree, then the acceptance rule.
            mask = tree.attention_mask() if tree.size > 1 else None
            out = self.target.forward(tree.tokens, tree.positions(position), mask, hidden_layers)
            verdict = self._verify(tree, out.logits, generator)
            # 4. Commit: keep the accepted path's KV; the drafter refreshes its own state.
            self.target.commit(verdict.path)
            if self.drafter:
                self.drafter.observe(tree, verdict, out)
            t_done = time.perf_counter()
            # 5. Emit: the accepted drafted tokens and the bonus token (the next root).
            root = verdict.bonus
            new = tree.tokens[verdict.path[1:]].tolist() + [int(root)]
            step = StepStats(
                verdict.accepted, tree.size, (t_verify - t_draft) * 1e3, (t_done - t_verify) * 1e3,
                int(tree.depths.max()),
            )
            stats.steps.append(step)
            new = new[: budget - len(emitted)]
            new = self._cut_at_eos(new, eos)
            emitted += new
            finish = self._finish(emitted, eos, budget)
            yield Chunk(new, text.add(new), step)

        tail = text.flush()
        if tail:
            yield Chunk([], tail, None)
        stats.new_tokens = len(emitted)
        stats.finish_reason = "stop_string" if text.stopped else finish
        stats.wall_s = time.perf_counter() - t0
        return stats

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
