"""Frozen, validated configuration dataclasses.

Each class checks its own fields on construction, so an invalid value fails at the point where
it enters the program with a message that names the field (and the CLI flag it comes from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddspec.errors import ConfigError

# Measured (AMD EPYC, 2 threads, 2026-12-02; the shipped head, 24 training prompts, 128 tokens): a draft
# level at top_k 1 / 4 / 10 / 16 costs 0.52 / 1.10 / 2.29 / 3.44 ms with q4_1a8 against 0.90 / 1.59 / 2.98 /
# 4.53 with q8_0 (0.65 / 1.23 / 2.68 / 4.25 with q8_0a8), for an EAGLE-2 tau of 4.081 against 4.100
# (exact weights: 4.094); chain@d2 ran 6-7% faster with the int8 target, 2% with fp32, at the same tau.
# The draft heads' default weights (draft/packed.py; the target times their kernels too, models/tuning.choose_passes).
DEFAULT_DRAFT_WEIGHTS = "q4_1a8"


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How the next token is chosen from the target's logits.

    temperature 0 means greedy (argmax); top_p and top_k only apply when sampling.
    """

    temperature: float = 0.0  # 0 = greedy; the lossless guarantee is exact-equality there
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1 disables
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    seed: int | None = None  # fixes the uniform of every position (sampling.PositionNoise); None: from the OS

    def __post_init__(self) -> None:
        t = _check_number("temperature (--temperature)", self.temperature)
        if t < 0 or math.isinf(t):
            raise ConfigError(f"temperature (--temperature) must be >= 0 and finite, got {t}")
        p = _check_number("top_p (--top-p)", self.top_p)
        if not 0 < p <= 1:
            raise ConfigError(f"top_p (--top-p) must be in (0, 1], got {p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k (--top-k) must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed (--seed) must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class StopConfig:
    """When generation ends: whichever of these comes first."""

    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"max_new_tokens (--max-new-tokens) must be an integer >= 1, got {n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop_strings!r}")


TREE_SHAPES = ("chain", "static", "dynamic")
DEPTH_POLICIES = ("fixed", "ddd", "cost")


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """Shape and size of the draft tree, and when to stop growing it.

    Defaults follow EAGLE-2 (top_k 10, 6 levels, 60 verified tokens) and DDD (checks after
    levels 5, 7, 9 at threshold -0.3, at most 11 levels). Levels count from the root's
    children: the first top-k is level 1 (= depth 1), so "depth 6" drafts 6 tokens deep.
    """

    shape: str = "dynamic"  # chain | static (EAGLE-1 index paths) | dynamic (EAGLE-2)
    top_k: int = 10  # children kept per expanded node, and the beam width of the frontier
    depth: int = 6  # levels drafted by the fixed policy (chain length for shape="chain")
    total_tokens: int = 60  # tokens verified per step, root included (dynamic trees)
    static_paths: tuple[tuple[int, ...], ...] | None = None  # None = the built-in EAGLE-1-style tree
    depth_policy: str = "fixed"  # fixed | ddd | cost (measured costs, see tree/cost.py)
    ddd_threshold: float = -0.3  # stop when logsumexp(frontier scores) < this (log-probability)
    ddd_check_depths: tuple[int, ...] = (5, 7, 9)  # levels after which DDD checks the beam
    max_depth: int = 11  # hard cap on levels for DDD
    # greedy decoding scores tree nodes with log_softmax(draft logits / T): None = the head's fitted
    # value (its config's ddspec.draft_temperature, 1 when absent); sampling always uses T = 1
    draft_temperature: float | None = None
    # a head drafting over a reduced vocabulary through the target's lm_head also drafts up to this
    # many tokens of the context that its vocabulary lacks (draft/context_vocab.py); 0 = off
    context_vocab: int = 256
    # drafts where the context offers none (lookup, and ddspec's lookup chain): the target's own earlier
    # answers as an n-gram table (draft/ngram_table.py): "auto" = the one shipped for the target, if
    # any; "none" = off; or a file written by `ddspec ngrams`
    ngram_table: str = "auto"
    # a smaller model of the target's tokenizer (a .gguf file or a model folder) that drafts the chain or
    # dynamic tree instead of a draft head (draft/model.py); None = a head
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.shape not in TREE_SHAPES:
            raise ConfigError(f"tree shape must be one of {', '.join(TREE_SHAPES)}, got {self.shape!r}")
        if self.depth_policy not in DEPTH_POLICIES:
            raise ConfigError(
                f"depth policy must be one of {', '.join(DEPTH_POLICIES)}, got {self.depth_policy!r}"
            )
        for name, flag, value in (
            ("top_k", "--tree-top-k", self.top_k),
            ("depth", "--depth", self.depth),
            ("total_tokens", "--total-tokens", self.total_tokens),
            ("max_depth", "--max-depth", self.max_depth),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} ({flag}) must be an integer >= 1, got {value!r}")
        if self.depth_policy != "fixed" and self.shape != "dynamic":
            raise ConfigError(f"the {self.depth_policy} depth policy grows dynamic trees only; "
                              f"the {self.shape} shape has a fixed depth")
        if isinstance(self.context_vocab, bool) or not isinstance(self.context_vocab, int) or self.context_vocab < 0:
            raise ConfigError(f"context_vocab (--context-vocab) must be an integer >= 0 (0 = off), "
                              f"got {self.context_vocab!r}")
        if not isinstance(self.ngram_table, str) or not self.ngram_table:
            raise ConfigError(f"ngram_table (--ngram-table) must be auto, none or a file, got {self.ngram_table!r}")
        threshold = _check_number("ddd_threshold (--ddd-threshold)", self.ddd_threshold)
        if threshold > 0 or math.isinf(threshold):
            raise ConfigError(
                f"ddd_threshold (--ddd-threshold) is a log-probability and must be <= 0, got {threshold}"
            )
        if self.draft_temperature is not None:
            t = _check_number("draft_temperature (--draft-temperature)", self.draft_temperature)
            if not 0 < t <= 10:
                raise ConfigError(f"draft_temperature (--draft-temperature) must be in (0, 10], got {t}")
        checks = self.ddd_check_depths
        if not checks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in checks):
            raise ConfigError(
                f"ddd_check_depths (--ddd-check-depths) must be levels >= 1, got {checks!r}"
            )
        if any(c > self.max_depth for c in checks):
            raise ConfigError(
                f"ddd_check_depths {checks} go past max_depth (--max-depth) {self.max_depth}"
            )
        if self.static_paths is not None:
            if not self.static_paths or any(
                not p or any(not isinstance(i, int) or i < 0 for i in p) for p in self.static_paths
            ):
                raise ConfigError("static_paths must be non-empty lists of child ranks >= 0")
