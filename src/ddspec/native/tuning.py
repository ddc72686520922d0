"""Which of the kernels' options (native/options.py) run fastest on this machine: measured once per
CPU, kernel build, thread count and shapes, and cached (ddspec/measured.py, ``<cache root>/kernels/``).

- :func:`choose_wide`: the AVX-512 passes' groups per pass for each quantised kind, timed on a
  model's weights of that kind alone, and how far ahead the quantised passes prefetch;
- :func:`choose_prefetch_rows`: from how many rows of a pass on they prefetch, on a model's forward;
- :func:`tune_wide_on_forward`: the same passes chosen on a model's whole forward, which can
  prefer others than its matmuls alone do (those choices then stay over a later choose_wide);
- :func:`choose_attention_wide`: whether the shared attention runs on 16 lanes.

The results are the same bits whatever the choice; only the time differs. models/tuning.py says
what to time for a loaded model.
"""

from __future__ import annotations

import sys

import torch

from ddspec.machine import cpu_name, interleaved_medians
from ddspec.measured import Entry, measured_once
from ddspec.native.build import build_id
from ddspec.native.lib import library
from ddspec.native.options import (PREFETCH_OPTIONS, PREFETCH_ROWS_OPTIONS, WIDE_KINDS, WIDE_ROWS, attention_wide,
                                   prefetch_blocks, prefetch_rows, set_attention_wide, set_prefetch, set_prefetch_rows,
                                   set_wide, wide_available, wide_choice, wide_options)
from ddspec.native.weights import INT8_ACTIVATIONS, NativeWeight


def _cached_choice(name: str, what: str, key: dict, measure, apply) -> dict:
    """A kernel choice measured once per ``key`` (CPU, build, threads, shapes ...): the entry cached in
    ``<cache root>/kernels/<name>-*.json`` when its key matches and ``apply(entry)`` takes it, else
    ``measure()`` (a dict) now, applied, and cached unless other programs took the CPU meanwhile
    (:func:`ddspec.measured.measured_once`; ``what`` names it in the notice then). Returns the entry."""
    def use(data: dict) -> dict:
        apply(data)
        return data

    return measured_once(Entry("kernels", key, what, name), measure, use)


def _timed_over(weights: list[NativeWeight], rows: int):
    """A function multiplying ``rows`` random rows by every one of ``weights`` in turn (as a forward
    streams them), for timing."""
    xs = [torch.randn(rows, w.in_features) for w in weights]

    def run(_option=None) -> None:
        for w, x in zip(weights, xs):
            w(x)
    return run


def measure_prefetch(weights: list[NativeWeight], rows: tuple[int, ...] = (4, 8), reps: int = 9) -> int:
    """The option of PREFETCH_OPTIONS that multiplies tiles of ``rows`` rows by all of ``weights`` (a
    model's streamed weights, any kinds) fastest here, by the sum of each row count's median
    (:func:`~ddspec.machine.interleaved_medians`). Leaves that choice set."""
    medians = [interleaved_medians(PREFETCH_OPTIONS, _timed_over(weights, n), reps, setup=set_prefetch) for n in rows]
    best = min(PREFETCH_OPTIONS, key=lambda b: sum(m[b] for m in medians))
    set_prefetch(best)
    return best


def measure_wide(weights: list[NativeWeight], reps: int = 9) -> list[int]:
    """For each tile size 1..WIDE_ROWS, the groups per pass (of :func:`wide_options`) that multiply
    the rows by all of ``weights`` (one kind) fastest here, by their medians
    (:func:`measure_wide_on`, timing those matmuls alone). Leaves that choice set."""
    kind = weights[0].kind
    runs = {rows: _timed_over(weights, rows) for rows in range(1, WIDE_ROWS + 1)}
    return measure_wide_on(lambda rows: runs[rows](), [kind], reps)[kind]


# the kinds whose passes a model's forward chose (tune_wide_on_forward): a later choose_wide (another
# model loading, e.g. an fp32 one after an int8 one, sets them back to these); the latest tuned wins
_forward_tuned: dict[str, list[int]] = {}


def measure_wide_on(run, kinds: list[str], reps: int = 11, setup=None, rounds: int = 1, screen: int = 0,
                    margin: float = 0.06, alone=None, alone_margin: float = 0.10) -> dict[str, list[int]]:
    """For each tile size 1..WIDE_ROWS and each of ``kinds`` in turn (the others as chosen so far),
    the groups per pass (of :func:`wide_options`) under which ``run(rows)`` (a whole forward over that
    many rows, say) takes the smallest median (:func:`~ddspec.machine.interleaved_medians`, ``setup(rows)``
    untimed before each call). With ``rounds`` > 1 the whole sweep runs that many times and each
    option keeps its smallest median over the rounds: a burst of other work that slowed one option's
    timings in one sweep does not decide the choice. With ``screen`` > 0 a first, shorter sweep
    (``screen`` timings of each option) keeps only the options within ``margin`` of its fastest
    for the ``rounds`` sweeps: most options lose by 10-60%, and timing them as long as the close
    ones only made the first run slow. With ``alone`` (``alone(kind, rows)`` runs that kind's
    matmuls alone over that many rows, e.g. :func:`gemm_sweep` over a model's weights of the kind),
    a sweep of those first (``max(screen, 5)`` timings of each option) keeps only the options within
    ``alone_margin`` of its fastest: a pass that makes one kind's matmuls much slower is gone before
    the whole runs, in which one kind's share of the time hides it among the run's other work (an
    Intel Xeon's tuning had twice kept the 8-lane passes for two rows of the lm_head, 1.1-1.2x as
    slow there as the 16-lane ones). Starts from the choice in use and leaves the result set."""
    chosen = {kind: list(wide_choice()[kind]) for kind in kinds}
    options = {(kind, rows): list(wide_options(rows, kind)) for kind in kinds for rows in range(1, WIDE_ROWS + 1)}
    seen: dict[tuple[str, int], dict[int, float]] = {}  # (kind, rows) -> option -> smallest median so far

    def use(kind: str, rows: int, g: int) -> None:  # option g for this tile size, the others as chosen so far
        groups = list(chosen[kind])
        groups[rows - 1] = g
        set_wide(kind, groups)

    def sweep(reps: int, screening: bool) -> None:
        for rows in range(1, WIDE_ROWS + 1):
            for kind in kinds:
                def put(g: int, kind=kind, rows=rows) -> None:
                    use(kind, rows, g)
                    if setup is not None:
                        setup(rows)

                left = options[kind, rows]
                if len(left) == 1:
                    chosen[kind][rows - 1] = left[0]
                    set_wide(kind, chosen[kind])
                    continue
                medians = interleaved_medians(left, lambda _, rows=rows: run(rows), reps, setup=put)
                if screening:
                    fastest = min(medians.values())
                    options[kind, rows] = [g for g in left if medians[g] <= fastest * (1 + margin)]
                    best = medians
                else:
                    best = seen.setdefault((kind, rows), {})
                    for g, m in medians.items():
                        best[g] = min(m, best.get(g, m))
                chosen[kind][rows - 1] = min(best, key=best.get)
                set_wide(kind, chosen[kind])

    if alone is not None:
        for rows in range(1, WIDE_ROWS + 1):
            for kind in kinds:
                left = options[kind, rows]
                if len(left) > 1:
                    medians = interleaved_medians(left, lambda g, kind=kind, rows=rows: alone(kind, rows),
                                                  max(screen, 5), setup=lambda g, kind=kind, rows=rows: use(kind, rows, g))
                    fastest = min(medians.values())
                    options[kind, rows] = [g for g in left if medians[g] <= fastest * (1 + alone_margin)]
        for kind in kinds:
            set_wide(kind, chosen[kind])
    if screen > 0:
        sweep(screen, True)
    for _ in range(rounds):
        sweep(reps, False)
    return chosen


def tune_wide_on_forward(kinds: list[str], model: dict, run, setup=None, reps: int = 5,
                         rounds: int = 2, screen: int = 4, alone=None) -> dict[str, list[int]]:
    """The AVX-512 passes' groups per pass for ``kinds`` (those a model's forward multiplies with),
    chosen on that forward itself: ``run(rows)`` runs it over that many new tokens
    (:func:`measure_wide_on`). :func:`choose_wide` times each kind's matmuls alone, one call per
    weight; inside a whole forward (every layer in one C call, attention and norms between the
    matmuls) another pass can win by much: on an Intel Xeon (family 6, model 167) the int8 model's
    one-token forward took 3.63 ms with the separately timed choice for Q4_1_A8 (the 8-lane passes)
    and 3.11 ms with four groups per pass. The sweep runs ``rounds`` times (each option's smallest
    median counts): one sweep on that CPU had kept the 8-lane passes for two rows of Q8_0_A8 (the
    lm_head), with which the two-token forward took 4.31 ms against 3.97 ms with four groups; a
    noisy neighbour's burst must not pick the speed of every later run. A screening sweep first
    (``screen`` timings of each option) leaves only the options within 6% of its fastest to those
    two: on an Intel Xeon (family 6, model 207) the fp32 model's choice then took 9 s instead of
    21-23 s and the int8 model's 5-6 s instead of 9-11 s of a new user's first run, and the
    forwards over 1-8 tokens ran as fast with either procedure's choices (the sums of their
    medians, two choices of each, timed interleaved: 105.0 and 106.1 ms against 106.2 and 105.7;
    int8 51.8 and 51.3 against 51.8 and 50.7). Cached per CPU, kernel build, thread count and
    ``model`` (a dict naming its shapes), like :func:`choose_wide` (:func:`_cached_choice`);
    sets the choice either way. Returns {} where the build has no AVX-512 passes for these kinds."""
    kinds = sorted(k for k in kinds if k in WIDE_KINDS and wide_available(k))
    if not kinds:
        return {}

    def measure() -> dict:
        print("ddspec: timing the kernel passes on this model's forward (once, cached)", file=sys.stderr)
        return {"groups": measure_wide_on(run, kinds, reps, setup, rounds, screen, alone=alone)}

    def apply(data: dict) -> None:
        for kind in kinds:
            set_wide(kind, data["groups"][kind])
            _forward_tuned[kind] = list(data["groups"][kind])

    key = {"format": 2, "cpu": cpu_name(), "build": build_id(), "threads": torch.get_num_threads(),
           "model": model, "kinds": kinds, "rounds": rounds, "reps": reps, "screen": screen, "alone": alone is not None}
    return _cached_choice("wide-forward", "the kernel passes chosen on this model's forward", key, measure,
                          apply)["groups"]


# every kind whose passes prefetch (PREFETCH_AHEAD): the block kinds, with fp32 and 8-bit activations
PREFETCHED_KINDS = frozenset(INT8_ACTIVATIONS) | frozenset(INT8_ACTIVATIONS.values())


def choose_wide(weights, shapes: dict[str, list[str]] | None = None) -> dict[str, list[int]]:
    """Set the AVX-512 passes' groups per pass for each kind in ``weights`` ({kind: a model's weights
    of that kind}, or a function returning that, called only when there is something to measure;
    ``shapes``: {kind: ["outxin", ...]} of those weights, needed with a function), and how far ahead
    the quantised passes of every block kind (the K types too) prefetch (:func:`measure_prefetch`,
    on the weights of the kinds whose shapes do not start with "head ": those a forward streams from
    memory): the cached choice for this CPU, kernel build, thread count and shapes, else measured
    now (a few seconds, once) and cached unless other programs took the CPU meanwhile
    (:func:`_cached_choice`).
    Without the AVX-512 passes only the prefetch is chosen (every groups choice is 0). The results
    are the same bits whatever the choice; only the time differs. Returns the groups chosen by kind
    ({} without the AVX-512 passes)."""
    if library() is None:
        return {}
    if shapes is None:
        shapes = {k: sorted({f"{w.out_features}x{w.in_features}" for w in v}) for k, v in weights.items() if v}
    shapes = {k: sorted(v) for k, v in shapes.items() if k in PREFETCHED_KINDS and v}  # the quantised kinds
    if not shapes:
        return {}

    def measure() -> dict:
        given = weights() if callable(weights) else weights
        print("ddspec: timing the kernel passes on this CPU (once, cached)", file=sys.stderr)
        chosen = {kind: measure_wide(given[kind]) for kind in shapes
                  if kind in WIDE_KINDS and wide_available(kind) and given.get(kind)}
        streamed = [w for kind in shapes if not all(s.startswith("head ") for s in shapes[kind]) for w in given.get(kind, [])]
        return {"groups": chosen, "prefetch": measure_prefetch(streamed) if streamed else 0}

    def apply(data: dict) -> None:
        for kind, groups in data["groups"].items():  # (what a model's own forward chose stays)
            set_wide(kind, _forward_tuned.get(kind, groups))
        set_prefetch(data["prefetch"])

    key = {"format": 4, "cpu": cpu_name(), "build": build_id(), "threads": torch.get_num_threads(), "shapes": shapes}
    return _cached_choice("wide", "the kernel passes and prefetch chosen on this CPU", key, measure, apply)["groups"]


def choose_attention_wide(shape: dict, measure) -> bool:
    """Whether the shared attention runs on 16 lanes here: the cached answer for this CPU, kernel
    build, thread count and attention ``shape`` (a dict naming it), else ``measure()`` (a function
    that times both settings and returns the faster) now, cached unless other programs took the
    CPU meanwhile (:func:`_cached_choice`). Sets it either way; without 16-lane passes in the build, off."""
    if not wide_available():
        return set_attention_wide(False)

    def apply(data: dict) -> None:
        if not isinstance(data["wide"], bool):
            raise TypeError("not a choice")
        set_attention_wide(data["wide"])

    key = {"format": 1, "cpu": cpu_name(), "build": build_id(), "threads": torch.get_num_threads(), "shape": shape}
    _cached_choice("attention", "the attention lanes chosen on this CPU", key, lambda: {"wide": bool(measure())}, apply)
    return attention_wide()


def choose_prefetch_rows(model: dict, measure) -> int:
    """From how many rows of a pass on the quantised passes prefetch (PREFETCH_ROWS_OPTIONS; only
    where a distance is set): the cached answer for this CPU, kernel build, thread count, distance
    and ``model`` (a dict naming its shapes), else ``measure()`` (a function that times the model's
    forward with each option and returns the fastest) now, cached unless other programs took the
    CPU meanwhile (:func:`_cached_choice`). Measured on the forward, not on matmuls alone: timed
    alone, a model's first 64 MB of weights partly stay in the L3 cache, and at 2 rows the choice
    is about the memory stream (Qwen2.5-Coder-1.5B Q4_K_M on an AVX2-only AMD EPYC: its matmuls
    alone chose 3, its forward over 2 tokens took 0.92x as long from 2). Sets it either way."""
    ahead = prefetch_blocks()
    if not ahead:
        set_prefetch_rows(3)
        return 3

    def apply(data: dict) -> None:
        if data["rows"] not in PREFETCH_ROWS_OPTIONS:
            raise ValueError("not a choice")
        set_prefetch_rows(data["rows"])

    key = {"format": 1, "cpu": cpu_name(), "build": build_id(), "threads": torch.get_num_threads(), "prefetch": ahead,
           "model": model}
    _cached_choice("prefetch-rows", "the prefetch chosen on this model's forward", key,
                   lambda: {"rows": int(measure())}, apply)
    return prefetch_rows()
