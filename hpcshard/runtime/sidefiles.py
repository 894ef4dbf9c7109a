"""`data prepare`'s side files of interrupted runs: which are removed, which kept.

`data prepare` writes each file under a name of its writer's alone beside its own name
(`rundir.files.side_name`: host, pid and a random part), held with flock while it is
written, then renamed over its name (`rundir.files.written`, `held`). Host and pid alone
are shared: two array tasks in containers with their own pid namespaces on one node wrote
one temporary manifest, one task's rename failed and readers saw a short manifest.

A side file of an interrupted run is removed (`remove_stale`) when it is this host's and
nobody holds it, or when it has been untouched for STALE_SECONDS. Held, not "its pid is
alive": a pid read from a name means nothing outside its writer's pid namespace (a live
array task in a container, its pid gone or another process's in ours, was taken for
gone), while a lock is the kernel's, seen from every namespace of the host. Another host's
side file is never judged by its lock alone (a file system whose flock is per node,
Lustre's localflock or an NFS mount with local_lock, shows another node's writer as
nobody), and its age is read against the clock that stamps the folder's files (the time
of a file made there now, `stamp_now`). On NFS that is the file server's: no two hosts'
clocks are compared. On Lustre, GPFS and CephFS each client stamps its writes with its own
clock, so the writer's clock is compared with this host's there: the hour's margin makes
any skew that NTP leaves (seconds; minutes on a host whose NTP is off) harmless, a live
writer touching its file at every write. A writer whose flock fails (NFS's lockd out of locks: ENOLCK) writes
on without its hold, under a name that says so (`rundir.files.UNHELD`): nobody holding it
says nothing about it then, and it is judged by its age alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path

from hpcshard.rundir.files import TMP_SUFFIX, UNHELD, same_file, side_name, try_flock

STALE_SECONDS = 3600.0
"""A side file untouched this long (by the clock that stamps its folder's files: `stamp_now`)
whose writer cannot be seen from here (another host's, one whose writer's flock failed, or
on a file system without flock) is an interrupted run's. An hour: far above the clock skew
between hosts where each stamps its own writes (Lustre, GPFS, CephFS)."""


def side_files(folder: Path, finals: str) -> list[tuple[Path, str | None]]:
    """The side files in `folder` of the names that regex `finals` matches, with the host of
    each (`side_name`'s .NAME.HOST.PID.RANDOM.tmp; a host name may hold dots), None for one
    marked UNHELD (its writer's flock failed: judged by its age alone)."""
    pattern = re.compile(rf"\.(?:{finals})\.(?P<host>.+)\.\d+\.[0-9a-f]+(?P<unheld>{re.escape(UNHELD)})?"
                         rf"{re.escape(TMP_SUFFIX)}")
    found: list[tuple[Path, str | None]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            match = pattern.fullmatch(entry.name)
            if match:
                found.append((Path(entry.path), None if match["unheld"] else match["host"]))
    return found


def remove_stale(candidates: Iterable[tuple[Path, str | None]]) -> list[Path]:
    """Remove the side files of interrupted runs among `candidates` ((path, its writer's host,
    or None when unknown: judged by its age only)); the paths removed. One that is held is
    kept; one nobody holds is removed at once when it is this host's, else once untouched
    for STALE_SECONDS (`_old`)."""
    here, removed = socket.gethostname(), []
    clocks: dict[Path, float | None] = {}
    for path, host in candidates:
        try:
            fd = os.open(path, os.O_RDWR)  # read-write: NFS takes a flock as a write lock
        except OSError:
            continue  # renamed whole meanwhile, or not this user's to open
        try:
            got = try_flock(fd)
            if got is False:
                continue  # its writer is at work
            stale = (got is True and host == here) or _old(fd, path.parent, clocks)
            if stale and same_file(path, fd):
                path.unlink()
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _old(fd: int, folder: Path, clocks: dict[Path, float | None]) -> bool:
    """Has the open file `fd` been untouched for STALE_SECONDS by the clock that stamps
    `folder`'s files (read once per folder into `clocks`)?"""
    if folder not in clocks:
        clocks[folder] = stamp_now(folder)
    now = clocks[folder]
    return now is not None and now - os.fstat(fd).st_mtime > STALE_SECONDS


def stamp_now(folder: Path) -> float | None:
    """Now by the clock that stamps `folder`'s files: the mtime of a byte written to a file
    made there. On NFS the file server's clock (an age read against it does not depend on
    this host's clock agreeing with the server's); on Lustre, GPFS and CephFS this host's
    own, as each client stamps its writes. None when no file can be made there."""
    probe = side_name(folder / "clock")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        os.write(fd, b"\0")  # a write: its mtime is stamped as every other file's there
        return os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            probe.unlink()
