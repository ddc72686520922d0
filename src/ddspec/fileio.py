"""Writing files so that a crash or a full disk never leaves half a file behind.

Every JSON record ddspec keeps between runs (data manifests, layer-state indexes, kernel choices,
cost measurements, a head's config) is written to ``<name>.tmp`` beside it and renamed over the
old one: a reader sees the old file or the new one, never a torn write.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj, indent: int = 1) -> None:
    """``obj`` as JSON at ``path`` through a temp name; OSError (read-only, disk full) propagates."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=indent) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
