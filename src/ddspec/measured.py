"""Results measured once per machine and set-up, kept in the cache for later runs.

Kernel plans (models/kernels.py), the C kernels' options (native/tuning.py) and step costs
(calibrate.py) are timings of this machine. Each is cached as one JSON file under
``<cache root>/<folder>/``, named by a hash of its key (the CPU, the build, the thread count,
the shapes ... whatever the result depends on) and holding that key: an entry whose key differs
(another set-up hashed alike, an older format) is stale and measured again.

A timing made while other programs took more than ``BUSY_SHARE`` of the CPU (machine.OtherLoad)
favours whatever minds sharing the cores least, not what is fastest here: such a result serves
the run that measured it and is not cached. Every result that is not cached says so once, in
the same words.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

from ddspec.fileio import write_json_atomic
from ddspec.machine import OtherLoad, cache_root

T = TypeVar("T")

# what a cached entry's reader may raise on a file that is not what it wrote: the entry is measured again
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError)


def entry_path(folder: str, key: dict, name: str = "") -> Path:
    """``<cache root>/<folder>/[<name>-]<hash of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / folder / (f"{name}-{digest}.json" if name else f"{digest}.json")


class Entry:
    """One cached result: ``what`` names it in notices (e.g. "the kernel choice for lm_head")."""

    def __init__(self, folder: str, key: dict, what: str, name: str = "") -> None:
        self.key, self.what = key, what
        self.path = entry_path(folder, key, name)
        self.writable = True

    def read(self, use: Callable[[dict], T]) -> T | None:
        """``use(data)`` (never None) of the cached entry, or None when it is missing or stale; when
        the file or ``use`` finds it unreadable, None with a notice (it is measured again)."""
        try:
            data = json.loads(self.path.read_text())
        except OSError:
            return None  # missing (or no cache folder to read)
        except ValueError as e:
            return self._unreadable(e)
        try:
            if data.get("key") != self.key:
                return None  # another set-up hashed here, or an older format: measure again
            return use(data)
        except UNREADABLE as e:
            return self._unreadable(e)

    def _unreadable(self, e: Exception) -> None:
        print(f"ddspec: the cache entry {self.path} is unreadable ({type(e).__name__}); measuring again",
              file=sys.stderr)
        return None

    def write(self, data: dict) -> bool:
        """``{"key": key, **data}`` written atomically; False (and a notice, once per entry) when the
        cache cannot be written."""
        if not self.writable:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"key": self.key, **data})
            return True
        except OSError as e:
            self.writable = False
            not_cached(self.what, f"cannot write the cache {self.path.parent}: {e.strerror or e}; "
                                  "set DDSPEC_CACHE to a writable folder to keep it")
            return False


def not_cached(what: str, why: str) -> None:
    """The one notice for a result that is used now and measured again next time."""
    print(f"ddspec: {what}: not cached ({why}); measured again next time", file=sys.stderr)


def measured_once(entry: Entry, measure: Callable[[], dict], use: Callable[[dict], T]) -> T:
    """``use(data)`` of the cached entry when there is one and ``use`` takes it; else ``measure()``
    (a dict) now, with the time it was measured added, used, and cached unless other programs
    took the CPU meanwhile."""
    cached = entry.read(use)
    if cached is not None:
        return cached
    others = OtherLoad()
    data = {**measure(), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    result = use(data)
    share = others.too_busy()
    if share is not None:
        not_cached(entry.what, f"other programs used {share:.0%} of the CPU while timing it")
    else:
        entry.write(data)
    return result
