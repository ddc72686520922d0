"""Facts about the machine at hand: its CPU, its cores, and where ddspec keeps its cache.

The cache root is ``$DDSPEC_CACHE`` when set, else ``$XDG_CACHE_HOME/ddspec``, else
``~/.cache/ddspec``. It holds converted models (``models/``) and measured step costs
(``costs/``); deleting it only costs a re-conversion and a re-calibration.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_root() -> Path:
    explicit = os.environ.get("DDSPEC_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddspec"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def core_count() -> int:
    """Cores this process may run on (its affinity), the default torch thread count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (None where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
