"""Files written so that a reader never sees half of one (held while written where a
cleanup must tell a live writer's side file from an interrupted one's), and a lock that
holds on NFS, `locked` (stdlib): its docstring says the lock's protocol, step by step, and
why in that order."""

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
from collections.abc import Callable, Iterable, Iterator
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
"""A lock whose content stayed the same this long (on the waiter's own monotonic clock) is
taken for one left by a holder that crashed or stands still, and broken: a holder keeps it
for milliseconds (a read-modify-write of a small file). A holder on this host that is gone
(its pid and start time) is broken at once, by a waiter of this host or by the launcher
that killed it (`clear_left`): a waiter on another host cannot look its pid up."""
BROKEN = "broken\n"
"""What a breaker appends to the token of a holder that may still run (`locked`: waiter, 2)."""


class LockLost(OSError):
    """The lock was broken while its holder still worked under it (it stood still for
    LOCK_STALE_S: a frozen node, a stalled file server): what it read may be stale, and it
    must not write."""


@contextlib.contextmanager
def locked(path: Path, timeout: float = 120.0, poll: float = 0.05,
           writes: int = 0) -> Iterator[Callable[[], None]]:
    """Hold PATH.lock while the block runs: a read-modify-write of `path`, or an append to
    it (`append_held`), by processes of several hosts. A link() lock, as NFS recommends (an
    O_EXCL create is not atomic on NFSv2, and flock() is not kept by every NFS server).
    The block gets `held`, a check to call right before it writes. TimeoutError after
    `timeout` seconds. `writes`: at most how many bytes the block appends to `path`.

    The holder:
    1. Writes its token (its process identity, a nonce, `writes`) into a side file named
       from it, and links that to PATH.lock. The side file's link count (2) says it got
       the lock, not link()'s result: on NFS a LINK whose reply was lost is sent again,
       and fails, although the first one made the link.
    2. Right before it writes, checks that the lock still holds its token unchanged
       (`held`; LockLost if not). A breaker changes it first of all (waiter, 2), so a
       holder that passed its check found the file's end before any room was made.
    3. Writes at the end it found under the lock (`append_held`), however late the write
       lands: a file server may stall it past LOCK_STALE_S, and the lock be broken.
    4. Lets go: removes the lock if it still holds its token unchanged (one whose token a
       breaker changed is the breaker's to remove), then its side file.

    A waiter breaks the lock once its holder is a process of this host that is gone (at
    once: only this host can look its pid up), or once its content stood still
    LOCK_STALE_S on the waiter's own monotonic clock (no two hosts' clocks compared):
    1. It claims the break: links the lock to a grave named from that content, a name one
       waiter only can create. The grave keeps the holder's inode whatever the lock's name
       holds later. A grave that is not the lock's inode with that content: the lock
       moved on (let go, or taken again), and is left alone.
    2. If the holder may still run (it only stood still), it appends BROKEN to its token
       through the grave. From now on the holder's check fails, and the holder no longer
       lets go: the lock is the breaker's to remove, however long step 3 takes.
    3. If the lock is still that inode, it makes `writes` bytes of room at the file's end
       (`_make_room`): a late write of the holder's (holder, 3) lands there, not where the
       next holder writes; if none comes, the room is a line readers skip. A file that
       takes no room (full): it stops here, and the lock, with its new content, is broken
       again once that stood still.
    4. It removes the lock if it is still that inode and content, then every grave of a
       lock that moved on (its own, and those of breakers that died, step 5), and the
       holder's side file.
    5. A grave that stays while the content stands still (its breaker died before step 2,
       or, on a gone holder's lock, before step 4): once the content stood still
       2 x LOCK_STALE_S, a waiter does step 2 through that grave itself. The new content
       has a grave name of its own, and is broken in turn.

    A launcher, once the ranks it killed are gone (`clear_left`), breaks a lock one of them
    held as a waiter of this host would, and removes the side files of gone processes of
    this host, and graves as in step 4 (of a breaker that died within its step 4).

    Not withstood: a process that stands still past LOCK_STALE_S between a look at the lock
    and the step it takes on it (holder 4, waiter 3 and 4: each one step after its look),
    while the lock is broken and taken again: it removes the next holder's lock, or makes
    its room inside the next holder's record."""
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
            still, gone = time.monotonic() - since, _gone(holder)
            if holder and (gone or still > LOCK_STALE_S) and \
                    _break(lock, holder, stale=not gone, stuck=still > 2 * LOCK_STALE_S):
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
    """Remove the side files of `lock` whose processes, of this host, are gone, and the
    graves of a lock that moved on (`_remove_graves`). Only this host can tell that a pid
    of its own is gone, and a process that is gone never uses its side file again;
    another host's are left alone (its own launcher removes them). A side file still
    being written reads empty, and names nobody."""
    prefix = f".{lock.name}."
    for name in os.listdir(lock.parent):
        if name.startswith(prefix) and name.endswith(TMP_SUFFIX):
            side = lock.parent / name
            if _gone(_read(side)):
                side.unlink(missing_ok=True)
    _remove_graves(lock)


def _remove_graves(lock: Path) -> None:
    """Remove the graves that are not the lock's inode: no claim on anything, as the lock
    moved on. Left by breakers that died on a lock that was then broken by another
    (waiter, 5), or after they removed it; one that is alive finds its grave gone, or the
    lock not the holder's it claimed, and does nothing more (`_holds`)."""
    prefix = f"{lock.name}.broken."
    for name in os.listdir(lock.parent):
        grave = lock.parent / name
        if name.startswith(prefix) and _inode(grave) != _inode(lock):
            grave.unlink(missing_ok=True)


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


def _break(lock: Path, holder: str, stale: bool = False, stuck: bool = False) -> bool:
    """A waiter's steps 1-5 (`locked`) on a lock whose content it read as `holder`. `stale`:
    the holder may still run (it only stood still); `stuck`: the content stood still
    2 x LOCK_STALE_S. True when the waiter may try to take the lock at once; False when it
    waits a poll: another breaker is on it (it would spin), or the room could not be
    made."""
    grave = lock.with_name(f"{lock.name}.broken.{hashlib.sha1(holder.encode()).hexdigest()[:16]}")
    try:
        os.link(lock, grave)
    except FileNotFoundError:
        return True  # gone already
    except OSError:  # another breaker is on it, or died on it (step 5)
        if stuck and _holds(grave, lock, holder):
            _spoil(grave)
        return False
    try:
        if not _holds(grave, lock, holder):
            return True  # the lock moved on
        record = _holder(holder)
        if stale and not (_spoil(grave) and _holds(grave, lock, holder, spoiled=True)
                          and _make_room(lock, record.get("writes"))):
            return False
        if _holds(grave, lock, holder, spoiled=stale):
            lock.unlink(missing_ok=True)
            _remove_graves(lock)
        side = _side_of(lock, record)
        if side is not None:
            side.unlink(missing_ok=True)
    finally:
        grave.unlink(missing_ok=True)
    return True


def _holds(grave: Path, lock: Path, holder: str, spoiled: bool = False) -> bool:
    """Is the lock still the inode `grave` names, holding `holder` (`spoiled`: with BROKEN
    after it, once or more)? A grave keeps its inode, and so its number, from being given
    to a new file (the next holder's lock); the content is looked at too, as a grave that
    was removed (`_remove_left`) keeps nothing."""
    text = _read(grave)
    if text != holder and not (spoiled and text.startswith(holder + BROKEN)):
        return False
    found = _inode(grave)
    return found is not None and found == _inode(lock)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _spoil(grave: Path) -> bool:
    """Waiter, step 2: BROKEN after the token of the holder whose inode `grave` names.
    False when it could not be written."""
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
    """Waiter, step 3: room in the locked file for what a holder whose lock is broken under
    it may still append (`writes` bytes, its token says). It writes where the file ended
    while it held the lock (`append_held`; on NFS even O_APPEND does, as the client saw the
    end: the server knows no appends), and the next holder would write there too. So the
    file is first made that much longer, ending in a newline: the late record fills the
    room (it ends in a newline of its own), or the room stays a line of NUL bytes, which
    readers skip (`read_lines`). A room made twice (two breakers, one that stood still) is
    two such lines. False when the file took no room (full, over quota, refused)."""
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
    """Append one line to `path` under its lock (`locked`, `held` its check): at the end
    the file has while the lock is held, found before the check (holder, steps 2-3). A
    file that does not end in a newline (a write cut short before it) gets one first, so
    that the line is a line of its own: one byte more than `line`, which `locked`'s
    `writes` counts. A write cut short (no space left) raises OSError and is not taken
    back: cutting the file is safe only while nothing came after the cut write, which a
    holder that stood still between its look and its cut cannot know (its breaker's room,
    the next holder's record); what it wrote is a line readers skip."""
    data = line.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        at = os.fstat(fd).st_size
        if at and os.pread(fd, 1, at - 1) != b"\n":
            data = b"\n" + data
        held()
        if os.pwrite(fd, data, at) != len(data):
            raise OSError(errno.ENOSPC, "No space left on device (a short write)")
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
    not parse (cut short by a full disk: `append_held` leaves it, and `append_line` did
    before it took such writes back; room made for a late holder that never wrote,
    `_make_room`) is skipped: the records around it are still the run's history."""
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
