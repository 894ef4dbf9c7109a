"""Small files written so that a reader never sees half of one, and a lock that holds on
NFS (stdlib)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hpcshard.rundir import proc

TMP_SUFFIX = ".tmp"
"""Names ending in it are never read as the real thing (files and checkpoint dirs)."""
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The errors that mean the run's storage takes no writes (full, over quota, read-only): the
run's trouble, never a node's, and no retry helps (the launchers' health check and the
ranks' failed saves judge by these)."""


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
    Each writer writes its own side file and renames it over `path`: of two writers at
    once, one rename wins whole (with one fixed side name, measured: two writers of
    spec.json crashed 251 times in 600 updates and gave torn reads). The mode is set
    explicitly: a group-writable umask must not make it refusable."""
    tmp = side_name(path)
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


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
(its pid and start time) is broken at once, by a waiter of this host or by the launcher
that killed it (`clear_left`): a waiter on another host cannot look its pid up."""


BROKEN = "broken\n"
"""What a breaker appends to a live holder's token before it makes room (`_spoil`)."""


class LockLost(OSError):
    """The lock was broken while its holder still worked under it (it stood still for
    LOCK_STALE_S: a frozen node, a stalled file server): what it read may be stale, and it
    must not write."""


@contextlib.contextmanager
def locked(path: Path, timeout: float = 120.0, poll: float = 0.05,
           writes: int = 0) -> Iterator[Callable[[], None]]:
    """Hold PATH.lock while the block runs: a read-modify-write of `path` by several
    processes or hosts. A link() lock, as NFS recommends (an O_EXCL create is not atomic
    on NFSv2, and flock() is not kept by every NFS server): the holder's token (its process
    identity and a nonce) is linked to the lock's name; the link count of its own file says
    whether it got it. A lock left by a holder that is gone is broken: at once when it was
    of this host (`rundir.proc`), else once its token stood still for LOCK_STALE_S on this
    process's monotonic clock (no two hosts' clocks compared). The block gets a check to
    call right before it writes: LockLost when the lock was broken meanwhile (this holder
    stood still that long). TimeoutError after `timeout` seconds.

    `writes`: at most how many bytes the block appends to `path` (`append_held`), said in
    the token. A holder that stood still past LOCK_STALE_S after its check (a file server
    that stalled under its write) may still write them once its lock is broken; whoever
    breaks it makes that much room first (`_make_room`)."""
    lock = path.with_name(path.name + ".lock")
    me = {**(proc.identity(os.getpid()) or {"host": socket.gethostname(), "pid": os.getpid()}),
          "nonce": secrets.token_hex(8)}
    token = json.dumps({**me, **({"writes": writes} if writes else {})}) + "\n"
    mine = _side_of(lock, me) or side_name(lock)  # (named by its token: its breaker removes it)
    mine.write_text(token)
    deadline = time.monotonic() + timeout
    seen, since = "", time.monotonic()
    try:
        while True:
            with contextlib.suppress(OSError):
                os.link(mine, lock)
            if _links(mine, token) == 2:
                break
            holder = _read(lock)
            if holder != seen:
                seen, since = holder, time.monotonic()
            gone = bool(holder) and _gone(holder)
            if holder and (gone or time.monotonic() - since > LOCK_STALE_S) and \
                    _break(lock, holder, stale=not gone):
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


def clear_left(path: Path, killed: Iterable[int] = (), wait: float = 0.0,
               waiting: Callable[[], None] = lambda: None, poll: float = 0.05) -> None:
    """What the processes `killed` (pids of this host: a launcher's ranks, and what ran
    below them) and any other gone process of this host left of PATH.lock: a lock one of
    them held, broken as a waiter of this host would break it, and their side files
    (killed while they held the lock, or waited for it). For the launcher that killed
    its ranks: they append to the ledger the moment they fail, which is when they are
    killed, and a waiter on another host cannot look their pids up (it would wait
    LOCK_STALE_S). Each is first given up to `wait` seconds to be gone: killed a moment
    ago, a process may take seconds to free its memory, and until it is gone it may
    still take the lock, or hold on to its side file. One still there after that is left
    to the rules of `locked`, and its side file to the next sweep. `waiting` is called at
    each look meanwhile (the launcher's heartbeat)."""
    lock = path.with_name(path.name + ".lock")
    dying = [found for found in map(proc.identity, killed) if found is not None]
    deadline = time.monotonic() + wait
    while any(proc.running(p) for p in dying) and time.monotonic() < deadline:
        waiting()
        time.sleep(poll)
    holder = _read(lock)
    if _gone(holder):
        _break(lock, holder)
    _remove_left(lock)


def _remove_left(lock: Path) -> None:
    """Remove the side files of `lock` whose processes, of this host, are gone. Only this
    host can tell that a pid of its own is gone, and a process that is gone never uses its
    side file again; another host's are left alone (its own launcher removes them). A
    side file still being written reads empty, and names nobody."""
    prefix = f".{lock.name}."
    for name in os.listdir(lock.parent):
        if name.startswith(prefix) and name.endswith(TMP_SUFFIX):
            side = lock.parent / name
            if _gone(_read(side)):
                side.unlink(missing_ok=True)


def _side_of(lock: Path, record: dict[str, Any]) -> Path | None:
    """The side file of the holder a token names (by its host, pid and nonce), as
    `side_name` would name it: what its breaker removes with the lock. None for a token
    that names none (one of an older version)."""
    host, pid, nonce = record.get("host"), record.get("pid"), record.get("nonce")
    if not (isinstance(host, str) and isinstance(pid, int) and isinstance(nonce, str)):
        return None
    try:
        return lock.with_name(f".{lock.name}.{host}.{pid}.{nonce}{TMP_SUFFIX}")
    except ValueError:  # (a name with a slash in it)
        return None


def _links(mine: Path, token: str) -> int:
    """How many names this waiter's side file has: 2 when it is the lock too. A breaker
    that took it for a stale holder (it had just linked it, then stood still) removed it:
    written again, and the lock is not this waiter's."""
    try:
        return mine.stat().st_nlink
    except FileNotFoundError:
        mine.write_text(token)
        return 1


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


def _holder(text: str) -> dict[str, Any]:
    """The holder a token names (its first line: a broken lock's has BROKEN after it)."""
    try:
        found = json.loads(text.partition("\n")[0])
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _gone(holder: str) -> bool:
    """Is the lock's holder a process of this host that no longer runs? One that exited
    and awaits its parent (a zombie) is gone too: a rank killed with its agent may stay one
    until someone reaps it."""
    record = _holder(holder)
    return bool(record) and proc.here(record) and not proc.running(record)


def _who(holder: str) -> str:
    record = _holder(holder)
    return f"process {record.get('pid')} on {record.get('host')}" if record else "someone"


def _break(lock: Path, holder: str, stale: bool = False) -> bool:
    """Remove a stale lock, once, whoever else breaks it at the same time: its inode is first
    linked to a name of its own that only one breaker can create (the stale holder's);
    if that inode turns out to be a fresh holder's (another breaker was faster and the lock
    was taken again), nothing is removed. The holder's side file goes with it: nobody else
    would ever remove it. `stale`: the holder may still run (it only stood still), so its
    lock is first marked broken (`_spoil`), and what it may still append gets its room in
    the file before anyone can take the lock.
    False when another breaker is on it (the waiter then waits a poll: it would spin), or
    when the room could not be made (the lock stays, and is tried again once it stood
    still: the late record would land over the next holder's)."""
    grave = lock.with_name(f"{lock.name}.broken.{hashlib.sha1(holder.encode()).hexdigest()[:16]}")
    try:
        os.link(lock, grave)
    except FileNotFoundError:
        return True  # gone already: the waiter tries to take it at once
    except OSError:
        return False  # another breaker is on it
    try:
        ino = os.stat(grave).st_ino
        if _read(grave) == holder and os.stat(lock).st_ino == ino:
            record = _holder(holder)
            if stale and not (_spoil(grave) and _make_room(lock, record.get("writes"))):
                return False
            if os.stat(lock).st_ino == ino:  # (its holder can no longer let go of it: see _spoil)
                lock.unlink()
            side = _side_of(lock, record)
            if side is not None:
                side.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            grave.unlink()
    return True


def _spoil(grave: Path) -> bool:
    """Say in a live holder's token that its lock is broken (BROKEN after it, through the
    breaker's own name for its inode), before room is made for it: from then on its check
    fails, so a holder that passed its check found the file's end before the room was
    made (`append_held`), and it no longer lets go of the lock (its token is not there),
    which stays the breaker's to remove however long the room takes (a file server that
    stalls the breaker too). False when the token could not be written."""
    try:
        fd = os.open(grave, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, BROKEN.encode())
        finally:
            os.close(fd)  # (NFS reports a write it could not flush here)
    except OSError:
        return False
    return True


def _make_room(lock: Path, writes: object) -> bool:
    """Room in the locked file for what a holder whose lock is broken under it may still
    append (`writes` bytes, its token says): it writes where the file ended while it held
    the lock (`append_held`; on NFS even O_APPEND does, as the client saw the end: the
    server knows no appends), and the next holder would write there too. So the file is
    first made that much longer, ending in a newline: the late record fills the room (it
    ends in a newline of its own), or the room stays a line of NUL bytes, which readers
    skip (`read_lines`). False when the file took no room (full, over quota, refused):
    the late record would land where the next holder writes."""
    if not isinstance(writes, int) or writes <= 0:
        return True
    try:
        fd = os.open(lock.with_name(lock.name.removesuffix(".lock")), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, b"\n", os.fstat(fd).st_size + writes - 1)
        finally:
            os.close(fd)  # (NFS reports a write it could not flush here)
    except OSError:
        return False
    return True


def append_held(path: Path, line: str, held: Callable[[], None]) -> None:
    """Append one line to `path` under its lock (`locked`, with `held` its check): at the
    end the file has while the lock is held, found before the check. A holder that stands
    still after its check writes there however late, into the room its breaker made
    (`_make_room`), never over what others wrote since. A write cut short (no space left)
    is taken back while the lock is still this holder's and nothing came after it (a
    holder that stood still between its check and the take-back: its breaker's room, and
    what the next holder wrote after it, are not its to cut), and the OSError is raised."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        at = os.fstat(fd).st_size
        held()
        written = os.pwrite(fd, data, at)
        if written != len(data):
            with contextlib.suppress(LockLost):
                held()
                if os.fstat(fd).st_size == at + written:
                    os.ftruncate(fd, at)
            raise OSError(28, "No space left on device (a short write)")
    finally:
        os.close(fd)


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
    not parse (cut short by a full disk, before `append_line` took such writes back; room
    made for a late holder that never wrote, `_make_room`) is skipped: the records around
    it are still the run's history."""
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
