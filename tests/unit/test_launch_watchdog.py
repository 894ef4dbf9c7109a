"""The watchdog's judgement, on boards written by hand: learned step limits, the warm-up and
the slow phases that are never a hang, and which rank it names."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcshard.launch.procs import ranks_below
from hpcshard.launch.watchdog import STARVED_CAP, Limits, Watchdog, started
from hpcshard.rundir.proc import clock
from hpcshard.rundir.progress import _SLOT, Board, Slot, board_path, boards
from tests.conftest import sleeping, wait_for

LIMITS = Limits(factor=3.0, floor_s=5.0, warmup_steps=3, phase_s=100.0)


def NO_WAIT(pid: int) -> float:  # noqa: N802 (a constant: no rank ever waits for a CPU)
    return 0.0


def slot(rank: int, step: int, phase: str, since: float, pid: int = 0) -> Slot:
    return Slot(local_rank=rank, pid=pid or os.getpid(), rank=rank, step=step, phase=phase, since=since)


def trained(dog: Watchdog, steps: int, seconds: float, ranks: int = 2) -> float:
    """Feed `steps` steps of `seconds` each to the watchdog; returns the time reached."""
    t = 1000.0
    for step in range(steps):
        assert dog.look([slot(r, step, "step", t) for r in range(ranks)], t + 0.01) is None
        t += seconds
    return t


def test_the_step_limit_is_learned_after_the_warm_up() -> None:
    dog = Watchdog(LIMITS, waited=NO_WAIT)
    trained(dog, 3, 4.0)
    assert dog.step_limit() is None  # 2 samples: still warming up
    trained(dog, 5, 4.0)
    assert dog.step_limit() == 12.0  # 3 x the median step
    fast = Watchdog(LIMITS, waited=NO_WAIT)
    trained(fast, 10, 0.1)
    assert fast.step_limit() == 5.0  # never below the floor


def test_a_rank_that_overruns_its_step_is_hung_and_named() -> None:
    dog = Watchdog(LIMITS, waited=NO_WAIT)
    t = trained(dog, 10, 1.0)
    slots = [slot(0, 10, "step", t), slot(1, 9, "step", t - 1.0)]
    assert dog.look(slots, t + 4.0) is None
    hang = dog.look(slots, t + 5.5)
    assert hang is not None and hang["rank"] == 1 and "phase step" in hang["cause"]
    assert "limit 5.0 s" in hang["cause"]


def test_slow_saves_evaluations_and_warm_up_steps_are_not_hangs() -> None:
    dog = Watchdog(LIMITS, waited=NO_WAIT)
    t = trained(dog, 10, 1.0)
    for phase in ("save", "eval", "load", "setup"):
        assert dog.look([slot(0, 10, phase, t)], t + 99.0) is None  # 20x a step: fine
        assert dog.look([slot(0, 10, phase, t)], t + 101.0) is not None
    cold = Watchdog(LIMITS, waited=NO_WAIT)
    assert cold.look([slot(0, 0, "step", 0.0)], 99.0) is None  # a first step may compile


def test_done_ranks_are_never_hung() -> None:
    assert Watchdog(LIMITS, waited=NO_WAIT).look([slot(0, 3, "done", 0.0)], 10_000.0) is None


def test_steps_faster_than_a_look_still_teach_the_step_time() -> None:
    dog = Watchdog(LIMITS, waited=NO_WAIT)
    for look in range(6):  # every look sees 5 more steps of 0.04 s
        t = 1000.0 + look * 0.2
        dog.look([slot(0, 5 * look, "step", t)], t + 0.01)
    assert dog.step_limit() == 5.0 and abs(dog.samples[-1] - 0.2 / 5) < 1e-9


def test_a_hang_is_declared_by_its_limit_at_the_latest() -> None:
    """Looked at every 0.2 s: a rank that would pass its 5 s limit before the next look is
    declared at this one (after 4.85 s), not a look late (5.05 s)."""
    dog = Watchdog(LIMITS, poll_s=0.2, waited=NO_WAIT)
    t = trained(dog, 10, 0.1)
    stuck = [slot(0, 10, "step", t), slot(1, 11, "step", t)]
    assert dog.look(stuck, t + 4.75) is None
    hung = dog.look(stuck, t + 4.85)
    assert hung is not None and hung["limit"] == 5.0


def test_a_rank_stuck_joining_the_process_group_is_hung_after_the_join_limit() -> None:
    """Joining (init_process_group) gets watchdog_join_s, not the 30 min of other phases: a
    rank stuck connecting to the store once cost a test 240 s; its peers wait for it in
    the same phase, and the one furthest behind on the board is named."""
    dog = Watchdog(Limits(phase_s=1800.0, join_s=120.0), waited=NO_WAIT)
    joining = [slot(0, 0, "join", 1000.0), slot(1, 0, "join", 1000.5)]
    assert dog.look(joining, 1119.0) is None
    hung = dog.look(joining, 1121.0)
    assert hung is not None and hung["phase"] == "join" and hung["limit"] == 120.0
    assert dog.look([slot(0, 0, "setup", 1000.0)], 1121.0) is None  # setup: phase_s
    assert Limits.from_config({"watchdog_join_s": 30}).join_s == 30.0


def test_a_board_left_by_a_killed_launcher_does_not_name_a_reused_pid() -> None:
    """pids wrap (32768 by default): a board of a SIGKILLed launcher stays in /dev/shm, and
    its slot's pid may belong to a new process by now. ranks_below counts only slots written
    since their process started (one stale slot once made a test throttle the wrong rank)."""
    stale = board_path(f"unit-stale-{uuid.uuid4().hex}", 0)
    live = board_path(f"unit-live-{uuid.uuid4().hex}", 0)
    boards = [Board.create(stale, 1), Board.create(live, 1)]
    try:
        boards[0].publish(0, rank=0, step=7, phase="step")
        with boards[0].path.open("r+b") as f:  # as written by an old process of this pid
            f.seek(_SLOT.size - 8)
            f.write(struct.pack("d", started(os.getpid()) - 3600.0))
        boards[1].publish(0, rank=5, step=1, phase="step")
        # other xdist workers' launchers are below the same parent: count this pid only
        assert ranks_below([os.getppid()]).count(os.getpid()) == 1
        assert started(os.getpid()) <= clock()
    finally:
        for board in boards:
            board.close(remove=True)


@pytest.fixture
def board() -> Iterator[Board]:
    """A 2-slot board of this process, as a launcher creates it."""
    made = Board.create(board_path(f"unit-{uuid.uuid4().hex}", 0), 2)
    yield made
    made.close(remove=True)


def test_a_wall_clock_step_is_no_hang_and_a_real_overrun_is_one(
        board: Board, monkeypatch: pytest.MonkeyPatch) -> None:
    """The board's times and the watchdog's are on the boot clock: the wall clock stepping
    30 s forward (NTP, an admin's `date`) while a rank joins (limit 20 s here) is no hang;
    the same rank still joining 20 s later on the boot clock is one."""
    dog = Watchdog(Limits(join_s=20.0), poll_s=0.2, waited=NO_WAIT)
    board.publish(0, rank=0, step=0, phase="join")
    board.publish(1, rank=1, step=0, phase="join")
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall + 30.0)
    assert dog.look(board.read()) is None  # as the launcher calls it: now
    hang = dog.look(board.read(), clock() + 20.0)
    assert hang is not None and hang["phase"] == "join" and hang["limit"] == 20.0


def test_a_real_overrun_on_the_boot_clock_is_seen_as_it_happens(board: Board) -> None:
    dog = Watchdog(Limits(join_s=0.3), waited=NO_WAIT)
    board.publish(0, rank=0, step=0, phase="join")
    assert dog.look(board.read()) is None
    time.sleep(0.4)
    assert dog.look(board.read()) is not None


def test_a_symlink_planted_at_a_boards_path_is_not_followed(tmp_path: Path) -> None:
    """/dev/shm is everyone's: a board's name is not guessable (a random token), and one
    planted at it anyway (a symlink to a file of the user's) is neither followed nor taken:
    creation fails and the file it points to is untouched."""
    assert board_path("run", 0) != board_path("run", 0)
    precious = tmp_path / "precious"
    precious.write_text("the user's own file")
    path = board_path(f"unit-{uuid.uuid4().hex}", 0)
    path.symlink_to(precious)
    try:
        with pytest.raises(FileExistsError):
            Board.create(path, 2)
        with pytest.raises(OSError):  # a rank told to use it refuses it too (O_NOFOLLOW)
            Board(path, 2)
    finally:
        path.unlink()
    assert precious.read_text() == "the user's own file"


def test_a_new_board_is_the_users_alone(board: Board) -> None:
    st = board.path.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_board_another_user_owns_or_others_may_write_is_ignored(board: Board) -> None:
    """Whoever can write a board chooses which pids its reader kills (ranks_below): one
    that another user owns, or that its group may write, is neither read nor joined."""
    board.publish(0, rank=4242, step=1, phase="step")
    seen = lambda: any(s.rank == 4242 for b in boards() for s in b)  # noqa: E731
    assert seen()
    board.path.chmod(0o660)
    assert not seen()
    board.path.chmod(0o600)
    os.chown(board.path, 65534, 65534)
    assert not seen()
    with pytest.raises(PermissionError, match="not this user's own"):
        Board(board.path, 2)


def test_a_launcher_never_reads_a_slot_half_written_by_its_rank(tmp_path: Path) -> None:
    """A rank publishes while its launcher reads, in another process. A slot is never seen
    with its pid but without its phase start: `struct.pack_into` zero-filled the slot, then
    wrote field after field, and a launcher reading between them saw a phase begun at boot
    (a rank declared hung "for 29301 s" while it stepped, under the whole suite's load)."""
    import multiprocessing

    path = board_path(f"unit-{uuid.uuid4().hex}", 0)
    board = Board.create(path, 1)
    board.publish(0, rank=0, step=0, phase="step")
    stop = multiprocessing.Event()

    def publisher() -> None:
        mine = Board(path)
        step = 0
        while not stop.is_set():
            step += 1
            mine.publish(0, rank=0, step=step, phase="step")

    writer = multiprocessing.get_context("fork").Process(target=publisher)
    writer.start()
    try:
        torn = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            pid, _, _, _, since = _SLOT.unpack_from(board._map, 0)
            torn += pid != 0 and since == 0
        assert torn == 0
        assert all(s.since > 0 for s in board.read())
    finally:
        stop.set()
        writer.join(10)
        board.close(remove=True)



def test_a_rank_starved_of_cpu_and_its_peers_in_the_step_are_not_hung_until_it_ran_its_limit() -> None:
    """Three tests' ranks on two cores (a CI machine), data loader workers or a co-located
    process: a rank ready to run that waits for a CPU makes no progress, but is not hung,
    nor are the ranks of its node asleep in the step's collective waiting for it. The time
    it waited in the run queue since its step was first seen is not counted against any of
    them; once it has run for its limit, it is named (running, its peers asleep)."""
    queue = {1: 100.0, 2: 100.0}  # pid -> its run-queue wait so far (seconds)
    dog = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(dog, 10, 1.0)
    starved, peer = slot(0, 10, "step", t, pid=1), slot(1, 10, "step", t, pid=2)
    assert dog.look([starved, peer], t + 0.5) is None  # (the step's first look)
    queue[1] += 4.0  # rank 0 waited 4 of the next 7 s for a CPU; rank 1 slept
    assert dog.look([starved, peer], t + 7.0) is None
    assert dog.look([starved, peer], t + 8.9) is None  # 8.9 s in its step, 4 of them starved
    hang = dog.look([starved, peer], t + 9.5)  # it ran 5.5 s of its step: over the limit
    assert hang is not None and hang["starved_s"] == 4.0
    assert sorted(s["rank"] for s in hang["suspects"]) == [0, 1]
    assert "(limit 5.0 s; 4.0 s of it a wait for a CPU)" in hang["cause"]


def test_a_hung_rank_beside_no_starved_one_is_found_at_its_limit_and_any_rank_at_the_cap() -> None:
    queue = {1: 0.0, 2: 0.0}
    dog = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(dog, 10, 1.0)
    asleep, behind = slot(0, 10, "step", t, pid=1), slot(1, 9, "step", t - 0.5, pid=2)
    assert dog.look([asleep, behind], t + 0.1) is None
    queue[1] = 3.0  # rank 0 waited for a CPU in step 10; rank 1, a step behind, did not
    hang = dog.look([asleep, behind], t + 5.0)
    assert hang is not None and hang["rank"] == 1 and hang["starved_s"] == 0.0
    assert "a wait for a CPU" not in hang["cause"]
    # A rank spinning on oversubscribed cores waits for a CPU as a starved one does: it is
    # declared at STARVED_CAP times its limit however long it waited.
    spin = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(spin, 10, 1.0)
    assert spin.look([slot(0, 10, "step", t, pid=2)], t) is None
    queue[2] += 19.0
    assert spin.look([slot(0, 10, "step", t, pid=2)], t + 19.9) is None
    queue[2] += 1.0
    hang = spin.look([slot(0, 10, "step", t, pid=2)], t + 20.1)
    assert hang is not None and hang["starved_s"] == 20.0 and STARVED_CAP * 5.0 == 20.0


def test_a_new_phase_or_a_new_process_counts_its_own_wait() -> None:
    queue = {1: 0.0, 3: 7.0}
    dog = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(dog, 10, 1.0)
    assert dog.look([slot(0, 10, "step", t, pid=1)], t + 0.1) is None
    queue[1] = 50.0  # a long starvation during step 10...
    assert dog.look([slot(0, 11, "step", t + 60.0, pid=1)], t + 60.1) is None
    queue[1] = 53.0  # ...is not carried into step 11, which counts from its own first look
    assert dog.look([slot(0, 11, "step", t + 60.0, pid=1)], t + 67.9) is None
    hang = dog.look([slot(0, 11, "step", t + 60.0, pid=1)], t + 68.5)
    assert hang is not None and hang["starved_s"] == 3.0
    # The rank's slot taken by a new process (its pid's count is its own): counted from it
    assert dog.look([slot(0, 11, "step", t + 60.0, pid=3)], t + 68.6) is not None


def ran(pid: int) -> float:
    """Seconds the process has run on a CPU (/proc/PID/schedstat's first field, in ns)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def test_a_process_run_queue_wait_is_read_from_the_kernel() -> None:
    """Two busy processes pinned to one core: while one runs, the other waits for it. Once
    each has run 0.5 s on that core, each has waited (the other ran while it was ready),
    and no wait is longer than the process has lived. (Read once each had run, not 1.5 s
    after their start: on a loaded machine their start alone can take that long.)"""
    from hpcshard.rundir.proc import runqueue_wait

    if not Path(f"/proc/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no /proc/PID/schedstat")
    core = min(os.sched_getaffinity(0))
    busy = f"import os\nos.sched_setaffinity(0, {{{core}}})\nprint(flush=True)\nwhile True: pass\n"
    began = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in procs:  # (each pinned: from here on they share one core)
            assert p.stdout is not None and p.stdout.readline() == b"\n"
        pinned = [ran(p.pid) for p in procs]
        wait_for(lambda: all(ran(p.pid) - at > 0.5 for p, at in zip(procs, pinned, strict=True)),
                 120, "each to run 0.5 s on the shared core")
        waits = [runqueue_wait(p.pid) for p in procs]
        lived = time.monotonic() - began
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(0.1 < w < lived for w in waits), (waits, lived)
    assert runqueue_wait(2**22 + 1) == 0.0  # no such pid


@pytest.fixture
def asleep() -> Iterator[list[int]]:
    """Two pids of sleeping processes (state S: ranks asleep in a collective), once both
    sleep: a `sleep` just started is running (R) until it has exec'd and reached its sleep,
    and the watchdog names a running rank before a sleeping one. Under load one of the two
    was still R at the look (measured here at a load of 5: 56 of 200 fresh pairs had one
    not yet asleep), and that one was named, whatever its wait for a CPU."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        wait_for(lambda: all(sleeping(p.pid) for p in procs), 60, "both to sleep")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_peer_a_step_ahead_shares_the_credit_and_the_running_starved_rank_is_named(
        asleep: list[int]) -> None:
    """Rank 1 left step 10's last collective and sleeps in step 11's, waiting for rank 0,
    starved before it could leave step 10; and with both past their limits the one still
    running is named, not its sleeping peer."""
    me, peer = os.getpid(), asleep[0]  # (this process is running when it reads its own state)
    queue = {me: 0.0, peer: 0.0}
    dog = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(dog, 10, 1.0)
    starved, ahead = slot(0, 10, "step", t + 0.5, pid=me), slot(1, 11, "step", t + 0.8, pid=peer)
    assert dog.look([starved, ahead], t + 0.9) is None
    queue[me] = 4.0
    assert dog.look([starved, ahead], t + 6.0) is None  # 5.2 s in step 11, 4 s of them rank 0's wait
    hang = dog.look([starved, ahead], t + 9.9)  # rank 1 overdue; rank 0 past its limit too
    assert hang is not None and hang["rank"] == 0 and hang["state"] == "R"
    assert sorted(s["rank"] for s in hang["suspects"]) == [0, 1]


def test_of_two_asleep_past_the_limit_the_one_that_waited_least_for_a_cpu_is_named(
        asleep: list[int]) -> None:
    queue = {asleep[0]: 0.0, asleep[1]: 0.0}
    dog = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(dog, 10, 1.0)
    ranks = [slot(0, 10, "step", t, pid=asleep[0]), slot(1, 10, "step", t, pid=asleep[1])]
    assert dog.look(ranks, t + 0.1) is None
    queue[asleep[0]] = 3.0  # rank 0 was starved early in the step, then slept in its collective
    assert dog.look(ranks, t + 7.9) is None
    hang = dog.look(ranks, t + 8.1)  # rank 1, asleep all along, is the one that hangs
    assert hang is not None and hang["rank"] == 1 and hang["starved_s"] == 3.0


def test_a_phases_outer_limit_is_never_stretched_by_a_wait_for_a_cpu() -> None:
    queue = {1: 0.0}
    dog = Watchdog(LIMITS, waited=lambda pid: queue.get(pid, 0.0))
    t = trained(dog, 10, 1.0)
    assert dog.look([slot(0, 10, "save", t, pid=1)], t) is None
    queue[1] = 90.0
    assert dog.look([slot(0, 10, "save", t, pid=1)], t + 99.0) is None
    assert dog.look([slot(0, 10, "save", t, pid=1)], t + 100.5) is not None  # phase_s: 100 s
