"""Where a forward's time goes, and what this CPU can do at best: for benchmarks and profiles.

With ``DDSPEC_PROFILE=1`` (native/build.py's PROFILE_ENV) the kernels are the profiling build, whose
decoder layers count each phase's cycles (:func:`phase_cycles`, ``python -m ddspec.bench.phases``).
:func:`int8_peak` and :func:`read_rate` measure the arithmetic and memory bounds a forward runs
against, in any build.
"""

from __future__ import annotations

import ctypes
import time

import torch

from ddspec.native.build import PROFILE_ENV, profiling
from ddspec.native.lib import library

PHASES = ("norm", "q/k/v", "RoPE + cache", "attention", "o", "post norm", "gate/up", "SiLU", "down")


def _profiling_library() -> ctypes.CDLL:
    """The loaded kernels when they are the profiling build, else a ValueError naming the fix."""
    lib = library()
    if lib is None or not profiling():
        raise ValueError(f"no profiling build loaded: run with {PROFILE_ENV}=1 (python -m ddspec.bench.phases does)")
    return lib


def phase_cycles() -> list[float]:
    """The profiling build's cycle counts per decoder-layer phase (:data:`PHASES`, thread 0, each up to
    the barrier that ends it) since the last call, summed over layers and forwards; then zeroed."""
    out = (ctypes.c_double * len(PHASES))()
    _profiling_library().dd_phases(ctypes.addressof(out))
    return list(out)


def cycles() -> int:
    """The CPU's time-stamp counter (the profiling build only)."""
    return int(_profiling_library().dd_cycles())


# dd_int8_peak's step by dd_int8_peak_step: (its instruction, byte products per step); a round is PEAK_ROUND steps
PEAK_ROUND = 12
PEAK_STEPS = {0: ("vpmaddubsw on 8 lanes", 32), 1: ("vpdpbusd on 8 lanes", 32), 2: ("vpdpbusd on 16 lanes", 64)}


def int8_peak_step() -> str | None:
    """The instruction :func:`int8_peak` times (the int8-activation kernels' widest inner step in this build)."""
    lib = library()
    return None if lib is None else PEAK_STEPS[lib.dd_int8_peak_step()][0]


def int8_peak(threads: int, seconds: float = 0.3) -> float | None:
    """Measured 8-bit multiply-adds per second of this CPU in ``threads`` threads (the int8-activation
    kernels' widest multiply-add instruction on registers, :func:`int8_peak_step`: their arithmetic
    at its fastest), best of 5 runs of about ``seconds``; None without the kernels."""
    lib = library()
    if lib is None:
        return None
    iters, best = 1 << 16, 0.0
    per_round = PEAK_ROUND * PEAK_STEPS[lib.dd_int8_peak_step()][1]
    while True:  # grow the run until it is long enough to time
        t0 = time.perf_counter()
        lib.dd_int8_peak(iters, threads)
        if time.perf_counter() - t0 > seconds / 4 or iters >= 1 << 34:
            break
        iters *= 4
    for _ in range(5):
        t0 = time.perf_counter()
        lib.dd_int8_peak(iters, threads)
        best = max(best, iters * threads * per_round / (time.perf_counter() - t0))
    return best


def read_rate(nbytes: int, threads: int, reps: int = 15) -> float | None:
    """Bytes per second at which ``threads`` threads read a buffer of ``nbytes`` bytes that they read
    again and again, as a forward re-reads the same weights every token (kept in the CPU's last-level
    cache as far as it holds them): best of ``reps`` passes after an untimed one; None without the
    kernels. With ``nbytes`` the weight bytes a token reads, ``nbytes / read_rate`` is the least
    time any one-token forward spends reading them on this machine."""
    lib = library()
    if lib is None:
        return None
    buf = torch.ones(max(128, nbytes // 128 * 128), dtype=torch.uint8)
    lib.dd_read_sum(buf.data_ptr(), buf.numel(), threads)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        lib.dd_read_sum(buf.data_ptr(), buf.numel(), threads)
        best = max(best, buf.numel() / (time.perf_counter() - t0))
    return best
