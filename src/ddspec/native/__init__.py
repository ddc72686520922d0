"""ddspec's own CPU kernels (native/kernels/), compiled on first use and called through ctypes.

Where they cannot be had (not x86-64 with AVX2/FMA/F16C, no C compiler, ``DDSPEC_NATIVE=0``)
:func:`library` is None and callers use torch's kernels, so nothing depends on them. The parts:

- build.py: the compiler flags for this CPU, the build, where built kernels live (:func:`prebuild`,
  ``python -m ddspec.native``, is what ``make setup`` runs);
- lib.py: loading the library (:func:`start_build` while a model loads, :func:`library`) and the
  C calls' signatures and structs;
- weights.py: :class:`NativeWeight`, a weight in the kernels' layout, and the matmuls over them;
- forward.py: decoder layers run whole in one call (:func:`layers_forward`) and :func:`top_logprobs`;
- options.py: the kernels' run-time options (attention passes, AVX-512 passes, prefetch ...);
- tuning.py: which options run fastest here, measured once and cached;
- profile.py: phase cycle counts of the profiling build, and the CPU's arithmetic and read bounds.

This module names what the rest of ddspec uses; each name lives, with any state behind it, in
one of those.
"""

from __future__ import annotations

from ddspec.native.build import (PROFILE_ENV, SOURCE, build_flags, build_id, c_compiler, prebuild, profiling,
                                 vnni_flags, wide_flags)
from ddspec.native.forward import layer_array, layer_struct, layers_forward, layers_forward_seqs, top_logprobs
from ddspec.native.lib import available, library, start_build, unavailable_reason
from ddspec.native.options import (PREFETCH_OPTIONS, PREFETCH_ROWS_OPTIONS, WIDE_KINDS, WIDE_ROWS, attention_wide,
                                   prefetch_blocks, prefetch_rows, set_attention, set_attention_wide, set_prefetch,
                                   set_prefetch_rows, set_share_rows, set_span_delay, set_wide, wide_available,
                                   wide_choice, wide_options)
from ddspec.native.profile import PEAK_ROUND, PHASES, cycles, int8_peak, int8_peak_step, phase_cycles, read_rate
from ddspec.native.tuning import (choose_attention_wide, choose_prefetch_rows, choose_wide, measure_wide_on,
                                  tune_wide_on_forward)
from ddspec.native.weights import NativeWeight, concat, gemm_sweep

__all__ = [
    "NativeWeight", "PEAK_ROUND", "PHASES", "PREFETCH_OPTIONS", "PREFETCH_ROWS_OPTIONS", "PROFILE_ENV", "SOURCE",
    "WIDE_KINDS", "WIDE_ROWS", "attention_wide", "available", "build_flags", "build_id", "c_compiler",
    "choose_attention_wide", "choose_prefetch_rows", "choose_wide", "concat", "cycles", "gemm_sweep", "int8_peak",
    "int8_peak_step", "layer_array", "layer_struct", "layers_forward", "layers_forward_seqs", "library",
    "measure_wide_on", "phase_cycles", "prebuild", "prefetch_blocks", "prefetch_rows", "profiling", "read_rate",
    "set_attention", "set_attention_wide", "set_prefetch", "set_prefetch_rows", "set_share_rows", "set_span_delay",
    "set_wide", "start_build", "top_logprobs", "tune_wide_on_forward", "unavailable_reason", "vnni_flags",
    "wide_available", "wide_choice", "wide_flags", "wide_options"
]
