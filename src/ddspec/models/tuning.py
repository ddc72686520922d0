"""Choosing the kernels a native target runs, by timing them on its own weights and forward.

models/loading.py calls this around building a :class:`~ddspec.models.llama.NativeLlama`; the
model's constructor only builds. Every choice is measured once per machine and set-up and cached
(ddspec/measured.py), and every one gives the same results; only the time differs:

- :func:`choose_plans`, before the build: which matmul kernel runs each row count
  (models/kernels.py), since the plans decide which layouts each weight is built in; first the
  C kernels' AVX-512 passes and prefetch distance on the model's quantised weights, which the
  native kernel's timing then runs with;
- :func:`tune`, on the built model: whether its attention runs on 16 lanes, and the AVX-512
  passes chosen again on its whole forward (native/tuning.py).
"""

from __future__ import annotations

import sys

import torch

from ddspec import native
from ddspec.config import DEFAULT_DRAFT_WEIGHTS
from ddspec.errors import ConfigError
from ddspec.machine import interleaved_medians
from ddspec.models.kernels import KernelPlan, Weight, choose_plan, forced_kernel, measure_plan
from ddspec.models.llama import (LlamaLayer, LlamaWeights, NativeLlama, Rotary, measure_layers_plan, native_parts,
                                 stacked_names)

# the bytes of layer weights the AVX-512 passes are timed on (native.choose_wide): past the last-level
# caches of these CPUs (32 MB L3 per core complex on AMD EPYC), so that the weights come from
# memory as in a forward: timed on 8 layers (21 MB, held in the caches between rounds), the
# choice for 3 rows of the int8 model ran its forward 1.10x slower than the 8-lane passes
WIDE_TIMING_BYTES = 64 << 20


def choose_plans(parts: LlamaWeights) -> tuple[KernelPlan, KernelPlan]:
    """The matmul kernels of the decoder layers and of the lm_head for a model of these weights,
    after setting the C kernels' passes for its quantised weights (:func:`choose_passes`)."""
    choose_passes(parts)
    return _plans(parts)


def tune(model: NativeLlama, parts: LlamaWeights) -> None:
    """The C kernels' options chosen on the built ``model`` (``parts``: what it was built from), where
    its layers run on them: the attention's lanes, the AVX-512 passes on its forward, then from how
    many rows on the quantised passes prefetch."""
    if not model.native_layers:
        return
    choose_attention(model)
    tune_passes_on_forward(model, parts)
    choose_prefetch_rows(model, parts)


def choose_passes(parts: LlamaWeights) -> None:
    """How far ahead the quantised passes prefetch and, where the kernels have AVX-512 passes,
    which to run for each row count of the blocks' kinds: measured once per machine (cached) on
    the layers' weights stacked as the layers
    multiply them, as many layers as make WIDE_TIMING_BYTES (more than a CPU's caches hold,
    as in a forward, which streams every layer from memory), and on the lm_head. Where the
    kernels also have the passes for 8-bit activations and the target does not use the
    default draft heads' kind (q4_1a8), that kind is timed too, on the first 4 layers' Q4_1
    weights (a head's working set, which stays in the caches between its levels)."""
    blocks = parts.compute
    if not blocks or not native.available():
        return
    groups = [names for i in range(parts.arch.num_layers) for names in stacked_names(f"layers.{i}.", parts.arch)
              if all(n in blocks for n in names) and len({blocks[n].kind for n in names}) == 1]
    head = blocks.get(parts.head_name)
    shapes: dict[str, set[str]] = {}
    for names in groups:
        shapes.setdefault(blocks[names[0]].kind, set()).add(
            f"{sum(blocks[n].out_features for n in names)}x{blocks[names[0]].in_features}")
    if head is not None:
        shapes.setdefault(head.kind, set()).add(f"{head.out_features}x{head.in_features}")
    heads, base = DEFAULT_DRAFT_WEIGHTS, DEFAULT_DRAFT_WEIGHTS.removesuffix("a8")
    for_heads = heads != base and heads not in shapes and base in shapes
    if for_heads:
        shapes[heads] = {"head " + s for s in shapes[base]}

    def weights() -> dict[str, list]:
        stacked = native_parts(blocks, {"native"})
        by_kind: dict[str, list] = {}
        taken = 0
        for names in groups:
            if taken >= WIDE_TIMING_BYTES:
                break
            weight = stacked(names)
            by_kind.setdefault(weight.kind, []).append(weight)
            taken += weight.nbytes
        if head is not None:
            by_kind.setdefault(head.kind, []).append(head)
        if for_heads:
            by_kind[heads] = [w.with_int8_activations() for w in by_kind[base][:16] if w.kind == base]
        return by_kind

    native.choose_wide(weights, {k: sorted(v) for k, v in shapes.items()})


def _plans(parts: LlamaWeights) -> tuple[KernelPlan, KernelPlan]:
    """Measure (once per machine, cached) which kernel runs each row count fastest, on the first
    few layers' own weights and on the lm_head."""
    blocks, head_blocks = parts.compute, parts.compute.get(parts.head_name)
    if parts.activations != "fp32":  # int8 activations: every matmul of the blocks on those kernels, one model
        forced = forced_kernel()
        if forced not in (None, "native"):
            raise ConfigError(f"--activations int8 runs on the native kernels; DDSPEC_KERNEL={forced} asks for "
                              f"another. Unset DDSPEC_KERNEL or use --activations fp32.")
        return KernelPlan.uniform("native"), KernelPlan.uniform("native")
    arch, w, head = parts.arch, parts.tensors, parts.head
    probe_layers = range(min(4, arch.num_layers))

    def layers(options: tuple[str, ...]) -> KernelPlan:
        print(f"ddspec: choosing matmul kernels for this CPU ({', '.join(options)}; once, cached)", file=sys.stderr)
        probe = [LlamaLayer(w, f"layers.{i}.", arch, KernelPlan.uniform("mm"), set(options), blocks)
                 for i in probe_layers]
        return measure_layers_plan(probe, arch, Rotary(arch, parts.device, parts.dtype), options)

    layer_shapes = [list(w.shape(n)) for names in stacked_names("layers.0.", arch) for n in names]
    variant = ",".join(sorted({f"{b.kind}" for b in blocks.values()}))  # which GGUF blocks the native kernel reads
    layer_plan = choose_plan(f"layers x{len(probe_layers)}", layer_shapes, parts.device, parts.dtype, layers, variant)
    head_plan = choose_plan("lm_head", [list(head.shape)], parts.device, parts.dtype,
                            lambda options: measure_plan([[Weight(head, set(options), head_blocks)]], options),
                            head_blocks.kind if head_blocks is not None else "")
    return layer_plan, head_plan


def _fastest_on_forward(model: NativeLlama, options: tuple, choose, prefix: int, sizes: tuple[int, ...],
                        reps: int):
    """The option of ``options`` with which this model's forwards over each of ``sizes`` new tokens
    after ``prefix`` random ones take the least time, medians summed over the sizes (options
    interleaved, :func:`~ddspec.machine.interleaved_medians`; ``choose(option)`` sets one; on a tie
    the first). The model's caches are dropped afterwards."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.info.vocab_size
    total = dict.fromkeys(options, 0.0)
    try:
        model.reset(prefix + max(sizes))
        model.forward(torch.randint(0, vocab, (prefix,), generator=gen), torch.arange(prefix))
        for n in sizes:
            tokens, mask = torch.randint(0, vocab, (n,), generator=gen), torch.ones(n, n, dtype=torch.bool).tril_()

            def setup(option) -> None:
                choose(option)
                model.truncate(prefix)

            medians = interleaved_medians(options, lambda _: model.forward(tokens, prefix + torch.arange(n), mask),
                                          reps, setup=setup)
            for option in options:
                total[option] += medians[option]
    finally:
        model.cache = None
    return min(options, key=total.get)


def choose_attention(model: NativeLlama, prefix: int = 256, sizes: tuple[int, ...] = (4, 8), reps: int = 9) -> None:
    """Whether the native attention's shared passes run on 16 lanes (where the kernels have them):
    measured once per machine (cached) as this model's forward over 4 and 8 tokens after
    ``prefix``, both settings interleaved, by the sum of their medians. The same bits either way."""
    a = model.arch
    if prefix + max(sizes) > a.max_position:
        return

    def measure() -> bool:
        print("ddspec: timing the attention passes on this CPU (once, cached)", file=sys.stderr)
        return _fastest_on_forward(model, (False, True), native.set_attention_wide, prefix, sizes, reps)

    native.choose_attention_wide({"heads": a.num_heads, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
                                  "layers": a.num_layers, "hidden": a.hidden_size}, measure)


def choose_prefetch_rows(model: NativeLlama, parts: LlamaWeights, prefix: int = 128, reps: int = 9) -> None:
    """From how many rows of a pass on the quantised passes prefetch (2 or 3; where a distance was
    chosen): timed once per machine (cached) as this model's forward over 2 tokens after
    ``prefix``, both settings interleaved (native.choose_prefetch_rows). Models whose layer weights
    are smaller than WIDE_TIMING_BYTES / 4 (test models: they stay in the caches) keep the setting."""
    streamed = [b for name, b in parts.compute.items() if name.startswith("layers.")]
    if sum(b.nbytes for b in streamed) < WIDE_TIMING_BYTES // 4:
        return
    a = model.arch

    def measure() -> int:
        print("ddspec: timing the prefetch on this model's forward (once, cached)", file=sys.stderr)
        return _fastest_on_forward(model, native.PREFETCH_ROWS_OPTIONS, native.set_prefetch_rows,
                                   min(prefix, a.max_position - 3), (2,), reps)

    shapes = sorted({f"{b.kind} {b.out_features}x{b.in_features}" for b in streamed})
    native.choose_prefetch_rows({"layers": a.num_layers, "shapes": shapes}, measure)


def tune_passes_on_forward(model: NativeLlama, parts: LlamaWeights, prefix: int = 128) -> None:
    """Choose the AVX-512 passes of the kinds the forward multiplies with (the layers' and the
    lm_head's blocks) on the forward itself, over 1..8 new tokens after ``prefix``, among the
    options that each kind's matmuls alone (native.gemm_sweep over this model's weights of the
    kind) keep: once per machine, cached (native.tune_wide_on_forward). Models whose layer
    weights are smaller than WIDE_TIMING_BYTES / 4 (test models: they stay in the caches, unlike
    a real forward's) keep the choice timed on their matmuls alone (:func:`choose_passes`)."""
    blocks, head_name = parts.compute, parts.head_name
    streamed = [b for name, b in blocks.items() if name.startswith("layers.")]
    streamed_bytes = sum(b.nbytes for b in streamed)
    if streamed_bytes < WIDE_TIMING_BYTES // 4 or not native.wide_available():
        return
    if any(model.layer_plan.kernel(n) != "native" for n in range(1, native.WIDE_ROWS + 1)):
        return
    a, rows = model.arch, native.WIDE_ROWS
    prefix = min(prefix, a.max_position - rows - 1)
    kinds = sorted({b.kind for b in streamed} | ({blocks[head_name].kind} if head_name in blocks else set()))
    gen = torch.Generator().manual_seed(0)
    vocab = model.info.vocab_size
    inputs = {n: (torch.randint(0, vocab, (n,), generator=gen),
                  None if n == 1 else torch.ones(n, n, dtype=torch.bool).tril_()) for n in range(1, rows + 1)}
    prefilled = []  # the prefix is run when the first timing needs it (a cached choice times nothing)

    def setup(n: int) -> None:
        if not prefilled:
            model.reset(prefix + rows)
            model.forward(torch.randint(0, vocab, (prefix,), generator=gen), torch.arange(prefix))
            prefilled.append(True)
        model.truncate(prefix)

    def run(n: int) -> None:
        model.forward(inputs[n][0], prefix + torch.arange(n), inputs[n][1])

    # each kind's matmuls alone (the screening of tune_wide_on_forward): the layers' weights of
    # that kind in a forward's order, then the lm_head's, one C call per input width
    per = model.native_matmuls()
    mats = [w for ws in zip(per["q/k/v"], per["o"], per["gate/up"], per["down"]) for w in ws] + per["lm_head"]
    by_kind: dict[str, dict[int, list]] = {}  # kind -> input width -> its weights, in a forward's order
    for m in mats:
        by_kind.setdefault(m.kind, {}).setdefault(m.in_features, []).append(m)
    xs = {(n, w): torch.randn(n, w, generator=gen) for n in range(1, rows + 1) for w in {m.in_features for m in mats}}

    def alone(kind: str, n: int) -> None:
        for width, weights in by_kind.get(kind, {}).items():
            native.gemm_sweep(weights, xs[n, width])

    shape = {"layers": a.num_layers, "hidden": a.hidden_size, "vocab": vocab, "bytes": streamed_bytes}
    try:
        native.tune_wide_on_forward(kinds, shape, run, setup, alone=alone)
    finally:
        model.cache = None
