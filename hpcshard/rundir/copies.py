"""A run's copy of its code (`cli.snapshot`), found again where its run directory moved:
the copy's digest, and whether a folder of the copy's name is the copy (stdlib)."""

from __future__ import annotations

import grp
import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from hpcshard.rundir import store

CACHE = "__pycache__"
"""What Python writes beside the files it imports: never part of a copy. Not taken at
submit, even where git lists it (a workspace whose .gitignore does not name it), and not
counted when a moved copy is checked (a rank's import rewrites it there)."""


def cached(name: str) -> bool:
    """Is the file `name` (relative, with `/`) in a CACHE folder?"""
    return CACHE in name.split("/")[:-1]


def code_digest(files: Iterable[tuple[str, bytes]]) -> str:
    """The digest of a copy of code (`Code.digest`): each file's name (relative, with `/`)
    and the sha256 of its bytes, in the order of the names. A name is the file system's
    bytes (os.fsencode's rule: one that is not UTF-8 is read with surrogateescape)."""
    h = hashlib.sha256()
    for name, sha256 in sorted(files):
        h.update(name.encode(errors="surrogateescape") + b"\0" + sha256)
    return h.hexdigest()


def copy_digest(path: Path) -> str:
    """`code_digest` of what the folder `path` holds; "" where something in it is not a
    plain file (a copy holds none) or cannot be read. CACHE folders are not part of the
    copy."""
    found = []
    try:
        for folder, subdirs, names in os.walk(path):
            subdirs[:] = [d for d in subdirs if d != CACHE]
            for name in names:
                file = Path(folder, name)
                if file.is_symlink() or not file.is_file():
                    return ""
                with file.open("rb") as f:
                    sha256 = hashlib.file_digest(f, "sha256").digest()
                found.append((file.relative_to(path).as_posix(), sha256))
    except OSError:
        return ""
    return code_digest(found)


_COPIES: set[tuple[str, str]] = set()
"""Copies this process found whole (folder, digest): a sweep's tasks share one, and `ls`
reads every task's spec."""


def refused(found: Path, digest: str, group: str) -> str:
    """Why the folder `found` is not the copy of code whose digest is `digest`, in a few
    words; "" when it is: the user's own (or the run group's, as its checkpoints are) and
    writable by no one else, in a `code/` of theirs that not everyone may write, holding
    exactly the copy's files. Else it could be other code under the copy's name: a copy
    edited since, one cut short, or one another user put (or may swap in, once it was
    checked) where a sweep's task finds its copy, its parent's `code/`. (`code/` is made as
    private as the copy; one made before with the umask's mode is group-writable under a
    umask of 002, in a run directory no one else may enter: taken.)"""
    gid = _gid(group)
    if not digest:
        return "the run's spec records no digest to check it by"
    if store.unsafe_permissions(found, gid):
        return f"it is not yours (or the run group's) alone to write ({_mode(found)})"
    holder = found.parent.lstat()
    if (holder.st_uid != os.geteuid() and holder.st_gid != gid) or holder.st_mode & stat.S_IWOTH:
        return f"the folder holding it is not yours, or everyone may write it ({_mode(found.parent)})"
    key = (str(found.resolve()), digest)
    if key not in _COPIES and copy_digest(found) == digest:
        _COPIES.add(key)
    return "" if key in _COPIES else ("its files are not the copy submitted (edited, cut short, added "
                                      "to or linked since)")


def _mode(path: Path) -> str:
    """`path`'s mode and owner, as `ls -ld` shows them."""
    st = path.lstat()
    return f"{stat.filemode(st.st_mode)}, uid {st.st_uid}, gid {st.st_gid}"


def _gid(group: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid if group else None
    except KeyError:
        return None
