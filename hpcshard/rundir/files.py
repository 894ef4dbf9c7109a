"""Small files written so that a reader never sees half of one (stdlib)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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


def append_line(path: Path, line: str) -> None:
    """Append one line (a JSON record) in a single write. A write cut short (no space left)
    is taken back, so the file never holds half a record with the next one glued to it;
    the OSError is raised."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(28, "No space left on device (a short write)")
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every JSON record of a .jsonl file, oldest first (none yet: empty). A line that does
    not parse (cut short by a full disk, before `append_line` took such writes back) is
    skipped: the records around it are still the run's history."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found
