"""Matmul kernels for small row counts, chosen per machine by measurement.

Speculative decoding multiplies 1-64 rows (the tokens of a draft tree) by every weight matrix.
On our CPUs the cost of that depends more on *which* fp32 kernel runs than on the row count:
torch's default paths (MKL through ``torch.mm`` / ``F.linear``) take 2-4x longer at 2-16 rows
than at one row, while oneDNN with a weight packed once for its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``) keeps 8 rows near the
cost of one (docs/design.md §6). Which kernel wins differs between CPUs (MKL takes slower code paths
on AMD than on Intel), so nothing here is hard-coded: :func:`measure_plan` times each candidate
on the model's own weights for each row-count bucket, and the fastest per bucket is used.

- ``mm``: ``x @ W`` with W stored [in, out] (torch.mm / MKL).
- ``linear``: ``F.linear(x, W)`` with W stored [out, in] (MKL).
- ``onednn``: oneDNN with W packed once (the batch hint only steers the layout; one packing
  serves every row count).
- ``native``: ddspec's own C kernels (native/kernels/): fp32 W [out, in], or, for a
  model converted from a GGUF, the weight's GGUF blocks (Q4_0 .. Q8_0, the K types) turned back into the same fp32
  values inside the kernel (a seventh of the bytes to read). Where a layer's plan says
  ``native``, the whole decoder layer runs as one C call (models/llama.py).

:class:`Weight` holds one matrix in the layouts its kernels need; :class:`KernelPlan` maps a row
count to a kernel. Results agree with ``torch.mm`` to fp32 rounding (tests/test_kernels.py).
Set ``DDSPEC_KERNEL=mm|linear|onednn|native`` to force one kernel everywhere (``auto`` = measure).
"""

from __future__ import annotations

import bisect
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddspec.errors import ConfigError
from ddspec.machine import cpu_name
from ddspec.measured import Entry, measured_once

KERNELS = ("mm", "linear", "onednn", "native")
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 256)  # row counts measured; others use the bucket above
LARGE = BUCKETS[-1]  # serves every count above 64 (prompts, batches): there a GEMM library often beats ours
ONEDNN_HINT = 8


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """The kernel for each row-count bucket (``kernels[i]`` serves rows up to ``BUCKETS[i]``)."""

    kernels: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.kernels) != len(BUCKETS) or any(k not in KERNELS for k in self.kernels):
            raise ValueError(f"a plan needs one of {KERNELS} for each of {len(BUCKETS)} buckets, got {self.kernels}")

    @classmethod
    def uniform(cls, kernel: str) -> KernelPlan:
        return cls((kernel,) * len(BUCKETS))

    def kernel(self, rows: int) -> str:
        return self.kernels[min(bisect.bisect_left(BUCKETS, rows), len(BUCKETS) - 1)]

    @property
    def needed(self) -> set[str]:
        return set(self.kernels)

    def describe(self) -> str:
        return ", ".join(f"{b}:{k}" for b, k in zip(BUCKETS, self.kernels))


class Weight:
    """One linear's weight W [out, in] in the layouts the given kernels read."""

    __slots__ = ("out_features", "in_features", "io", "oi", "packed", "native")

    def __init__(self, w_oi: torch.Tensor | None, kernels: set[str], native=None) -> None:
        """native: the weight's NativeWeight for the ``native`` kernel (GGUF blocks); None = its fp32 values.
        w_oi may be None where ``native`` is given and it is the only kernel (no fp32 values kept)."""
        if w_oi is None:
            if native is None or kernels != {"native"}:
                raise ValueError("a weight without fp32 values runs on its GGUF blocks alone (kernel 'native')")
            self.out_features, self.in_features = native.out_features, native.in_features
            self.io = self.oi = self.packed = None
            self.native = native
            return
        self.out_features, self.in_features = w_oi.shape
        self.io = w_oi.t().contiguous() if "mm" in kernels else None  # [in, out]
        self.oi = w_oi.contiguous() if "linear" in kernels else None  # [out, in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w_oi.contiguous(), ONEDNN_HINT) if "onednn" in kernels else None
        self.native = None
        if "native" in kernels:
            from ddspec.native import NativeWeight

            self.native = native if native is not None else NativeWeight.dense(w_oi)

    def keep(self, kernels: set[str]) -> None:
        """Drop the layouts no chosen kernel reads (frees their memory)."""
        if "mm" not in kernels:
            self.io = None
        if "linear" not in kernels:
            self.oi = None
        if "onednn" not in kernels:
            self.packed = None
        if "native" not in kernels:
            self.native = None

    def __call__(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """x [..., in] @ W^T -> [..., out] through ``kernel``."""
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if kernel == "native":
            return self.native(x)
        if kernel == "linear":
            return F.linear(x, self.oi)
        return torch.matmul(x, self.io)

    def dense_t(self) -> torch.Tensor:
        """W as [in, out] in a plain layout (for code that multiplies it directly)."""
        if self.io is not None:
            return self.io
        if self.oi is not None:
            return self.oi.t()
        kernel = "onednn" if self.packed is not None else "native"
        return self(torch.eye(self.in_features, dtype=torch.float32), kernel)  # one-hot rows: exact


def forced_kernel() -> str | None:
    """``DDSPEC_KERNEL`` when set to a kernel name (None for unset or ``auto``)."""
    value = os.environ.get("DDSPEC_KERNEL", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in KERNELS:
        raise ConfigError(f"DDSPEC_KERNEL={value!r}: choose auto or one of {', '.join(KERNELS)}")
    return value


PRUNE = 4.0  # a kernel this many times slower than the best at some row count is not timed at larger ones


def pick_fastest(timers: dict[str, object], reps: int, progress=None) -> KernelPlan:
    """The fastest kernel per bucket: ``timers[kernel](rows)`` runs one timed unit of work and
    returns its seconds; interleaved rounds, median of ``reps`` after one warm-up round. A kernel
    more than PRUNE times slower than the best at some bucket is dropped for the larger small-row
    buckets, which keeps the first run short; every kernel is timed again at the LARGE bucket, where
    blocked GEMM libraries overtake kernels written for a few rows."""
    alive = list(timers)
    chosen = []
    for b in BUCKETS:
        if b == LARGE:
            alive = list(timers)
        times: dict[str, list[float]] = {k: [] for k in alive}
        # the LARGE bucket's units are long (hundreds of rows): one timed round after the warm-up
        for r in range(reps + 1 if b != LARGE else 2):
            for k in alive:
                seconds = timers[k](b)
                if r:  # the first pass warms up
                    times[k].append(seconds)
        medians = {k: statistics.median(v) for k, v in times.items()}
        best = min(alive, key=medians.get)
        chosen.append(best)
        alive = [k for k in alive if medians[k] <= PRUNE * medians[best]]
        if progress is not None:
            progress(1)
    return KernelPlan(tuple(chosen))


def measure_plan(groups: list[list[Weight]], candidates: tuple[str, ...], reps: int = 3,
                 progress=None) -> KernelPlan:
    """Time every candidate kernel over all the weights of ``groups`` (as one forward streams
    them), per row bucket, interleaved, and keep the fastest per bucket (median of ``reps``)."""
    weights = [w for group in groups for w in group]
    inputs = {b: {w.in_features: torch.randn(b, w.in_features, dtype=_dtype(w), device=_device(w))
                  for w in weights} for b in BUCKETS}

    def timer(kernel):
        def run(b: int) -> float:
            t = time.perf_counter()
            for w in weights:
                w(inputs[b][w.in_features], kernel)
            return time.perf_counter() - t
        return run

    return pick_fastest({k: timer(k) for k in candidates}, reps, progress)


def _any_layout(w: Weight) -> torch.Tensor | None:
    return next((t for t in (w.io, w.oi, w.packed) if t is not None), None)


def _dtype(w: Weight) -> torch.dtype:
    t = _any_layout(w)
    return torch.float32 if t is None else t.dtype  # native weights compute in fp32


def _device(w: Weight) -> torch.device:
    t = _any_layout(w)
    return torch.device("cpu") if t is None else t.device


# -- choosing, once per machine ---------------------------------------------------------------
def candidates(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if device.type != "cpu":
        return ("mm",)  # GPUs: the vendor GEMM is the right answer
    options = ["mm", "linear"] + (["onednn"] if onednn_available(device, dtype) else [])
    if dtype == torch.float32:
        from ddspec import native

        if native.available():
            options.append("native")
    return tuple(options)


def choose_plan(name: str, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                measure, variant: str = "") -> KernelPlan:
    """The cached plan for these weight shapes on this machine, or ``measure(candidates)`` (then cached).

    The cache key names the CPU, torch build, thread count, dtype, the shapes and ``variant``
    (how the weights are stored, e.g. which are GGUF blocks); a forced
    kernel (``DDSPEC_KERNEL``) or a single candidate skips measuring. A choice timed while other
    programs used more than ``BUSY_SHARE`` of the CPU is used but not cached (ddspec/measured.py).
    """
    forced = forced_kernel()
    options = candidates(device, dtype)
    if forced is not None:
        if forced not in options:
            raise ConfigError(f"DDSPEC_KERNEL={forced} is not available for {device} / {dtype}: use one of {options}")
        return KernelPlan.uniform(forced)
    if len(options) == 1:
        return KernelPlan.uniform(options[0])
    key = {"format": 2, "name": name, "shapes": shapes, "cpu": cpu_name(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "dtype": str(dtype), "candidates": list(options), "variant": variant}
    if "native" in options:
        from ddspec import native

        key["native"] = native.build_id()
    return measured_once(Entry("kernels", key, f"the kernel choice for {name}"),
                         lambda: {"kernels": list(measure(options).kernels)},
                         lambda data: KernelPlan(tuple(data["kernels"])))
