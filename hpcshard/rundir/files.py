"""Small files written so that a reader never sees half of one (stdlib)."""

from __future__ import annotations

import os
from pathlib import Path

TMP_SUFFIX = ".tmp"
"""Names ending in it are never read as the real thing (files and checkpoint dirs)."""


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, mode: int = 0o640) -> None:
    """Write a small file so that readers see the old or the new content, never a mix.
    The mode is set explicitly: a group-writable umask must not make it refusable."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    fsync_dir(path.parent)
