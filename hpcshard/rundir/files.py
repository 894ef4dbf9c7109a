"""Files written so that a reader never sees half of one (held while written where a
cleanup must tell a live writer's side file from an interrupted one's), and a lock that
holds on NFS (stdlib)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from hpcshard.rundir import proc

TMP_SUFFIX = ".tmp"
"""Names ending in it are never read as the real thing (files and checkpoint dirs)."""
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The errors that mean the run's storage takes no writes (full, over quota, read-only): the
run's trouble, never a node's, and no retry helps (the launchers' health check and the
ranks' failed saves judge by these)."""
UNHELD = ".unheld"
"""Before TMP_SUFFIX in the name of a side file written `held` whose flock failed: that
nobody holds it does not say that its writer is gone (`runtime.sidefiles` judges it by its
age alone)."""
CREATE_TRIES = 3
"""Side files made before one is held: a remover can take one in the instant between its
creation and its hold (then it is removed, and another name is made)."""


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def side_name(path: Path) -> Path:
    """A name beside `path` that no other writer uses at the same time: host, pid and a
    random part (two launchers of different hosts, or of containers with their own pid
    namespace, can have equal pids). Hidden, and ending in TMP_SUFFIX: never read as the
    real thing."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}."
                          f"{secrets.token_hex(4)}{TMP_SUFFIX}")


def write_atomic(path: Path, text: str, mode: int = 0o640) -> None:
    """Write a small file so that readers see the old or the new content, never a mix.
    Each writer writes its own side file and renames it over `path` (`written`): of two
    writers at once, one rename wins whole (with one fixed side name, measured: two writers
    of spec.json crashed 251 times in 600 updates and gave torn reads). The mode is set
    explicitly: a group-writable umask must not make it refusable."""
    with written(path, mode=mode) as f:
        f.write(bytes(text, "utf-8"))


@contextlib.contextmanager
def written(path: Path, *, held: bool = False, mode: int | None = None) -> Iterator[BinaryIO]:
    """A file to write `path` through, whole or not at all: a side file of this writer's
    (`side_name`), on disk and renamed over `path` when the block ends, the rename on disk
    too (the side file removed if the block raises). `mode`: set explicitly (else the
    umask's). `held`: flock'd while it is written, for a cleanup that removes the side files
    of interrupted writers and must keep a live one's (`runtime.sidefiles`); one whose
    flock fails is named UNHELD. A plain write takes no lock: a small file that nothing
    sweeps pays no call for it."""
    f, side = _create(path, held)
    try:
        yield f
        f.flush()
        if mode is not None:
            os.fchmod(f.fileno(), mode)
        os.fsync(f.fileno())  # on disk before the rename says it is complete
        os.replace(side, path)
    except BaseException:
        with contextlib.suppress(OSError):
            side.unlink()
        raise
    finally:
        f.close()  # a hold ends with it
    fsync_dir(path.parent)


def _create(path: Path, held: bool) -> tuple[BinaryIO, Path]:
    """A new side file of `path`, open (and held when `held`), and its name. One whose flock
    fails is renamed UNHELD (a remover on this host whose flock works would find it nobody's
    and remove it under its writer). One that a remover took between its creation and the
    hold or the rename (held by the remover, or already removed) is given up for another
    name."""
    for _ in range(CREATE_TRIES):
        side = side_name(path)
        f = side.open("xb")
        try:
            if not held:
                return f, side
            got = try_flock(f.fileno())
            if isinstance(got, OSError):
                unheld = side.with_name(side.name.removesuffix(TMP_SUFFIX) + UNHELD + TMP_SUFFIX)
                with contextlib.suppress(FileNotFoundError):  # a remover's meanwhile
                    side.rename(unheld)
                side = unheld
            if got is not False and same_file(side, f.fileno()):
                return f, side
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                side.unlink()
            raise
        f.close()
        with contextlib.suppress(OSError):
            side.unlink()
    raise OSError(errno.EAGAIN, f"{path.parent}: {CREATE_TRIES} temporary files were removed as they were "
                  "made (another `data prepare` clearing the directory?); run the command again")


def try_flock(fd: int) -> bool | OSError:
    """flock(LOCK_EX) without waiting: True when taken, False when another holds it, else the
    error that says no flock can be had here, never taken for "held": a file system that
    keeps none (Lustre mounted without flock, some FUSE mounts: ENOSYS, EOPNOTSUPP), NFS's
    lock daemon out of locks (ENOLCK), or any other. Whoever asked does without: a side file
    is named UNHELD, a cleanup judges by age, `data prepare` takes a lock file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EAGAIN/EWOULDBLOCK: held
        return False
    except OSError as err:
        return err
    return True


def same_file(path: Path, fd: int) -> bool:
    """Does `path` still name the open file `fd` (not removed, nor made again)?"""
    try:
        named, opened = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def create_exclusive(path: Path, text: str) -> bool:
    """Write `path` whole unless it exists (written aside, then linked: no reader sees it
    half written, and of two writers exactly one wins). False when it existed.

    The side file's name is this writer's alone (`side_name`): launchers in containers
    share pids, and one writer's side file overwritten by another's was linked or removed
    under it. On NFS a LINK whose reply was lost is sent again and then fails (EEXIST, or
    another error) although the first one made the link: the side file's link count (2:
    its own name and `path`) says who won."""
    path.parent.mkdir(exist_ok=True)
    aside = side_name(path)
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            os.link(aside, path)
        except OSError as err:
            if os.stat(aside).st_nlink == 2:
                return True  # our link was made; the error came from its retransmission
            if isinstance(err, FileExistsError):
                return False
            raise
        return True
    finally:
        aside.unlink(missing_ok=True)


LOCK_STALE_S = 30.0
"""A lock whose holder's token stayed the same this long (on the waiter's own monotonic
clock) is taken for one left by a crashed holder and broken: a holder keeps it for
milliseconds (a read-modify-write of a small file). A holder on this host that is gone
(its pid and start time) is broken at once."""


class LockLost(OSError):
    """The lock was broken while its holder still worked under it (it stood still for
    LOCK_STALE_S: a frozen node, a stalled file server): what it read may be stale, and it
    must not write."""


@contextlib.contextmanager
def locked(path: Path, timeout: float = 120.0, poll: float = 0.05) -> Iterator[Callable[[], None]]:
    """Hold PATH.lock while the block runs: a read-modify-write of `path` by several
    processes or hosts. A link() lock, as NFS recommends (an O_EXCL create is not atomic
    on NFSv2, and flock() is not kept by every NFS server): the holder's token (its process
    identity and a nonce) is linked to the lock's name; the link count of its own file says
    whether it got it. A lock left by a holder that is gone is broken: at once when it was
    of this host (`rundir.proc`), else once its token stood still for LOCK_STALE_S on this
    process's monotonic clock (no two hosts' clocks compared). The block gets a check to
    call right before it writes: LockLost when the lock was broken meanwhile (this holder
    stood still that long). TimeoutError after `timeout` seconds."""
    lock = path.with_name(path.name + ".lock")
    token = json.dumps({**(proc.identity(os.getpid()) or {}), "nonce": secrets.token_hex(8)}) + "\n"
    mine = side_name(lock)
    mine.write_text(token)
    deadline = time.monotonic() + timeout
    seen, since = "", time.monotonic()
    try:
        while True:
            with contextlib.suppress(OSError):
                os.link(mine, lock)
            if mine.stat().st_nlink == 2:
                break
            holder = _read(lock)
            if holder != seen:
                seen, since = holder, time.monotonic()
            if holder and (_gone(holder) or time.monotonic() - since > LOCK_STALE_S):
                _break(lock, holder)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{lock} is held by {_who(seen)} for over {timeout:.0f} s")
            time.sleep(poll)

        def held() -> None:
            if _read(lock) != token:
                raise LockLost(f"{lock} was broken while this process held it (it stood still "
                               f"for over {LOCK_STALE_S:.0f} s): nothing written")
        try:
            yield held
        finally:
            if _read(lock) == token:
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
    finally:
        with contextlib.suppress(FileNotFoundError):
            mine.unlink()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


def _holder(text: str) -> dict[str, Any]:
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _gone(holder: str) -> bool:
    """Is the lock's holder a process of this host that no longer runs?"""
    record = _holder(holder)
    return bool(record) and proc.here(record) and not proc.same(record)


def _who(holder: str) -> str:
    record = _holder(holder)
    return f"process {record.get('pid')} on {record.get('host')}" if record else "someone"


def _break(lock: Path, holder: str) -> None:
    """Remove a stale lock, once, whoever else breaks it at the same time: its inode is first
    linked to a name of its own that only one breaker can create (the stale holder's);
    if that inode turns out to be a fresh holder's (another breaker was faster and the lock
    was taken again), nothing is removed."""
    grave = lock.with_name(f"{lock.name}.broken.{hashlib.sha1(holder.encode()).hexdigest()[:16]}")
    try:
        os.link(lock, grave)
    except OSError:
        return  # gone already, or another breaker is on it
    try:
        if _read(grave) == holder and os.stat(lock).st_ino == os.stat(grave).st_ino:
            lock.unlink()
    except FileNotFoundError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            grave.unlink()


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
