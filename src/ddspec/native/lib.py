"""Loading ddspec's CPU kernels: the compiled library (native/build.py makes it) and its C calls' signatures.

:func:`library` returns the loaded library, or None when it cannot be had here (not x86-64 with
AVX2/FMA/F16C, no C compiler, ``DDSPEC_NATIVE=0``); callers then use torch's kernels, so nothing
depends on it. :func:`start_build` compiles it in the background while a model loads, and
:func:`library` waits for that build only when the kernels are needed. :class:`CWeight` and
:class:`CLayer` are the structs the C calls read a weight and a decoder layer from.
"""

from __future__ import annotations

import ctypes
import sys

from ddspec.native.build import Build, built_path, kernel_paths, profiling, why_not_here

_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_pending: Build | None = None  # the build start_build began, which library() waits for


class CWeight(ctypes.Structure):
    """One weight in the kernels' layout (dd_weight in native/kernels/common.h)."""

    _fields_ = [("kind", ctypes.c_int64), ("out", ctypes.c_int64), ("inp", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("parts", ctypes.c_void_p), ("nparts", ctypes.c_int64)]


class CLayer(ctypes.Structure):
    """One decoder layer's sizes, norms and weights (dd_layer in native/kernels/common.h)."""

    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", CWeight), ("o", CWeight), ("gate_up", CWeight), ("down", CWeight), ("extra", ctypes.c_int64),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("attn_norm", ctypes.c_void_p),
                ("mlp_norm", ctypes.c_void_p), ("act", ctypes.c_int64), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("window", ctypes.c_int64), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p)]


def start_build() -> None:
    """Start compiling the kernels in the background when they are not built yet (no-op
    otherwise, and when they cannot be used here); :func:`library` finishes the job."""
    global _pending
    if _lib is not None or _why_not is not None or _pending is not None or why_not_here() is not None:
        return
    paths = kernel_paths()
    if built_path(paths) is not None:
        return
    print("ddspec: compiling ddspec's CPU kernels in the background (once, about 15 s on two cores)",
          file=sys.stderr)
    try:
        _pending = Build(paths[0])
    except (OSError, RuntimeError):
        _pending = None  # library() tries again in the foreground and reports the error


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built once per machine), or None; :func:`unavailable_reason` says why."""
    global _lib, _why_not, _pending
    if _lib is not None or _why_not is not None:
        return _lib
    _why_not = why_not_here()
    if _why_not is not None:
        return None
    paths = kernel_paths()
    path = built_path(paths) or paths[0]
    try:
        if not path.is_file():
            build, _pending = _pending, None
            if build is not None and build.out != path:  # started for another cache root
                build.abandon()
                build = None
            if build is None:
                print("ddspec: compiling ddspec's CPU kernels (once, about 15 s on two cores)", file=sys.stderr)
                build = Build(path)
            build.wait()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        _why_not = f"could not build or load {path.name}: {e}"
        print(f"ddspec: {_why_not}; using torch's kernels", file=sys.stderr)
        return None
    lib.dd_gemm.argtypes = [ctypes.POINTER(CWeight), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_void_p]
    lib.dd_gemm.restype = ctypes.c_int
    lib.dd_gemm_sweep.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int]
    lib.dd_gemm_sweep.restype = ctypes.c_int
    lib.dd_layers_forward.argtypes = [ctypes.POINTER(CLayer), ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.dd_layers_forward.restype = ctypes.c_int
    lib.dd_layers_forward_seqs.argtypes = [ctypes.POINTER(CLayer), ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    lib.dd_layers_forward_seqs.restype = ctypes.c_int
    lib.dd_int8_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.dd_int8_peak.restype = ctypes.c_int64
    lib.dd_top_logprobs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.dd_top_logprobs.restype = ctypes.c_int
    lib.dd_int8_peak_step.argtypes = []
    lib.dd_int8_peak_step.restype = ctypes.c_int
    lib.dd_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.dd_read_sum.restype = ctypes.c_int64
    lib.dd_wide.argtypes = []
    lib.dd_wide.restype = ctypes.c_int
    lib.dd_set_wide_groups.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.dd_set_wide_groups.restype = ctypes.c_int
    lib.dd_get_wide_groups.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.dd_get_wide_groups.restype = ctypes.c_int
    lib.dd_set_attention.argtypes = [ctypes.c_int]
    lib.dd_set_attention.restype = ctypes.c_int
    lib.dd_set_attention_wide.argtypes = [ctypes.c_int]
    lib.dd_set_attention_wide.restype = ctypes.c_int
    lib.dd_set_share_rows.argtypes = [ctypes.c_int]
    lib.dd_set_share_rows.restype = ctypes.c_int
    lib.dd_set_prefetch.argtypes = [ctypes.c_int]
    lib.dd_set_prefetch.restype = ctypes.c_int
    lib.dd_get_prefetch.argtypes = []
    lib.dd_get_prefetch.restype = ctypes.c_int
    lib.dd_set_prefetch_rows.argtypes = [ctypes.c_int]
    lib.dd_set_prefetch_rows.restype = ctypes.c_int
    lib.dd_get_prefetch_rows.argtypes = []
    lib.dd_get_prefetch_rows.restype = ctypes.c_int
    lib.dd_set_span_delay.argtypes = [ctypes.c_int]
    lib.dd_set_span_delay.restype = ctypes.c_int64
    if profiling():
        lib.dd_phases.argtypes = [ctypes.c_void_p]
        lib.dd_phases.restype = ctypes.c_int
        lib.dd_cycles.argtypes = []
        lib.dd_cycles.restype = ctypes.c_uint64
    _lib = lib
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`library` is None here (None when the kernels are loaded)."""
    library()
    return _why_not


def available() -> bool:
    """Whether the kernels are loaded (built first when needed)."""
    return library() is not None

