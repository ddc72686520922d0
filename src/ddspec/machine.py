"""Facts about the machine at hand: its CPU, its cores, and where ddspec keeps its cache.

The cache root is ``$DDSPEC_CACHE`` when set, else ``$XDG_CACHE_HOME/ddspec``, else
``~/.cache/ddspec``. It holds converted models (``models/``) and measured step costs
(``costs/``); deleting it only costs a re-conversion and a re-calibration.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path


def cache_root() -> Path:
    explicit = os.environ.get("DDSPEC_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddspec"


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers where the name alone is vague: a VM
    may call both a Zen 2 and a Zen 5 host "AMD EPYC", and their fastest kernels differ (the
    kernel and cost caches are keyed by this name)."""
    try:
        name = cpu_name_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        name = None
    return name or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name_from_cpuinfo(text: str) -> str | None:
    """``model name (family F, model M)`` of the first processor in /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() and fields:  # the first processor's block is enough
            break
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "cpu family", "model"):
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if name and "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def core_count() -> int:
    """Cores this process may run on (its affinity), the default torch thread count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (None where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds all programs have spent busy, CPU seconds this process has spent) since boot
    and since it started, from /proc/stat and os.times(); None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


BUSY_SHARE = 0.25  # other programs' share of the CPU above which a timing is not kept for later runs


class OtherLoad:
    """How much of the CPU other programs used since this object was made: the share of the
    cores' time that was busy outside this process (0 = a quiet machine, 1 = every core taken)."""

    def __init__(self) -> None:
        self.start, self.wall = cpu_busy_seconds(), time.monotonic()

    def share(self) -> float | None:
        now = cpu_busy_seconds()
        if now is None or self.start is None:
            return None
        wall = time.monotonic() - self.wall
        if wall <= 0:
            return None
        others = (now[0] - self.start[0]) - (now[1] - self.start[1])
        return max(0.0, others) / (wall * (os.cpu_count() or 1))

    def too_busy(self) -> float | None:
        """The share when it exceeds BUSY_SHARE (a timing then is not kept for later runs), else None."""
        share = self.share()
        return share if share is not None and share > BUSY_SHARE else None


def device_sync(device) -> None:
    """Wait for the work queued on ``device`` (a torch device or its name): a GPU runs its kernels
    after the Python call that queued them has returned, so a timer read without this measures
    the queueing. A no-op on the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(options, run, reps: int, setup=None) -> dict:
    """{option: median seconds of ``run(option)``} over ``reps`` rounds after a warm-up round, every
    round timing each option once, in an order rotated from round to round (a change in the
    machine's speed during the timing then lands on every option alike). ``setup(option)``, when
    given, runs before each timed call, untimed."""
    import statistics

    options = list(options)
    times: dict = {o: [] for o in options}
    for r in range(reps + 1):
        for o in options[r % len(options):] + options[:r % len(options)]:
            if setup is not None:
                setup(o)
            t0 = time.perf_counter()
            run(o)
            if r:
                times[o].append(time.perf_counter() - t0)
    return {o: statistics.median(v) for o, v in times.items()}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for a server this process starts: ddspec's, llama.cpp's)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def return_free_memory() -> None:
    """Hand the memory freed so far back to the system (glibc keeps freed heap memory for reuse: after
    loading a 1.5B-parameter GGUF, whose conversion buffers are freed, 4.9 GB resident instead of 1.9).
    Nothing where the C library has no malloc_trim."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
