"""Compiling ddspec's CPU kernels (native/kernels/*.c): the compiler flags for this CPU, the build itself,
and where built kernels live.

The build is plain C (no torch headers), -O3, one object per source file, compiled in parallel and
linked: about 12 s on two cores, 22 s of CPU. Where the CPU has them it adds VNNI
(:func:`vnni_flags`) and AVX-512 (:func:`wide_flags`; which AVX-512 passes run is measured per
machine, native/tuning.py): the same results, other instructions. Each build is named by
:func:`build_id` (the sources, compiler and flags) and cached in ``<cache root>/native/``;
:func:`prebuild` (``make setup``, ``python -m ddspec.native``) puts it beside the Python environment
instead, where every cache finds it. native/lib.py starts builds and loads what they make. It links
the OpenMP runtime torch already loaded (libgomp), so both share one thread pool.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddspec.fileio import place_file, write_json_atomic
from ddspec.machine import cache_root, cpu_flags

KERNELS = Path(__file__).with_name("kernels")
# what the build reads: the units, the headers they share and the attention passes attention.c
# includes twice (fp32 and fp16 caches); all of them name the build (build_id)
SOURCES = tuple(sorted(p for p in KERNELS.glob("*") if p.suffix in (".c", ".h", ".inc")))
# the file with the Q4_1 passes, fp32 and 8-bit activations (scripts/pass_cycles.c includes it)
SOURCE = KERNELS / "q4_1.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
         # hot loops on 64-byte boundaries: the same source measured 6-12% apart at 4-8 rows
         # depending on where its loops happened to land (AMD EPYC, interleaved A/B)
         "-falign-functions=64", "-falign-loops=64",
         "-fPIC"]
# the files compiled, one compiler run and one object each, all started at once (the longest first).
# Measured on 2 cores (AMD EPYC, AVX-512 flags), one file at a time: q4_1 7.6 s, q8_0 7.2, half 3.4,
# f32 1.8, attention 1.4, layers, gemm and misc 0.3-0.4 each: 22 s of CPU, as for the single file
# these came from compiled in three parts (23 s of CPU). Wall time on 2 cores (AMD EPYC, other load
# about 2.5): 11.8-12.1 s, the three parts of that single file 11.0-11.4 s: each file's run parses
# the intrinsics headers again (about 0.2 s of CPU), whichever runs compile the files (two runs each
# compiling its files in turn took the same wall time as eight, under heavier load)
UNITS = ("q4_1.c", "q8_0.c", "q4_k.c", "q6_k.c", "q5_1.c", "half.c", "f32.c", "attention.c", "layers.c", "gemm.c", "misc.c")

# (the CPU flags needed, the compiler flags): VEX-encoded 256-bit AVX-VNNI (Zen 5, Alder Lake, Sapphire
# Rapids), else AVX-512 VNNI on 256-bit registers (Ice Lake, Zen 4)
_VNNI_OPTIONS = (({"avx_vnni"}, ["-mavxvnni"]),
                 ({"avx512_vnni", "avx512vl"}, ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256"]))
_vnni: list[str] | None = None


def vnni_flags() -> list[str]:
    """The compiler flags that let the 8-bit-activation kernels use vpdpbusd (kernels/a8.h,
    DD_VNNI): where this CPU has AVX-VNNI or AVX-512 VNNI and the compiler takes the flag; none
    with ``DDSPEC_VNNI=0``. The results are the same bits either way (exact integer sums)."""
    global _vnni
    if _vnni is None:
        _vnni = [] if _switched_off("DDSPEC_VNNI") else _first_taken(_VNNI_OPTIONS)
    return _vnni


def _switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns a feature off (0 / off / no / false)."""
    return os.environ.get(name, "1").strip() in ("0", "off", "no", "false")


def c_compiler() -> str | None:
    """The C compiler builds use: ``$CC``, else cc or gcc on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _first_taken(options: tuple[tuple[set[str], list[str]], ...]) -> list[str]:
    """The first compiler flags of ``options`` ((CPU flags needed, compiler flags), ...) whose CPU
    flags this CPU has and which the compiler takes; [] when none."""
    have, compiler = cpu_flags(), c_compiler()
    for need, flags in options:
        if need <= have and compiler and _compiles(compiler, flags):
            return flags
    return []


def _compiles(compiler: str, options: list[str]) -> bool:
    """Whether the compiler takes these flags (an old gcc may not know -mavxvnni). Each answer is
    cached per compiler (its path, size and time) in ``<cache root>/native/probes.json``: a probe
    runs the compiler once (about 17 ms), and every process that loads the kernels asks."""
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


# AVX-512 passes for the quantised kinds with fp32 activations (kernels/quant.h, DD_WIDE) and, with
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


class Build:
    """The compiler runs writing ``out``: one per source file (UNITS), started at once
    without waiting, then a link through a temporary file renamed into place only when it
    succeeds. The -O3 build takes about 15 s on two cores, so native/lib.py's ``start_build`` runs
    it while the caller does other work (converting the model, loading weights) and ``library``
    waits for it only when the kernels are needed."""

    def __init__(self, out: Path) -> None:
        compiler = c_compiler()
        if compiler is None:
            raise RuntimeError("no C compiler (cc/gcc) on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(out.parent)
        fd, self.tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out.parent)
        os.close(fd)
        self.objects = [f"{self.tmp[:-len('.so.tmp')]}-{name[:-2]}.o.so.tmp" for name in UNITS]
        self.out, self.compiler, self.started = out, compiler, time.monotonic()
        self.procs = []
        atexit.register(self.abandon)
        for name, obj in zip(UNITS, self.objects):
            self.procs.append(subprocess.Popen([compiler, *build_flags(), "-c", str(KERNELS / name), "-o", obj],
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


def _remove_stale(folder: Path, age_s: float = 3600.0) -> None:
    """Temporary outputs of builds whose process was killed outright (no exit handler ran)."""
    for path in folder.glob("*.so.tmp"):
        try:
            if time.time() - path.stat().st_mtime > age_s:
                path.unlink()
        except OSError:
            pass


def why_not_here() -> str | None:
    """Why the kernels cannot be used here, or None."""
    if _switched_off("DDSPEC_NATIVE"):
        return "disabled by DDSPEC_NATIVE=0"
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        return "needs an x86-64 CPU with AVX2, FMA and F16C"
    return None


def kernel_paths() -> tuple[Path, Path]:
    """Where this build (:func:`build_id`: one hash of the sources for both) lives: in the cache, and
    where :func:`prebuild` puts it, beside the Python environment (``<sys.prefix>/share/ddspec/native``,
    e.g. the repository's .venv), which outlives any cache."""
    name = f"ddspec_kernels-{build_id()}.so"
    return cache_root() / "native" / name, Path(sys.prefix) / "share" / "ddspec" / "native" / name


def built_path(paths: tuple[Path, Path] | None = None) -> Path | None:
    """The kernels already built for this source, compiler and flags: in the cache, else those
    :func:`prebuild` installed; None when neither is there. ``paths``: :func:`kernel_paths`, when the
    caller has them already (one hash of the sources per lookup)."""
    return next((p for p in paths or kernel_paths() if p.is_file()), None)


def prebuild() -> Path | None:
    """Compile the kernels into the Python environment (:func:`kernel_paths`) now, unless they are
    there already (or in the cache: then linked or copied) or cannot be used here; returns where they are
    (None when they cannot be had). ``make setup`` runs this beside pip (``python -m ddspec.native``), so
    that a first ``ddspec`` command, on any cache, does not wait for the compiler."""
    why = why_not_here()
    if why is not None:
        print(f"ddspec: no CPU kernels to build: {why}", file=sys.stderr)
        return None
    cached, out = kernel_paths()
    if out.is_file():
        return out
    if cached.is_file():  # built into the cache by an earlier command: link or copy it
        out.parent.mkdir(parents=True, exist_ok=True)
        place_file(cached, out)
        return out
    started = time.monotonic()
    print(f"ddspec: compiling ddspec's CPU kernels into {out.parent} (once, about 20 s on two cores)", file=sys.stderr)
    Build(out).wait(announce=False)
    print(f"ddspec: compiled in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return out


def build_id() -> str:
    """Names this source built with this compiler and flags (kernel choices are cached per build)."""
    compiler = c_compiler() or "cc"
    recipe = " ".join([compiler, *build_flags(), "units", *UNITS])
    sources = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in SOURCES)
    return hashlib.sha256(sources + recipe.encode()).hexdigest()[:16]

