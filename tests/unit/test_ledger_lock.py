"""The ledger cannot be stalled by a dying rank (issue 42): a rank killed inside the
ledger's lock, seen from a waiter on another host; a holder killed and not yet reaped; the
side files that killed processes left; a live holder whose lock was broken while its
record was on its way to a stalled file server."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from hpcshard.launch import coord
from hpcshard.rundir import events, files, ledger, proc
from tests.conftest import wait_for
from tests.unit.test_launch_races import HOLD, make_supervisor

pytestmark = pytest.mark.unit

RANK = """
import sys, time
from pathlib import Path
from hpcshard.rundir import files
with files.locked(Path(sys.argv[1]) / "attempts.jsonl"):  # (a rank's failure record)
    print("held", flush=True)
    time.sleep(60)
"""
AGENT = f"""
import subprocess, sys
ranks = [subprocess.Popen([sys.executable, "-c", {RANK!r}, sys.argv[1]]) for _ in range(2)]
sys.exit(max(r.wait() for r in ranks))
"""
ELSEWHERE = """
import sys, time
from pathlib import Path
from hpcshard.rundir import events, ledger, proc
proc.boot_id = lambda: "another-host"  # (no pid of the test's host means anything here)
ledger.append(Path(sys.argv[1]), events.GaveUp(attempt=0, reason="the decider's record"))
print(time.monotonic(), flush=True)
"""
LANDS_S = 5.0
"""How soon after the killing launcher's cycle ends another host's append lands: the lock
is free by then, and the waiter looks every 50 ms; the rest is room for a loaded machine
to schedule it. Before, it waited files.LOCK_STALE_S (30 s) from its first look."""


def side_files(run_dir: Path, pid: int | None = None) -> list[str]:
    """The ledger lock's side files (of process `pid`)."""
    return [p.name for p in run_dir.iterdir() if p.name.startswith(".attempts.jsonl.lock.")
            and (pid is None or f".{pid}." in p.name)]


def end(p: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def test_a_rank_killed_inside_the_ledgers_lock_holds_up_no_other_hosts_append(tmp_path: Path) -> None:
    """Ranks append their failure records the moment their launchers kill them. Another
    host's waiter (the decider, with its fault and bad-node records) cannot look a pid of
    this host up: it broke the lock only once it had stood still for LOCK_STALE_S. The
    killed ranks' side files (the holder's, and the other's, which waited) stayed in the
    run directory for good."""
    sup = make_supervisor(tmp_path, owner="", node_rank=1, nnodes=2)
    node = replace(sup.node, run_id=f"ledger-lock-{os.getpid()}")
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    elsewhere: subprocess.Popen[str] | None = None
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "held"
        wait_for(lambda: len(side_files(tmp_path)) == 2, 60, "the other rank to wait")
        elsewhere = subprocess.Popen([sys.executable, "-c", ELSEWHERE, str(tmp_path)],
                                     stdout=subprocess.PIPE, text=True)
        wait_for(lambda: side_files(tmp_path, elsewhere.pid), 60, "the other host's append to wait")
        # Node 0 declares a fault: this launcher kills its ranks, the holder with them.
        coord.Channel(tmp_path, 0).declare_fault(0, 0, {"cause": "a rank of node 0 died", "node": 0})
        sup.start = lambda node, env: agent  # type: ignore[method-assign,assignment]
        watch = sup.cycle(node, 0)
        ended = time.monotonic()
        out, _ = elsewhere.communicate(timeout=60)
    finally:
        for p in (agent, elsewhere):
            if p is not None:
                end(p)
    assert watch.fault is not None and agent.returncode == -9
    assert float(out) - ended < LANDS_S, f"landed {float(out) - ended:.1f} s after the cycle ended"
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["the decider's record"]
    assert side_files(tmp_path) == [] and not (tmp_path / "attempts.jsonl.lock").exists()


def test_a_holder_killed_and_not_yet_reaped_is_gone(tmp_path: Path) -> None:
    """A rank killed with its agent is a zombie until someone reaps it: its pid and start
    time still answer, and a waiter of its own host took it for alive (LOCK_STALE_S)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / ledger.LEDGER)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        p.kill()
        wait_for(lambda: proc.stat_fields(p.pid)[:1] == ["Z"], 30, "a zombie")
        began = time.monotonic()
        ledger.append(tmp_path, events.GaveUp(attempt=0, reason="x"))
        assert time.monotonic() - began < LANDS_S
    finally:
        end(p)


def test_the_side_files_of_killed_waiters_are_removed_and_no_live_ones(tmp_path: Path) -> None:
    """A process killed while it waited for the lock left its side file for good; the
    launcher's sweep (`files.clear_left`) removes those of this host's gone processes and
    leaves live ones (the holder's, another waiter's) and another host's alone."""
    target = tmp_path / ledger.LEDGER
    with files.locked(target):
        mine = side_files(tmp_path, os.getpid())
        waiters = [subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.DEVNULL)
                   for _ in range(2)]
        try:
            for w in waiters:
                wait_for(partial(side_files, tmp_path, w.pid), 60, "a waiter's side file")
            waiters[0].kill()
            waiters[0].wait()
            elsewhere = tmp_path / ".attempts.jsonl.lock.n9.4242.00ff.tmp"
            elsewhere.write_text('{"pid": 4242, "start": 1, "boot": "another-host", "host": "n9"}\n')
            files.clear_left(target)
            assert side_files(tmp_path, waiters[0].pid) == []
            assert side_files(tmp_path, waiters[1].pid) and side_files(tmp_path, os.getpid()) == mine
            assert elsewhere.exists() and (tmp_path / "attempts.jsonl.lock").exists()
        finally:
            for w in waiters:
                end(w)


def test_killed_ranks_still_exiting_leave_nothing_once_gone(tmp_path: Path) -> None:
    """A rank killed a moment ago may not be gone yet (it frees its memory first): the
    sweep took one that waited for the lock for alive and kept its side file for good
    (the cycle's test above failed 4 of 25 runs so), and one that took the lock from the
    killed holder meanwhile held it, dead, for LOCK_STALE_S. The launcher now gives the
    processes it killed `wait` seconds to be gone, then clears what they left."""
    target = tmp_path / ledger.LEDGER
    lock = tmp_path / "attempts.jsonl.lock"
    ranks = [subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.DEVNULL)
             for _ in range(3)]
    try:
        wait_for(lambda: lock.exists() and len(side_files(tmp_path)) == 3, 60, "one holder, two waiters")
        first = files._holder(lock.read_text())["pid"]
        looks = []

        def waiting() -> None:  # (at each look, before everything is gone: the launcher beats)
            looks.append(files._read(lock))
            if len(looks) == 1:  # the holder is killed first, the waiters once one took the lock
                ranks[[r.pid for r in ranks].index(first)].kill()
            elif files._holder(looks[-1]).get("pid") not in (None, first):
                for r in ranks:
                    r.kill()

        files.clear_left(target, [r.pid for r in ranks], wait=60, waiting=waiting)
        assert files._holder(looks[-1]).get("pid") not in (None, first)  # (the lock passed on)
        assert side_files(tmp_path) == [] and not lock.exists()
        assert [p.name for p in tmp_path.iterdir()] == []
    finally:
        for r in ranks:
            end(r)


def test_the_graves_of_a_lock_that_moved_on_are_removed(tmp_path: Path) -> None:
    """A breaker killed after it removed the lock, before its grave: the grave stayed in the
    run directory for good. The sweep removes a grave that is not the lock's inode, and
    leaves a claim on the lock as it is (a breaker at work) alone."""
    target = tmp_path / ledger.LEDGER
    left = tmp_path / "attempts.jsonl.lock.broken.0123456789abcdef"
    left.write_text('{"pid": 4242, "start": 1, "boot": "another-host", "host": "n9"}\n')
    with files.locked(target):
        claim = tmp_path / "attempts.jsonl.lock.broken.fedcba9876543210"
        os.link(tmp_path / "attempts.jsonl.lock", claim)
        files.clear_left(target)
        assert claim.exists() and not left.exists()
    claim.unlink()
    assert [p.name for p in tmp_path.iterdir()] == []


class StalledServer:
    """Ledger writes as an NFS client makes them: an O_APPEND write lands at the end the
    client saw when it opened the file (close-to-open; the server has no appends). The
    first write of the thread `stalled` is held back, as a file server that stalls under
    it would, until `go` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stalled: threading.Thread | None = None
        self.waiting, self.go = threading.Event(), threading.Event()
        self.seen: dict[int, int] = {}
        real_open, real_write, real_pwrite = os.open, os.write, os.pwrite

        def open_(path: object, flags: int, *args: object, **kw: object) -> int:
            # (the client appends, not the file: Linux's pwrite on an O_APPEND file appends)
            fd = real_open(path, flags & ~os.O_APPEND, *args, **kw)  # type: ignore[arg-type]
            if flags & os.O_APPEND:
                self.seen[fd] = os.fstat(fd).st_size
            return fd

        def write(fd: int, data: bytes) -> int:
            if fd not in self.seen:
                return real_write(fd, data)
            return pwrite(fd, data, self.seen[fd])

        def pwrite(fd: int, data: bytes, at: int) -> int:
            if threading.current_thread() is self.stalled and not self.waiting.is_set():
                self.waiting.set()
                assert self.go.wait(60)
            return real_pwrite(fd, data, at)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "pwrite", pwrite)


def test_a_holder_that_stood_still_with_its_record_on_the_way_overwrites_nobodys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suspected case: a live holder passed its check, and its write stalled (an NFS
    server hiccup) past LOCK_STALE_S. Its lock was broken, the breaker appended at the
    end, and the late write landed where the end had been, over the breaker's record. Now
    the breaker first makes room for the late record (its length is in the token)."""
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    server = StalledServer(monkeypatch)
    late = threading.Thread(target=ledger.append, args=(tmp_path, events.GaveUp(attempt=0, reason="late")))
    server.stalled = late
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="before"))
    late.start()
    assert server.waiting.wait(60)
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="the breaker's, a longer one"))
    server.go.set()
    late.join(60)
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["before", "late", "the breaker's, a longer one"]
    assert [p.name for p in tmp_path.iterdir()] == ["attempts.jsonl"]  # (no lock, no side file)


def test_a_ledger_append_cut_short_leaves_a_line_the_next_one_does_not_join(tmp_path: Path) -> None:
    """A full disk: the holder's write at the end it found is cut short and raises. What it
    wrote stays, a line readers skip; the next record starts a line of its own (glued to
    the cut one, it would be skipped with it)."""
    import resource
    import signal

    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="before " * 60))  # (longer than a token)
    size = (tmp_path / ledger.LEDGER).stat().st_size
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, old[1]))
    try:
        with pytest.raises(OSError, match="short write"):
            ledger.append(tmp_path, events.GaveUp(attempt=0, reason="cut short"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert (tmp_path / ledger.LEDGER).stat().st_size == size + 10
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="after"))
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["before " * 60, "after"]


class Late:
    """A holder's ledger append in a thread of its own, `reason` its record: `decided` is set
    once it passed its check (its write is on its way, held back until `land` is set) or
    its append ended without a write (`error` then says why)."""

    def __init__(self, run_dir: Path, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decided, self.land = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._append, args=(run_dir, reason))
        real_pwrite = os.pwrite

        def pwrite(fd: int, data: bytes, at: int) -> int:
            if threading.current_thread() is self.thread:
                self.decided.set()
                assert self.land.wait(60)
            return real_pwrite(fd, data, at)

        monkeypatch.setattr(os, "pwrite", pwrite)

    def _append(self, run_dir: Path, reason: str) -> None:
        try:
            ledger.append(run_dir, events.GaveUp(attempt=0, reason=reason))
        except BaseException as err:  # (LockLost: what the test looks at)
            self.error = err
        finally:
            self.decided.set()


def test_a_holder_that_goes_on_while_its_lock_is_broken_writes_over_nobody(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file server's stall ends for the stood-still holder and its breaker at once: the
    holder finds the file's end after the room was made and passes its check before the
    lock is removed. It wrote at the end of the room, where the next holder writes too
    (on NFS its bytes reach the server at its close, after the next holder's open): the
    breaker's record was lost. Its check now fails once its lock is being broken."""
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="before"))
    late = Late(tmp_path, "late", monkeypatch)
    opened, room = threading.Event(), threading.Event()
    real_open, real_room = os.open, files._make_room

    def open_(path: object, flags: int, *args: object, **kw: object) -> int:
        if threading.current_thread() is late.thread and str(path).endswith(ledger.LEDGER):
            opened.set()
            assert room.wait(60)  # (its open stalled until the room was made)
        return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

    def make_room(lock: Path, writes: object) -> bool:
        made = real_room(lock, writes)
        room.set()
        assert late.decided.wait(60)  # (its check, before the lock is removed)
        return made is not False

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(files, "_make_room", make_room)
    late.thread.start()
    assert opened.wait(60)
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="the breaker's"))
    late.land.set()
    late.thread.join(60)
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["before", "the breaker's"]
    assert isinstance(late.error, files.LockLost)


def test_a_breaker_that_stalls_making_room_removes_no_later_holders_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The breaker's room is a write, which the same file server stall holds up: the
    stood-still holder went on meanwhile and let go, a new holder took the lock and passed
    its check, and the breaker, going on, removed the new holder's lock: two holders wrote
    at one end. The breaker's lock is now the breaker's to remove: its holder no longer
    lets go of it."""
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    path = tmp_path / ledger.LEDGER
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="before"))
    nxt = Late(tmp_path, "the next holder's", monkeypatch)
    holds, stood, room, waits = (threading.Event() for _ in range(4))
    real_room, real_sleep = files._make_room, time.sleep
    breaker = threading.Thread(target=ledger.append,
                               args=(tmp_path, events.GaveUp(attempt=0, reason="the breaker's")))

    def stands_still() -> None:
        with files.locked(path, writes=200):
            holds.set()
            assert stood.wait(60)

    def make_room(lock: Path, writes: object) -> bool:
        made = real_room(lock, writes)
        room.set()
        wait_for(lambda: nxt.decided.is_set() or waits.is_set(), 60, "the next holder")
        return made is not False

    def sleep(s: float) -> None:
        if threading.current_thread() is nxt.thread and not waits.is_set():
            waits.set()  # (it found the lock taken: the breaker's, which goes on and appends...)
            breaker.join(60)  # (...before the next holder looks again: no race for the free lock)
        real_sleep(s)

    monkeypatch.setattr(files, "_make_room", make_room)
    monkeypatch.setattr(time, "sleep", sleep)
    holder = threading.Thread(target=stands_still)
    holder.start()
    assert holds.wait(60)
    breaker.start()
    assert room.wait(60)
    stood.set()
    holder.join(60)
    nxt.thread.start()
    breaker.join(60)
    nxt.land.set()
    nxt.thread.join(60)
    assert nxt.error is None
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["before", "the breaker's", "the next holder's"]


def test_a_lock_whose_room_cannot_be_made_is_not_broken_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that takes no room for a moment (full, over quota): the lock was broken
    anyway, and the late record landed over the breaker's. It stays until the room is
    made (the breaker tries again once the lock stood still)."""
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="before"))
    late = Late(tmp_path, "late", monkeypatch)
    real_room, refused = files._make_room, list[Path]()

    def make_room(lock: Path, writes: object) -> bool:
        if not refused:
            refused.append(lock)
            with monkeypatch.context() as m:  # (no space for this one write)
                m.setattr(os, "pwrite", partial(_refuse, errno.ENOSPC))
                return real_room(lock, writes) is not False
        return real_room(lock, writes) is not False

    monkeypatch.setattr(files, "_make_room", make_room)
    late.thread.start()
    assert late.decided.wait(60)
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="the breaker's, a longer one"))
    late.land.set()
    late.thread.join(60)
    assert refused and late.error is None
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["before", "late", "the breaker's, a longer one"]


def _refuse(code: int, *args: object) -> int:
    raise OSError(code, os.strerror(code))


def test_a_write_cut_short_is_not_taken_back_over_what_came_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder whose write was cut short (a full disk) stood still after it: its lock was
    broken, and the breaker wrote after the room. Cutting the file back to where the cut
    write began cut the breaker's record off (and a check of the file's end before the
    cut left a stall between the two). Nothing is cut now: the cut write is a line
    readers skip."""
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    path = tmp_path / ledger.LEDGER
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="before"))
    cut = threading.Thread(target=_cut_short, args=(tmp_path,))
    checks, stood, go = list[Path](), threading.Event(), threading.Event()
    real_pwrite, real_read = os.pwrite, files._read

    def pwrite(fd: int, data: bytes, at: int) -> int:
        if threading.current_thread() is cut:
            return real_pwrite(fd, data[:10], at)  # (the disk filled up under it)
        return real_pwrite(fd, data, at)

    def read(p: Path) -> str:
        text = real_read(p)
        if threading.current_thread() is cut and p.name.endswith(".lock"):
            checks.append(p)
            if len(checks) == 2:  # (its look after the cut write: it stands still)
                stood.set()
                assert go.wait(60)
        return text

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(files, "_read", read)
    cut.start()
    assert stood.wait(60)
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="the breaker's"))
    go.set()
    cut.join(60)
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["before", "the breaker's"]
    assert path.read_bytes().endswith(b"\n")


def _cut_short(run_dir: Path) -> None:
    with contextlib.suppress(OSError):  # (the short write's: what the test looks at is the file)
        ledger.append(run_dir, events.GaveUp(attempt=0, reason="cut short"))


BREAKER = """
import sys, time
from pathlib import Path
from hpcshard.rundir import files
files.LOCK_STALE_S = 0.3
real = files._make_room
def room(lock, writes):
    made = real(lock, writes)
    print("making room", flush=True)
    time.sleep(600)  # (its launcher kills it here)
files._make_room = room
with files.locked(Path(sys.argv[1])):
    pass
"""


def test_a_breaker_killed_while_it_makes_room_leaves_a_lock_that_is_broken_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks append as they fail, the moment their launchers kill them: one that broke a
    lock was killed while it made room (a write: on NFS, as long as the server stalls).
    Its claim on the break (the holder's grave) stayed, and no later waiter could break
    that lock: every append failed after its timeout, for good. The lock now says it is
    being broken, which is another holder's token: broken in turn once it stood still."""
    path = tmp_path / ledger.LEDGER
    holder = subprocess.Popen([sys.executable, "-c", HOLD_ELSEWHERE, str(path)],
                              stdout=subprocess.PIPE, text=True)
    breaker: subprocess.Popen[str] | None = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        breaker = subprocess.Popen([sys.executable, "-c", BREAKER, str(path)],
                                   stdout=subprocess.PIPE, text=True)
        assert breaker.stdout is not None and breaker.stdout.readline().strip() == "making room"
    finally:
        for p in (breaker, holder):  # (the holder's host is gone too)
            if p is not None:
                end(p)
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    _append_within(tmp_path, 30)  # (the default timeout is 120 s: this says it in 30)
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["x"]


CLAIMS = """
import os, sys, time
from pathlib import Path
from hpcshard.rundir import files
files.LOCK_STALE_S = 0.3
real = os.link
def link(src, dst, *args, **kw):
    real(src, dst, *args, **kw)
    if ".broken." in str(dst):
        print("claimed", flush=True)
        time.sleep(600)  # (killed here, the break claimed and nothing more done)
os.link = link
with files.locked(Path(sys.argv[1])):
    pass
"""


@pytest.mark.parametrize("holder", ["elsewhere", "here"])
def test_a_breaker_killed_as_soon_as_it_claimed_the_break_holds_the_lock_up_not_for_good(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str) -> None:
    """A waiter that claimed the break of a lock (its grave linked) died before it changed
    anything: its claim stayed, and no later waiter could claim the break. Every append
    failed after its timeout, for the rest of the run. A claim that stays while the lock
    stands still 2 x LOCK_STALE_S now gives way: a waiter changes the lock's content
    itself, and the new content is broken as any other. Of a holder on another host, or
    of a dead one of this host (broken with no room made)."""
    path = tmp_path / ledger.LEDGER
    hold = HOLD_ELSEWHERE if holder == "elsewhere" else HOLD_ELSEWHERE.replace("proc.boot_id = ", "# ")
    first = subprocess.Popen([sys.executable, "-c", hold, str(path)], stdout=subprocess.PIPE, text=True)
    breaker: subprocess.Popen[str] | None = None
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        if holder == "here":
            end(first)  # (dead, and reaped: a waiter of this host breaks it at once)
        breaker = subprocess.Popen([sys.executable, "-c", CLAIMS, str(path)], stdout=subprocess.PIPE,
                                   text=True)
        assert breaker.stdout is not None and breaker.stdout.readline().strip() == "claimed"
    finally:
        for p in (breaker, first):
            if p is not None:
                end(p)
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    _append_within(tmp_path, 30)  # (the default timeout is 120 s: this says it in 30)
    assert [r["reason"] for r in ledger.read(tmp_path)] == ["x"]
    assert not [p for p in tmp_path.iterdir() if ".broken." in p.name]


HOLD_ELSEWHERE = """
import sys, time
from pathlib import Path
from hpcshard.rundir import files, proc
proc.boot_id = lambda: "another-host"
with files.locked(Path(sys.argv[1]), writes=100):
    print("held", flush=True)
    time.sleep(600)
"""


def _append_within(run_dir: Path, timeout: float) -> None:
    """`ledger.append`'s record "x", with a lock timeout of `timeout` seconds."""
    path = run_dir / ledger.LEDGER
    with files.locked(path, timeout=timeout, writes=200) as held:
        files.append_held(path, json.dumps({"event": "gave_up", "attempt": 0, "reason": "x"}) + "\n", held)
