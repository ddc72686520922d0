"""ddspec's own CPU kernels (ddspec_kernels.c), compiled on first use and called through ctypes.

:func:`library` returns the loaded library, or None when it cannot be had here (not x86-64
with AVX2/FMA/F16C, no C compiler, ``DDSPEC_NATIVE=0``); callers then use torch's kernels, so
nothing depends on it. Where the CPU has them, the build adds VNNI (:func:`vnni_flags`) and
AVX-512 (:func:`wide_flags`; which AVX-512 passes run is measured per machine, :func:`choose_wide`):
the same results, other instructions. The build (plain C, no torch headers, -O3; three parts compiled in
parallel and linked: about 15 s on two cores, 20 s of one core as a single unit) is
cached per source, compiler and flags in ``<cache root>/native/``, and :func:`start_build`
runs it in the background while a model loads; it links the OpenMP runtime
torch already loaded (libgomp), so both share one thread pool. ``make setup`` builds it beforehand
into the Python environment (:func:`prebuild`, ``python -m ddspec.native``), where every cache finds it.

:class:`NativeWeight` describes one weight to the kernels: fp32 ``[out, in]`` (kept as fp16 /
bf16 when those hold it exactly), or the GGUF
blocks of a Q4_1 / Q8_0 weight (models/gguf_blocks.py). :func:`layer_struct` describes a
whole decoder layer; :func:`layer_array` and :func:`layers_forward` run consecutive layers in one
``dd_layers_forward`` call.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddspec.machine import cpu_flags

SOURCE = Path(__file__).with_name("ddspec_kernels.c")
# what the build reads: the source and the attention passes it includes twice (fp32 and fp16 caches)
SOURCES = (SOURCE, SOURCE.with_name("ddspec_attention.inc"))
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
         # hot loops on 64-byte boundaries: the same source measured 6-12% apart at 4-8 rows
         # depending on where its loops happened to land (AMD EPYC, interleaved A/B)
         "-falign-functions=64", "-falign-loops=64",
         "-fPIC"]
# the source's parts (DD_PARTS bit masks, see ddspec_kernels.c), compiled in parallel: Q4_1 and
# the layers; Q8_0 and fp32; fp16 and bf16. Measured on 2 cores (AMD EPYC): 14.8 s wall, 26.7 s
# of CPU; one unit 18.5 s; six parts 17.0 s wall, 32.2 s of CPU (each part parses the headers
# and loses cross-function optimisation); two parts 15.0 s wall, 23.6 s of CPU
PARTS = (1 << 1 | 1 << 6, 1 << 2 | 1 << 3, 1 << 4 | 1 << 5)
KINDS = {"f32": 0, "q4_1": 1, "q8_0": 2, "f16": 3, "bf16": 4, "q4_1a8": 5, "q8_0a8": 6}
HALVES = {"f16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = (torch.float32, torch.float16)  # the caches dd_layers_forward reads and writes

_lib: ctypes.CDLL | None = None
_why_not: str | None = None


class _Weight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("out", ctypes.c_int64), ("inp", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight), ("extra", ctypes.c_int64)]


# (the CPU flags needed, the compiler flags): VEX-encoded 256-bit AVX-VNNI (Zen 5, Alder Lake, Sapphire
# Rapids), else AVX-512 VNNI on 256-bit registers (Ice Lake, Zen 4)
_VNNI_OPTIONS = (({"avx_vnni"}, ["-mavxvnni"]),
                 ({"avx512_vnni", "avx512vl"}, ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256"]))


def vnni_flags() -> list[str]:
    """The compiler flags that let the 8-bit-activation kernels use vpdpbusd (ddspec_kernels.c,
    DD_VNNI): where this CPU has AVX-VNNI or AVX-512 VNNI and the compiler takes the flag; none
    with ``DDSPEC_VNNI=0``. The results are the same bits either way (exact integer sums)."""
    global _vnni
    if _vnni is None:
        _vnni = [] if _switched_off("DDSPEC_VNNI") else _first_taken(_VNNI_OPTIONS)
    return _vnni


def _switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns a feature off (0 / off / no / false)."""
    return os.environ.get(name, "1").strip() in ("0", "off", "no", "false")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _first_taken(options: tuple[tuple[set[str], list[str]], ...]) -> list[str]:
    """The first compiler flags of ``options`` ((CPU flags needed, compiler flags), ...) whose CPU
    flags this CPU has and which the compiler takes; [] when none."""
    have, compiler = cpu_flags(), _compiler()
    for need, flags in options:
        if need <= have and compiler and _compiles(compiler, flags):
            return flags
    return []


_vnni: list[str] | None = None


def _compiles(compiler: str, options: list[str]) -> bool:
    """Whether the compiler takes these flags (an old gcc may not know -mavxvnni). Each answer is
    cached per compiler (its path, size and time) in ``<cache root>/native/probes.json``: a probe
    runs the compiler once (about 17 ms), and every process that loads the kernels asks."""
    import json

    from ddspec.machine import cache_root

    try:
        st = os.stat(shutil.which(compiler) or compiler)
        who = f"{compiler}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        who = compiler
    key = f"{who} {' '.join(options)}"
    path = cache_root() / "native" / "probes.json"
    try:
        known = json.loads(path.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), bool):
        return known[key]
    try:
        probe = subprocess.run([compiler, *options, "-x", "c", "-c", "-o", os.devnull, "-"], input="int x;\n",
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, timeout=30)
        ok = probe.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False  # not cached: may work next time
    try:
        from ddspec.fileio import write_json_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**known, key: ok})
    except OSError:
        pass
    return ok


PROFILE_ENV = "DDSPEC_PROFILE"  # 1: build and load the profiling variant of the kernels (-DDD_PROFILE)


def profiling() -> bool:
    """Whether this process uses the profiling build (``DDSPEC_PROFILE=1``: each decoder layer's
    phases counted in cycles, see ``python -m ddspec.bench.phases``); the same results, its own build id."""
    return os.environ.get(PROFILE_ENV, "").strip() == "1"


def build_flags() -> list[str]:
    return FLAGS + vnni_flags() + wide_flags() + (["-DDD_PROFILE"] if profiling() else [])


# AVX-512 passes for the quantised kinds with fp32 activations (ddspec_kernels.c, DD_WIDE) and, with
# AVX-512 VNNI, with 8-bit activations (DD_WIDE_A8); the rest of the code stays on 256-bit vectors
# (-mprefer-vector-width=256: no change to what gcc vectorises by itself)
# (with GFNI and AVX-512BW too: the 16-lane passes widen Q4_1 levels by one affine byte map, GF2P8AFFINEQB,
# instead of shifts, unpacks and masks: the same bytes. Intel Xeon family 6 model 207, after 256 tokens, two
# builds in one process, interleaved: the int8 model's forward over 3-6 tokens 0.97-0.99x the time, 1-2 tokens
# 0.99-1.01x; the fp32 model's over 2 / 3 / 4 / 6-8 tokens 0.80-0.83 / 0.86-0.89 / 0.92-0.95 / 0.95-0.97x,
# 1 token 0.97-1.01x)
# (with AVX-512 VBMI as well: the fp32 passes take Q4_1 levels as floats in two operations, VPMULTISHIFTQB and
# VPERMPS, instead of GFNI's map, a widening and a conversion: the same floats, see levels16; against the GFNI
# build, the same way, three runs: fp32 over 2-16 tokens 0.92-0.98x the time (one 1.04x), 1 token 0.92-1.01x)
_WIDE_OPTIONS = (({"avx512f", "avx512_vnni", "avx512bw", "gfni", "avx512vbmi"},
                  ["-mavx512f", "-mavx512vnni", "-mavx512bw", "-mgfni", "-mavx512vbmi", "-mprefer-vector-width=256"]),
                 ({"avx512f", "avx512_vnni", "avx512bw", "gfni"},
                  ["-mavx512f", "-mavx512vnni", "-mavx512bw", "-mgfni", "-mprefer-vector-width=256"]),
                 ({"avx512f", "avx512_vnni"}, ["-mavx512f", "-mavx512vnni", "-mprefer-vector-width=256"]),
                 ({"avx512f"}, ["-mavx512f", "-mprefer-vector-width=256"]))
_wide: list[str] | None = None


def wide_flags() -> list[str]:
    """The compiler flags for the AVX-512 passes: where this CPU has AVX-512F and the compiler takes
    them (with AVX-512 VNNI, and GFNI with AVX-512BW and VBMI, too, unless ``DDSPEC_VNNI=0``); none
    with ``DDSPEC_AVX512=0``. The results are the same bits either way (each lane runs the 8-lane
    passes' arithmetic)."""
    global _wide
    if _wide is None:
        options = _WIDE_OPTIONS
        if _switched_off("DDSPEC_VNNI"):
            options = tuple(o for o in options if "-mavx512vnni" not in o[1])
        _wide = [] if _switched_off("DDSPEC_AVX512") else _first_taken(options)
    return _wide


class _Build:
    """The compiler runs writing ``out``: one per part of the source (PARTS), started at once
    without waiting, then a link through a temporary file renamed into place only when it
    succeeds. The -O3 build takes about 15 s on two cores, so :func:`start_build` runs it while
    the caller does other work (converting the model, loading weights) and :func:`library`
    waits for it only when the kernels are needed."""

    def __init__(self, out: Path) -> None:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C compiler (cc/gcc) on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(out.parent)
        fd, self.tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out.parent)
        os.close(fd)
        self.objects = [f"{self.tmp[:-len('.so.tmp')]}-{mask}.o.so.tmp" for mask in PARTS]
        self.out, self.compiler, self.started = out, compiler, time.monotonic()
        self.procs = []
        atexit.register(self.abandon)
        for mask, obj in zip(PARTS, self.objects):
            self.procs.append(subprocess.Popen([compiler, *build_flags(), f"-DDD_PARTS={mask}", "-c", str(SOURCE), "-o", obj],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))

    def wait(self, announce: bool = True) -> None:
        if announce and any(p.poll() is None for p in self.procs):
            print(f"ddspec: waiting for the kernel build to finish (started {time.monotonic() - self.started:.0f} s ago)",
                  file=sys.stderr)
        try:
            for proc in self.procs:
                _, err = proc.communicate()
                if proc.returncode:
                    raise RuntimeError(f"{self.compiler} failed: {err.strip()[:500]}")
            link = subprocess.run([self.compiler, "-shared", "-fopenmp", *self.objects, "-o", self.tmp, "-lm"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if link.returncode:
                raise RuntimeError(f"{self.compiler} failed to link: {link.stderr.strip()[:500]}")
            os.replace(self.tmp, self.out)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Stop the compilers still running (the process is exiting) and remove the temporary files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for path in (self.tmp, *self.objects):
            if os.path.exists(path):
                os.unlink(path)


_pending: _Build | None = None


def _remove_stale(folder: Path, age_s: float = 3600.0) -> None:
    """Temporary outputs of builds whose process was killed outright (no exit handler ran)."""
    for path in folder.glob("*.so.tmp"):
        try:
            if time.time() - path.stat().st_mtime > age_s:
                path.unlink()
        except OSError:
            pass


def _enabled() -> str | None:
    """Why the kernels cannot be used here, or None."""
    if _switched_off("DDSPEC_NATIVE"):
        return "disabled by DDSPEC_NATIVE=0"
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        return "needs an x86-64 CPU with AVX2, FMA and F16C"
    return None


def _kernel_paths() -> tuple[Path, Path]:
    """Where this build (:func:`build_id`: one hash of the sources for both) lives: in the cache, and
    where :func:`prebuild` puts it, beside the Python environment (``<sys.prefix>/share/ddspec/native``,
    e.g. the repository's .venv), which outlives any cache."""
    from ddspec.machine import cache_root

    name = f"ddspec_kernels-{build_id()}.so"
    return cache_root() / "native" / name, Path(sys.prefix) / "share" / "ddspec" / "native" / name


def _built_path(paths: tuple[Path, Path] | None = None) -> Path | None:
    """The kernels already built for this source, compiler and flags: in the cache, else those
    :func:`prebuild` installed; None when neither is there. ``paths``: :func:`_kernel_paths`, when the
    caller has them already (one hash of the sources per lookup)."""
    return next((p for p in paths or _kernel_paths() if p.is_file()), None)


def prebuild() -> Path | None:
    """Compile the kernels into the Python environment (:func:`_kernel_paths`) now, unless they are
    there already (or in the cache: then linked or copied) or cannot be used here; returns where they are
    (None when they cannot be had). ``make setup`` runs this beside pip (``python -m ddspec.native``), so
    that a first ``ddspec`` command, on any cache, does not wait for the compiler."""
    why = _enabled()
    if why is not None:
        print(f"ddspec: no CPU kernels to build: {why}", file=sys.stderr)
        return None
    cached, out = _kernel_paths()
    if out.is_file():
        return out
    if cached.is_file():  # built into the cache by an earlier command: link or copy it
        from ddspec.fileio import place_file

        out.parent.mkdir(parents=True, exist_ok=True)
        place_file(cached, out)
        return out
    started = time.monotonic()
    print(f"ddspec: compiling ddspec's CPU kernels into {out.parent} (once, about 20 s on two cores)", file=sys.stderr)
    _Build(out).wait(announce=False)
    print(f"ddspec: compiled in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return out


def start_build() -> None:
    """Start compiling the kernels in the background when they are not built yet (no-op
    otherwise, and when they cannot be used here); :func:`library` finishes the job."""
    global _pending
    if _lib is not None or _why_not is not None or _pending is not None or _enabled() is not None:
        return
    paths = _kernel_paths()
    if _built_path(paths) is not None:
        return
    print("ddspec: compiling ddspec's CPU kernels in the background (once, about 15 s on two cores)",
          file=sys.stderr)
    try:
        _pending = _Build(paths[0])
    except (OSError, RuntimeError):
        _pending = None  # library() tries again in the foreground and reports the error


def build_id() -> str:
    """Names this source built with this compiler and flags (kernel choices are cached per build)."""
    compiler = _compiler() or "cc"
    recipe = " ".join([compiler, *build_flags(), "parts", *map(str, PARTS)])
    sources = b"".join(path.read_bytes() for path in SOURCES)
    return hashlib.sha256(sources + recipe.encode()).hexdigest()[:16]


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built once per machine), or None; :func:`unavailable_reason` says why."""
    global _lib, _why_not, _pending
    if _lib is not None or _why_not is not None:
        return _lib
    _why_not = _enabled()
    if _why_not is not None:
        return None
    paths = _kernel_paths()
    path = _built_path(paths) or paths[0]
    try:
        if not path.is_file():
            build, _pending = _pending, None
            if build is not None and build.out != path:  # started for another cache root
                build.abandon()
                build = None
            if build is None:
                print("ddspec: compiling ddspec's CPU kernels (once, about 15 s on two cores)", file=sys.stderr)
                build = _Build(path)
            build.wait()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        _why_not = f"could not build or load {path.name}: {e}"
        print(f"ddspec: {_why_not}; using torch's kernels", file=sys.stderr)
        return None
    lib.dd_gemm.argtypes = [ctypes.POINTER(_Weight), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_void_p]
    lib.dd_gemm.restype = ctypes.c_int
    lib.dd_gemm_sweep.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int]
    lib.dd_gemm_sweep.restype = ctypes.c_int
    lib.dd_layers_forward.argtypes = [ctypes.POINTER(_Layer), ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    lib.dd_layers_forward.restype = ctypes.c_int
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
    library()
    return _why_not


def available() -> bool:
    return library() is not None


class NativeWeight:
    """One weight as the kernels read it, packed in groups of 16 outputs (see ddspec_kernels.c).

    Built from the row layout: kind ``f32``: ``w`` [out, in]; ``q4_1``: ``qs`` uint8
    [out, in/32, 16] (GGUF nibbles: byte j holds elements j and j + 16 of the block), ``d``/``m``
    float32 [out, in/32]; ``q8_0``: ``qs`` int8 [out, in/32, 32], ``d`` [out, in/32]. Kinds
    ``q4_1a8`` / ``q8_0a8`` hold the same blocks, multiplied with 8-bit activations (see
    :meth:`with_int8_activations`). The row layout is kept (``rows``) for stacking weights and
    taking subsets of outputs.
    """

    def __init__(self, kind: str, out: int, inp: int, *, w=None, qs=None, d=None, m=None, bias=None) -> None:
        self.kind, self.out_features, self.in_features = kind, out, inp
        self.rows = (w, qs, d, m)
        self.bias = None if bias is None else bias.float().contiguous()
        if inp % 32 and kind not in ("f32", *HALVES):
            raise ValueError(f"a {kind} weight needs an input width that is a multiple of 32, not {inp}")
        self._packed: tuple | None = None
        self._struct: _Weight | None = None

    # packed on first use: a weight that is only stacked into another (q, k, v) is never packed
    @property
    def packed(self) -> tuple:
        """w, qs, d, m in the group layout."""
        if self._packed is None:
            self._packed = _pack(self.kind, self.out_features, self.in_features, *self.rows)
        return self._packed

    @property
    def struct(self) -> _Weight:
        if self._struct is None:
            self._struct = _Weight(KINDS[self.kind], self.out_features, self.in_features,
                                   *(_ptr(t) for t in self.packed), _ptr(self.bias))
        return self._struct

    @classmethod
    def dense(cls, w_oi: torch.Tensor, bias: torch.Tensor | None = None) -> "NativeWeight":
        """A dense weight, stored as fp16 or bf16 when that holds every value exactly (a head or
        model shipped in half precision: half the bytes to read, the same maths), else fp32."""
        w = w_oi.detach().float()
        return cls(exact_kind(w), w.shape[0], w.shape[1], w=w, bias=bias)

    @classmethod
    def q8_0(cls, w_oi: torch.Tensor) -> "NativeWeight":
        """``w_oi`` [out, in] quantised to GGUF's Q8_0 (per block of 32 inputs: d = max|w| / 127 in
        fp16, q = round(w / d)): a quarter of fp32's bytes, an approximation of the weight (for a
        draft head, whose output only proposes tokens the target then verifies)."""
        blocks = _blocks_of(w_oi)
        d = (blocks.abs().amax(dim=-1) / 127).to(torch.float16).float()  # [out, nb]
        q = (blocks * _reciprocal(d).unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return cls("q8_0", *w_oi.shape, qs=q, d=d)

    @classmethod
    def q4_1(cls, w_oi: torch.Tensor) -> "NativeWeight":
        """``w_oi`` [out, in] quantised to GGUF's Q4_1 (per block of 32 inputs: m = min w and
        d = (max w - m) / 15, both fp16, q = round((w - m) / d) in 0..15): an eighth of fp32's
        bytes and a coarser approximation than :meth:`q8_0` (for a draft head)."""
        blocks = _blocks_of(w_oi)
        m = blocks.amin(dim=-1).to(torch.float16).float()  # [out, nb]
        d = ((blocks.amax(dim=-1) - m) / 15).to(torch.float16).float()
        q = ((blocks - m.unsqueeze(-1)) * _reciprocal(d).unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)  # GGUF's nibbles: byte j holds elements j and j + 16
        return cls("q4_1", *w_oi.shape, qs=qs.contiguous(), d=d, m=m)

    def with_int8_activations(self) -> "NativeWeight":
        """This Q4_1 / Q8_0 weight multiplying activations rounded to 8 bits per block of 32
        (kinds ``q4_1a8`` / ``q8_0a8``; see ddspec_kernels.c); other kinds unchanged."""
        kind = {"q4_1": "q4_1a8", "q8_0": "q8_0a8"}.get(self.kind)
        if kind is None:
            return self
        w, qs, d, m = self.rows
        return NativeWeight(kind, self.out_features, self.in_features, w=w, qs=qs, d=d, m=m, bias=self.bias)

    def with_bias(self, bias: torch.Tensor | None) -> "NativeWeight":
        if bias is None:
            return self
        w, qs, d, m = self.rows
        return NativeWeight(self.kind, self.out_features, self.in_features, w=w, qs=qs, d=d, m=m, bias=bias)

    def select(self, rows: torch.Tensor) -> "NativeWeight":
        """The weight of a subset of outputs (e.g. a draft vocabulary's rows of an lm_head)."""
        pick = [None if t is None else t[rows] for t in self.rows]
        return NativeWeight(self.kind, rows.numel(), self.in_features, w=pick[0], qs=pick[1], d=pick[2], m=pick[3])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (fp32) @ W^T -> [..., out]."""
        return self._gemm(x, None)

    def with_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ W^T, the first index of each row's maximum as numpy's argmax gives it): the argmax taken
        by each thread over its half of the outputs inside the matmul's parallel region, while they
        are still in its caches (an lm_head's greedy choice; 0.1 ms a token read afterwards)."""
        best = torch.empty(x.shape[:-1], dtype=torch.int64)
        return self._gemm(x, best), best

    def _gemm(self, x: torch.Tensor, best: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        rc = library().dd_gemm(ctypes.byref(self.struct), x2.data_ptr(), x2.shape[0], y.data_ptr(),
                               torch.get_num_threads(), None if best is None else best.data_ptr())
        if rc:
            raise ValueError(f"dd_gemm refused a {self.kind} weight of shape [{self.out_features}, {self.in_features}]")
        return y.view(*lead, self.out_features)


def gemm_sweep(weights: list[NativeWeight], x: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ W^T for each weight in turn, in one C call and one parallel region (dd_gemm_sweep):
    the matmuls alone, without a call per matmul; returns the last one's output [n, out]. The same
    weight listed k times times its arithmetic with the weight in the caches; k different weights
    stream them as a forward does. Every weight must take ``in`` inputs."""
    lib = library()
    if lib is None:
        raise ValueError("the native kernels are not built here")
    if not weights or any(w.in_features != x.shape[-1] for w in weights):
        raise ValueError(f"gemm_sweep: every weight must take {x.shape[-1]} inputs")
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = torch.empty(x2.shape[0], max(w.out_features for w in weights), dtype=torch.float32)
    structs = [w.struct for w in weights]
    ptrs = (ctypes.POINTER(_Weight) * len(structs))(*(ctypes.pointer(s) for s in structs))
    if lib.dd_gemm_sweep(ctypes.addressof(ptrs), len(structs), x2.data_ptr(), x2.shape[0], y.data_ptr(),
                         torch.get_num_threads()):
        raise ValueError("dd_gemm_sweep refused a quantised weight whose input width is not a multiple of 32")
    n, out = x2.shape[0], weights[-1].out_features
    return y.view(-1)[:n * out].view(n, out)  # each matmul writes its rows out wide


def _blocks_of(w_oi: torch.Tensor) -> torch.Tensor:
    """[out, in] -> fp32 [out, in / 32, 32]: GGUF's blocks of 32 inputs."""
    return w_oi.detach().float().reshape(w_oi.shape[0], w_oi.shape[1] // 32, 32)


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where a block's scale is 0 (an all-equal block: every level 0)."""
    return torch.where(d > 0, 1.0 / d, torch.zeros_like(d))


GROUP = 16


def _half(t: torch.Tensor, what: str) -> torch.Tensor:
    """A block format's fp32 scales or minimums as fp16, the kernels' layout: GGUF stores them in
    fp16 (and NativeWeight.q4_1 / q8_0 round them so), so this keeps every value."""
    half = t.to(torch.float16)
    if not torch.equal(half.float(), t.float()):
        raise ValueError(f"block {what} that fp16 cannot hold exactly: the kernels keep them in fp16, as GGUF does")
    return half


def _pack(kind: str, out: int, inp: int, w, qs, d, m) -> tuple:
    """Row layout -> the kernels' group layout (outputs padded to a multiple of 16 with zeros)."""
    groups = -(-out // GROUP)
    pad = groups * GROUP - out

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, ...] -> [G, ..., 16]
        t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))]) if pad else t
        t = t.reshape(groups, GROUP, *t.shape[1:])
        return t.movedim(1, -1).contiguous()

    if kind == "f32":
        return grouped(w.float()), None, None, None
    if kind in HALVES:
        return grouped(w.to(HALVES[kind])), None, None, None
    nb = inp // 32
    if kind == "q4_1a8":  # per quad of 4 inputs: byte 4o + j = q(o, 4i + j) | q(o + 8, 4i + j) << 4
        q = grouped(torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, inp))  # [G, in, 16]
        q = q.reshape(groups, nb, 8, 4, GROUP)  # [G, block, quad, j, output]
        levels = (q[..., :8] | (q[..., 8:] << 4)).permute(0, 1, 2, 4, 3).reshape(groups, nb, 256)
        head = [grouped(_half(d, "scales").reshape(out, nb)), grouped(_half(m, "minimums").reshape(out, nb))]
    elif kind == "q4_1":
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, inp)  # element order within each block
        q = grouped(q)  # [G, in, 16] values 0..15
        levels = (q[..., :8] | (q[..., 8:] << 4)).reshape(groups, nb, 256)  # byte j: output j (low), j + 8 (high)
        head = [grouped(_half(d, "scales").reshape(out, nb)), grouped(_half(m, "minimums").reshape(out, nb))]  # [G, nb, 16]
    elif kind == "q8_0a8":  # per quad of 4 inputs: outputs 0-7 then 8-15, byte 4o + j = q(o, 4i + j)
        q = grouped(qs.reshape(out, inp).view(torch.int8)).view(torch.uint8)  # [G, in, 16]
        q = q.reshape(groups, nb, 8, 4, 2, 8)  # [G, block, quad, j, half, output]
        levels = q.permute(0, 1, 2, 4, 5, 3).reshape(groups, nb, 512)
        head = [grouped(_half(d, "scales").reshape(out, nb))]
    else:
        levels = grouped(qs.reshape(out, inp).view(torch.int8)).view(torch.uint8).reshape(groups, nb, 512)
        head = [grouped(_half(d, "scales").reshape(out, nb))]
    # one contiguous block per (group, 32 inputs): fp16 scales (and minimums), then the levels
    blocks = torch.cat([h.contiguous().view(torch.uint8) for h in head] + [levels], dim=-1).contiguous()
    return None, blocks, None, None


def exact_kind(w: torch.Tensor) -> str:
    """``f16`` or ``bf16`` when that format holds every value of the fp32 tensor ``w`` exactly, else ``f32``."""
    for kind, dtype in HALVES.items():
        if torch.equal(w.to(dtype).float(), w):
            return kind
    return "f32"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def concat(weights: list[NativeWeight]) -> NativeWeight:
    """Weights of one kind and input width stacked along the outputs (q|k|v, gate|up)."""
    kind, inp = weights[0].kind, weights[0].in_features
    if any(w.kind != kind or w.in_features != inp for w in weights):
        raise ValueError("only weights of one kind and input width can be stacked")
    parts = [torch.cat([w.rows[i] for w in weights]) if weights[0].rows[i] is not None else None
             for i in range(4)]
    return NativeWeight(kind, sum(w.out_features for w in weights), inp, w=parts[0], qs=parts[1], d=parts[2], m=parts[3])


def layer_struct(arch, in_norm, post_norm, qkv: NativeWeight, o: NativeWeight, gate_up: NativeWeight,
                 down: NativeWeight, extra: int = 0) -> _Layer:
    """extra > 0: q/k/v read ``cat(extra row, in_norm(x))`` (an EAGLE-3 midlayer), the extra rows
    given to :func:`layers_forward`."""
    return _Layer(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, down.in_features,
                  arch.rms_eps, _ptr(in_norm), _ptr(post_norm), qkv.struct, o.struct, gate_up.struct, down.struct,
                  extra)


def layer_array(layers: list[_Layer]):
    """Consecutive decoder layers as one C array (for :func:`layers_forward`); the weights they
    point to stay owned by their LlamaLayer objects."""
    return (_Layer * len(layers))(*layers)


ATTENTION_MODES = {"auto": 0, "rows": 1, "shared": 2}


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
    import time

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
    import time

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


def set_attention(mode: str) -> None:
    """Which attention ``dd_layers_forward`` runs: ``rows`` (one (token, head) row per unit, one
    pass), ``shared`` (each kv head's keys and values read once for all its queries, three
    passes), or ``auto`` (rows for one new token, shared for more). Both compute the same sums in
    the same order; this exists for tests and measurements."""
    lib = library()
    if lib is None or lib.dd_set_attention(ATTENTION_MODES[mode]):
        raise ValueError(f"cannot set the attention mode {mode!r}")


def set_attention_wide(on: bool) -> bool:
    """Run the shared attention's passes on 16 lanes where the build has AVX-512F (``on``) or on 8;
    the same bits either way. Returns whether the 16-lane passes are in use now."""
    lib = library()
    return bool(lib is not None and lib.dd_set_attention_wide(int(bool(on))))


def attention_wide() -> bool:
    """Whether the shared attention's passes run on 16 lanes now."""
    lib = library()
    return bool(lib is not None and lib.dd_set_attention_wide(-1))


def choose_attention_wide(shape: dict, measure) -> bool:
    """Whether the shared attention runs on 16 lanes here: the cached answer for this CPU, kernel
    build, thread count and attention ``shape`` (a dict naming it), else ``measure()`` (a function
    that times both settings and returns the faster) now, cached unless other programs took the
    CPU meanwhile (:func:`_cached_choice`). Sets it either way; without 16-lane passes in the build, off."""
    from ddspec.machine import cpu_name

    if not wide_available():
        return set_attention_wide(False)

    def apply(data: dict) -> None:
        if not isinstance(data["wide"], bool):
            raise TypeError("not a choice")
        set_attention_wide(data["wide"])

    key = {"format": 1, "cpu": cpu_name(), "build": build_id(), "threads": torch.get_num_threads(), "shape": shape}
    _cached_choice("attention", key, lambda: {"wide": bool(measure())}, apply)
    return attention_wide()


def top_logprobs(a: torch.Tensor, b: torch.Tensor | None, scale: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of ``log_softmax(scale * cat([a, b], -1), -1)`` for each row, descending, and their
    columns (b's numbered after a's): a [n, Va], b [n, Vb] or None, fp32. One C pass per row instead of
    torch's cat, multiply, log_softmax and topk (about 0.1 ms for one row of 8,448 on our 2-core CPUs,
    most of it per-op dispatch). Equal values come earlier column first; the normaliser's sum runs in
    another order than torch's, so a value can differ from log_softmax's in its last bit.
    Returns (values [n, k] fp32, ids [n, k] int64)."""
    a = a.float().contiguous()
    b = None if b is None or b.shape[-1] == 0 else b.float().contiguous()
    n = a.shape[0]
    values = torch.empty(n, k, dtype=torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64)
    if library().dd_top_logprobs(a.data_ptr(), a.shape[-1], None if b is None else b.data_ptr(),
                                 0 if b is None else b.shape[-1], n, scale, k, values.data_ptr(), ids.data_ptr()):
        raise ValueError(f"dd_top_logprobs: bad sizes (rows {n}, columns {a.shape[-1]} + "
                         f"{0 if b is None else b.shape[-1]}, k {k}, scale {scale})")
    return values, ids


def layers_forward(array, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   mask: torch.Tensor | None, extra: torch.Tensor | None = None,
                   capture: dict[int, torch.Tensor] | None = None,
                   final_norm: tuple[torch.Tensor, float] | None = None) -> None:
    """Every layer of ``array`` in order, in place on x [n, H], in one C call. keys/values: the
    caches of those layers [count, Hkv, Tmax, D] (a contiguous slice of the model's cache), both fp32
    or both fp16 (each new key and value is then rounded to fp16 as it is written).
    extra: [n, E] fp32 contiguous, for layers built with ``extra=E``. capture: {i: out} with out
    [n, H] fp32 contiguous, filled with x as it enters layer i. final_norm: (weight [H] fp32
    contiguous, epsilon) of an RMSNorm applied to x after the last layer, in the same call."""
    n, count = x.shape[0], len(array)
    if keys.dtype != values.dtype or keys.dtype not in KV_DTYPES:
        raise ValueError(f"dd_layers_forward takes fp32 or fp16 keys and values, got {keys.dtype} and {values.dtype}")
    slots = None
    if capture:
        slots = (ctypes.c_void_p * count)(*[capture[i].data_ptr() if i in capture else None for i in range(count)])
    rc = library().dd_layers_forward(
        array, count, x.data_ptr(), n, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.shape[2], start,
        None if mask is None else mask.data_ptr(), torch.get_num_threads(), None if extra is None else extra.data_ptr(),
        slots, None if final_norm is None else final_norm[0].data_ptr(), 0.0 if final_norm is None else final_norm[1],
        int(keys.dtype == torch.float16))
    if rc:
        raise ValueError(f"dd_layers_forward refused layer {rc // 8}'s sizes (n={n}, start={start}, "
                         f"cache {list(keys.shape)})")


# -- the AVX-512 passes: which groups per pass, chosen by measurement ---------------------------
WIDE_ROWS = 8  # the tile sizes dd_wide_groups covers (more rows run in balanced tiles of at most 8)
WIDE_KINDS = {"q4_1": 0, "q8_0": 1, "q4_1a8": 2, "q8_0a8": 3}
WIDE_A8 = ("q4_1a8", "q8_0a8")  # the kinds whose AVX-512 passes also need AVX-512 VNNI


def wide_available(kind: str | None = None) -> bool:
    """Whether the kernels were built with the AVX-512 passes (a CPU with AVX-512F, DDSPEC_AVX512 unset),
    for ``kind`` when given (the 8-bit-activation kinds also need AVX-512 VNNI)."""
    lib = library()
    return lib is not None and lib.dd_wide() >= (2 if kind in WIDE_A8 else 1)


def wide_options(rows: int, kind: str | None = None) -> tuple[int, ...]:
    """The groups per pass a tile of ``rows`` rows can take: 0 (the 8-lane passes), 1, 2, 3 (up to 4
    rows; up to 8 for an 8-bit-activation ``kind``), 4 (up to 2 rows). Three groups for 5-8 rows of
    8-bit activations: the int8 model's forward over 5-8 tokens after 256 took 3.5-4% less than
    with two (Intel Xeon family 6 model 207, interleaved medians of 15); for 3-6 rows four groups
    measured the same as three, so they are not built."""
    three = WIDE_ROWS if kind in WIDE_A8 else 4
    return tuple(g for g, top in ((0, WIDE_ROWS), (1, WIDE_ROWS), (2, WIDE_ROWS), (3, three), (4, 2)) if rows <= top)


def set_wide(kind: str, groups: list[int]) -> None:
    """Use ``groups[r - 1]`` groups per pass for tiles of r rows of ``kind`` (one of WIDE_KINDS: q4_1 /
    q8_0 with fp32 activations, q4_1a8 / q8_0a8 with 8-bit ones; 0 = the 8-lane passes)."""
    lib = library()
    for rows, g in enumerate(groups, 1):
        if lib is None or lib.dd_set_wide_groups(WIDE_KINDS[kind], rows, int(g)):
            raise ValueError(f"no kernel pass for {rows} rows of {kind} in {g} groups")


def wide_choice() -> dict[str, list[int]]:
    """The groups per pass in use for tiles of 1..WIDE_ROWS rows of each kind ({} without the AVX-512 passes)."""
    if not wide_available():
        return {}
    return {kind: [library().dd_get_wide_groups(i, rows) for rows in range(1, WIDE_ROWS + 1)]
            for kind, i in WIDE_KINDS.items() if wide_available(kind)}


PREFETCH_OPTIONS = (0, 12, 24, 48)  # blocks ahead the quantised passes of 3 rows or more may prefetch (0: none)


def set_share_rows(rows: int) -> None:
    """From ``rows`` rows on (0: never) the 8-bit-activation matmuls round their rows once, shared
    among the threads, instead of once per thread; the same bits either way (default 3)."""
    lib = library()
    if lib is None or lib.dd_set_share_rows(int(rows)):
        raise ValueError(f"cannot share the rounding from {rows} rows (0 or more, with the kernels built)")


def set_prefetch(blocks: int) -> None:
    """Have the quantised passes (Q4_1 / Q8_0 blocks, with fp32 or 8-bit activations) of 3 rows or more
    prefetch the weight blocks ``blocks`` ahead into the L2 cache (0: leave it to the hardware). The
    same bits whatever it is; only the time differs."""
    lib = library()
    if lib is None or lib.dd_set_prefetch(int(blocks)):
        raise ValueError(f"cannot prefetch {blocks} blocks ahead (0 .. 256, with the kernels built)")


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


def set_span_delay(us: int) -> int:
    """For tests: thread 0 of every quantised or dense matmul starts ``us`` microseconds late (0: on
    time), so that the other threads take its groups (the kernels' work stealing); returns how many
    units of groups were taken from another thread while a delay was set, since the last call."""
    lib = library()
    if lib is None:
        raise ValueError("the native kernels are not built here")
    return int(lib.dd_set_span_delay(int(us)))


def prefetch_blocks() -> int:
    """The blocks ahead the quantised passes of 3 rows or more prefetch now (0: none)."""
    lib = library()
    return 0 if lib is None else lib.dd_get_prefetch()


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
    from ddspec.machine import interleaved_medians

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
    from ddspec.machine import interleaved_medians

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
    from ddspec.machine import cpu_name

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
    return _cached_choice("wide-forward", key, measure, apply)["groups"]


def _cached_choice(name: str, key: dict, measure, apply) -> dict:
    """A kernel choice measured once per ``key`` (CPU, build, threads, shapes ...): the entry cached in
    ``<cache root>/kernels/<name>-*.json`` when its key matches and ``apply(entry)`` takes it, else
    ``measure()`` (a dict) now, applied, and cached unless other programs took the CPU meanwhile (a
    timing made then favours whichever option minds them least). Returns the entry."""
    import json

    from ddspec.fileio import write_json_atomic
    from ddspec.machine import OtherLoad, cache_root

    path = cache_root() / "kernels" / (f"{name}-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            apply(data)
            return data
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, stale or unreadable: measure
    others = OtherLoad()
    data = {"key": key, **measure(), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    apply(data)
    if others.too_busy() is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, data)
        except OSError:
            pass  # measured again next time
    return data


def choose_wide(weights, shapes: dict[str, list[str]] | None = None) -> dict[str, list[int]]:
    """Set the AVX-512 passes' groups per pass for each kind in ``weights`` ({kind: a model's weights
    of that kind}, or a function returning that, called only when there is something to measure;
    ``shapes``: {kind: ["outxin", ...]} of those weights, needed with a function), and how far ahead
    the quantised passes of 3 rows or more prefetch (:func:`measure_prefetch`, on the weights of
    the kinds whose shapes do not start with "head ": those a forward streams from memory): the
    cached choice for this CPU, kernel build, thread count and shapes, else measured now (a few
    seconds, once) and cached unless other programs took the CPU meanwhile (:func:`_cached_choice`).
    Without the AVX-512 passes only the prefetch is chosen (every groups choice is 0). The results
    are the same bits whatever the choice; only the time differs. Returns the groups chosen by kind
    ({} without the AVX-512 passes)."""
    from ddspec.machine import cpu_name

    if library() is None:
        return {}
    if shapes is None:
        shapes = {k: sorted({f"{w.out_features}x{w.in_features}" for w in v}) for k, v in weights.items() if v}
    shapes = {k: sorted(v) for k, v in shapes.items() if k in WIDE_KINDS and v}  # the quantised kinds
    if not shapes:
        return {}

    def measure() -> dict:
        given = weights() if callable(weights) else weights
        print("ddspec: timing the kernel passes on this CPU (once, cached)", file=sys.stderr)
        chosen = {kind: measure_wide(given[kind]) for kind in shapes if wide_available(kind) and given.get(kind)}
        streamed = [w for kind in shapes if not all(s.startswith("head ") for s in shapes[kind]) for w in given.get(kind, [])]
        return {"groups": chosen, "prefetch": measure_prefetch(streamed) if streamed else 0}

    def apply(data: dict) -> None:
        for kind, groups in data["groups"].items():  # (what a model's own forward chose stays)
            set_wide(kind, _forward_tuned.get(kind, groups))
        set_prefetch(data["prefetch"])

    key = {"format": 3, "cpu": cpu_name(), "build": build_id(), "threads": torch.get_num_threads(), "shapes": shapes}
    return _cached_choice("wide", key, measure, apply)["groups"]
