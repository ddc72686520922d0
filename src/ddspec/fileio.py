"""Writing files so that a crash or a full disk never leaves half a file behind.

Every JSON record ddspec keeps between runs (data manifests, layer-state indexes, kernel choices,
cost measurements, a head's config) is written to ``<name>.tmp`` beside it and renamed over the
old one: a reader sees the old file or the new one, never a torn write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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


def place_file(src: Path, dst: Path) -> None:
    """``src`` at ``dst``: a hard link (same file system), else a copy; through a temp name."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
