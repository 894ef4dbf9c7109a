"""Storage errors that may pass are waited for, and every read on the fault path is bounded,
without processes: one launcher's recovery on a run directory whose write probe fails for a
while, for good, or hangs; and its reads of a run directory that hangs.

Before (issue 42's review): any error of the probe that lasted its three tries (about 2 s)
stopped the run for good (exit 74, the job FAILED, never requeued): an EIO for 2.5 s while
a file server failed over ended a run that restarted before. And right after the bounded
probe, the listing of the checkpoints, the ledger and the flight records were read with no
bound and no heartbeat: a hung mount held the fault path, its launcher silent."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import health, supervise
from hpcshard.launch.policy import Action, Decision
from hpcshard.launch.supervise import Watch
from hpcshard.rundir import files, launchers, lease, ledger, store
from hpcshard.rundir.rankenv import STORAGE_EXIT
from tests.unit.test_launch_races import make_supervisor

pytestmark = pytest.mark.unit

HUNG = "hung"
"""In a probe's script: this probe hangs until a later one lands (a hard NFS mount)."""


def one_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_s: float = 30.0) -> tuple[Any, Path]:
    """A 1-node job's launcher (its own decider), coordinated through the files; the waits
    for the storage shortened (the pauses between probes, a hung probe's bound, the wait's
    own bound: `wait_s`), none of them a sleep of the test's."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=0, nnodes=1)
    (run / launchers.LAUNCH).mkdir()
    monkeypatch.setattr(health, "PAUSE_S", 0.01)
    monkeypatch.setattr(health, "PAUSE_MAX_S", 0.05)
    monkeypatch.setattr(health, "PROBE_WAIT_S", 0.5)
    monkeypatch.setattr(health, "STORAGE_WAIT_S", wait_s)
    monkeypatch.setattr(health.time, "sleep", lambda s: None)  # (the probe's second between tries)
    return sup, run


def scripted_probe(monkeypatch: pytest.MonkeyPatch, script: list[Any]) -> list[Any]:
    """The write probe answers `script` in turn (an errno, HUNG, or None: the write lands),
    then lands for good; what each probe answered, in order."""
    real, comes_back = health._probe, threading.Event()
    answered: list[Any] = []

    def probe(run_dir: Path) -> OSError | None:
        said = script[len(answered)] if len(answered) < len(script) else None
        answered.append(said)
        if said == HUNG:
            comes_back.wait(30)
            return None
        if said is None:
            comes_back.set()  # (the hung ones answer too, late: their threads end)
            return real(run_dir)
        return OSError(said, os.strerror(said))

    monkeypatch.setattr(health, "_probe", probe)
    return answered


E = errno
# (name, what the probes answer in turn (then a write lands), the decision, its code, words in
# its reason, how many probes it took)
RECOVERIES = [
    ("an EIO for 2.5 s (3 tries, then 2 probes of the wait) restarts", [E.EIO] * 5, Action.RESTART, 0,
     "restart 1 of 3", 6),
    ("an EACCES until the ticket is renewed restarts", [E.EACCES] * 4, Action.RESTART, 0,
     "restart 1 of 3", 5),
    ("an ESTALE, then a hung mount, then it answers: restarts", [E.ESTALE] * 3 + [HUNG], Action.RESTART, 0,
     "restart 1 of 3", 5),
    ("a probe that hangs, then one that lands (a hard mount back): restarts", [HUNG], Action.RESTART, 0,
     "restart 1 of 3", 2),
    ("full: stops at once, nothing waited for", [E.ENOSPC], Action.STOP, STORAGE_EXIT,
     "the run directory {run} is full; no node is blamed", 1),
    ("an EIO that turns into a full disk stops once it is full", [E.EIO] * 3 + [E.EDQUOT], Action.STOP,
     STORAGE_EXIT, "is over its quota; no node is blamed", 4),
]


@pytest.mark.parametrize("name,script,action,code,said,probes", RECOVERIES, ids=[r[0] for r in RECOVERIES])
def test_a_storage_error_that_may_pass_is_waited_for_and_the_ordinary_decision_follows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, script: list[Any], action: Action,
        code: int, said: str, probes: int) -> None:
    """The reviewer's reproduction, probe by probe: a rank died, and the run directory
    refused the launcher's write probe for a while. Before, each row but the full disk and
    the quota stopped the run for good (exit 74), after 3 tries a second apart."""
    sup, run = one_node(tmp_path, monkeypatch)
    answered = scripted_probe(monkeypatch, script)
    decided = sup.recover(0, Watch(code=1, fault={"cause": "rank 0 died"}))
    assert (decided.action, decided.code) == (action, code), decided.reason
    assert said.format(run=run) in decided.reason
    assert len(answered) == probes
    assert not ledger.bad_nodes(run)


@pytest.mark.parametrize("script,error", [
    ([E.EIO] * 1000, "takes no write (EIO: Input/output error)"),
    ([HUNG] * 1000, "did not answer a write within 0 s (hung)"),
], ids=["EIO", "hung"])
def test_storage_that_never_answers_stops_the_run_after_the_wait_naming_the_error_and_how_long(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: list[Any], error: str) -> None:
    """...and one that never answers stops the run after STORAGE_WAIT_S (here 1 s), in one
    line: the error, the path, and how long it was tried; no node is blamed."""
    monkeypatch.setattr(supervise, "WRITE_WAIT_S", 0.5)
    sup, run = one_node(tmp_path, monkeypatch, wait_s=1.0)
    monkeypatch.setattr(health, "PROBE_WAIT_S", 0.2)
    scripted_probe(monkeypatch, script)
    began = time.monotonic()
    decided = sup.recover(0, Watch(code=1, fault={"cause": "rank 0 died"}))
    assert (decided.action, decided.code, decided.end) == (Action.STOP, STORAGE_EXIT, "storage")
    assert decided.reason.startswith(f"the run directory {run} {error}, tried for 1 s; no node is blamed"), (
        decided.reason)
    assert time.monotonic() - began < 15
    assert not ledger.bad_nodes(run)


def test_a_notice_ends_the_wait_and_the_job_goes_back_through_the_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A time-limit notice while the run waits for its storage: waited for on, the job would
    reach its time limit (TIMEOUT, never requeued). The wait ends, the storage not shown to
    last, and the notice's rule follows: requeued (the next attempt probes it again)."""
    sup, run = one_node(tmp_path, monkeypatch)
    probes = scripted_probe(monkeypatch, [E.EIO] * 1000)

    def beat(*_: Any, **__: Any) -> None:
        if len(probes) >= 5:  # (two probes into the wait)
            sup.noticed = time.monotonic()

    monkeypatch.setattr(sup, "beat", beat)
    decided = sup.recover(0, Watch(code=1, fault={"cause": "rank 0 died"}))
    assert decided.action is Action.REQUEUE and "a stop notice came as well" in decided.reason
    assert len(probes) < 10


def test_a_launcher_waits_for_the_deciders_wait_on_the_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 saw the storage refuse its write, as node 0, the decider, did: node 0 waits
    for the storage (STORAGE_WAIT_S) before it decides, and node 1 must not give up on it
    meanwhile ("no launcher decided", exit 1) while node 0 decides a restart."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=1, nnodes=2)
    (run / launchers.LAUNCH).mkdir()
    monkeypatch.setattr(supervise, "DOWN_TIMEOUT_S", 0.2)
    monkeypatch.setattr(supervise, "DECIDE_S", 0.2)
    monkeypatch.setattr(health, "STORAGE_WAIT_S", 30.0)
    sup.storage = health.Storage(f"the run directory {run} takes no write (EIO: Input/output error)")
    decided = Decision(action=Action.RESTART, active=(0, 1), reason="restart 1 of 3")
    stop = threading.Event()

    def node_0() -> None:  # beats; decides 1 s after node 1's down record, past its old deadline
        seq, heard = 0, 0.0
        while not stop.is_set():
            seq += 1
            launchers.beat(run, 0, 0, {"node": 0, "pid": 1, "seq": seq})
            if not heard and launchers.nodes_down(run, 0, 0, 2) == [1]:
                heard = time.monotonic()
            if heard and time.monotonic() - heard > 1.0 and launchers.decision(run, 0, 0) is None:
                launchers.decide(run, 0, 0, decided.to_dict())
            stop.wait(0.2)

    decider = threading.Thread(target=node_0, daemon=True)
    decider.start()
    try:
        got = sup.recover(0, Watch(code=1, fault={"cause": "rank 0 died"}))
    finally:
        stop.set()
        decider.join(5)
    assert got == decided


def recover_beating(sup: Any, hung: threading.Event, monkeypatch: pytest.MonkeyPatch,
                    ) -> tuple[list[Decision], list[float]]:
    """`sup.recover` of a rank's death in a thread, given 20 s, then the hang released: its
    decision (none: it hung) and the gaps between its beats, from its start."""
    beats: list[float] = []
    monkeypatch.setattr(sup, "beat", lambda *_, **__: beats.append(time.monotonic()))
    done: list[Decision] = []
    recovering = threading.Thread(target=lambda: done.append(sup.recover(0, Watch(code=1, fault={
        "cause": "rank 0 died"}))), daemon=True)
    began = time.monotonic()
    recovering.start()
    recovering.join(20)
    hung.set()
    return done, [b - a for a, b in zip([began, *beats], beats, strict=False)]


def test_every_read_of_the_fault_path_is_bounded_and_the_launcher_beats_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write probe lands, but the listing of the checkpoints hangs (a Lustre OST that is
    gone hangs a stat of the files on it; the probe's file is on another). Before, recovery
    hung with it, its launcher silent (the reviewer: still running after 5 s, its last beat
    4.6 s before). Now the listing gives up after READ_WAIT_S, and every later read of this
    recovery gives its default at once: the listing is not tried again."""
    sup, run = one_node(tmp_path, monkeypatch)
    monkeypatch.setattr(supervise, "READ_WAIT_S", 0.5)
    hung, listings = threading.Event(), list[Path]()

    def listing(path: Path) -> list[Any]:
        listings.append(path)
        hung.wait(30)
        return []

    monkeypatch.setattr(store, "committed", listing)
    done, gaps = recover_beating(sup, hung, monkeypatch)
    assert done, "recovery hung with the listing"
    assert done[0].restart, done[0].reason
    assert len(listings) == 1  # (once found hung, not read again: one thread blocked, not one a read)
    assert gaps and max(gaps) < 1.0, gaps


def test_recovery_on_a_hung_mount_is_bounded_and_beats(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's reproduction: the probe and the listing both hang (a hard NFS mount
    whose server is gone). Recovery ends within its bounds (here: the probe's 0.5 s, the
    wait's 1 s), the run stopped for its storage, beating all along."""
    sup, run = one_node(tmp_path, monkeypatch, wait_s=1.0)
    monkeypatch.setattr(supervise, "WRITE_WAIT_S", 0.5)
    hung = threading.Event()
    monkeypatch.setattr(health, "_probe", lambda run_dir: hung.wait(30) and None)
    monkeypatch.setattr(store, "committed", lambda path: hung.wait(30) and [])
    done, gaps = recover_beating(sup, hung, monkeypatch)
    assert done, "recovery hung with the mount"
    assert (done[0].code, done[0].end) == (STORAGE_EXIT, "storage") and "(hung)" in done[0].reason
    assert max(gaps) < 1.0, gaps


@pytest.mark.parametrize("beating", [True, False], ids=["on the fault path", "on the way out"])
def test_clearing_the_killed_ranks_lock_on_a_hung_mount_is_bounded_and_finds_it_hung(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beating: bool) -> None:
    """The lock's fix (a launcher clears what its killed ranks left of the ledger's lock)
    met the storage's (every look at the run directory on the fault path is bounded): on a
    hard mount whose server is gone, the clearing gave up after its bound but left the
    storage not known hung, so each read after it hung a bound more; and a launcher on its
    way out (fenced off, or on a bug: after its last heartbeat) cleared with no bound at
    all, and hung there as long as the mount, its task and the job's step with it."""
    sup, _ = one_node(tmp_path, monkeypatch)
    monkeypatch.setattr(supervise, "KILLED_EXIT_S", 0.2)
    monkeypatch.setattr(supervise, "READ_WAIT_S", 0.3)
    comes_back, done = threading.Event(), threading.Event()
    monkeypatch.setattr(files, "clear_left", lambda *_, **__: comes_back.wait(30))

    def clear() -> None:
        sup._clear_left([], beating=beating)
        done.set()

    threading.Thread(target=clear, daemon=True).start()
    cleared = done.wait(10)
    comes_back.set()
    assert cleared, "the clearing hung with the mount"
    assert sup.hung  # (the reads after it give their defaults at once)


def test_the_leaders_renewal_of_the_lease_on_a_hung_mount_does_not_silence_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cycle's leader reads the run's lease every lease.RENEW_S from its heartbeat, in
    training and on the fault path alike (every bounded wait beats), with no bound: on a
    hard mount whose server is gone it stood still in the read, its peers took it for lost
    after LOST_S, and once the storage answered, the decider marked its node bad (drained):
    a storage fault taken for a node's. Its beat goes on; a renewal still hanging is not
    asked again (one thread blocked, not one every RENEW_S)."""
    run = tmp_path / "run"
    run.mkdir()
    mine = lease.take(run, lease.Owner.of_job("5"), lambda j: False)
    sup = make_supervisor(run, owner=mine.token, nnodes=2)
    comes_back, reads = threading.Event(), list[Path]()

    def read(run_dir: Path) -> Any:
        reads.append(run_dir)
        comes_back.wait(30)
        return None

    monkeypatch.setattr(lease, "read", read)
    monkeypatch.setattr(supervise, "RENEW_WAIT_S", 0.2)
    done = threading.Event()

    def renew_twice() -> None:
        for _ in range(2):
            sup.renewed = -1e9  # (each one due)
            sup._renew()
        done.set()

    threading.Thread(target=renew_twice, daemon=True).start()
    renewed = done.wait(10)
    comes_back.set()
    assert renewed, "the leader's renewal hung with the mount"
    assert len(reads) == 1


def test_a_decider_on_the_store_that_found_the_storage_hung_decides_within_the_others_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node's probe hung (a hard mount whose server is gone) and never answered. The
    others give the decider DOWN_TIMEOUT_S + DECIDE_S + STORAGE_WAIT_S after their down
    records, then stop on their own ("no launcher decided"). The decider waited
    STORAGE_WAIT_S, and then, on the store, first created the decision's file in the run
    directory (the arbiter of two deciders that cannot reach each other): on the hung mount
    that write took WRITE_WAIT_S (120 s, against DECIDE_S's 30), and its decision reached
    the store after the others had given up on it. Found hung, the files decide nothing."""
    from tests.unit.test_launch_coord import serving_supervisor

    run = tmp_path / "run"
    sup, served = serving_supervisor(run, nnodes=1)
    (run / launchers.LAUNCH).mkdir(exist_ok=True)
    for name, value in (("DOWN_TIMEOUT_S", 1.0), ("DECIDE_S", 1.0), ("READ_WAIT_S", 0.2),
                        ("WRITE_WAIT_S", 10.0)):
        monkeypatch.setattr(supervise, name, value)
    monkeypatch.setattr(health, "PAUSE_S", 0.05)
    monkeypatch.setattr(health, "PROBE_WAIT_S", 0.2)
    monkeypatch.setattr(health, "STORAGE_WAIT_S", 1.0)
    comes_back = threading.Event()
    monkeypatch.setattr(health, "_probe", lambda run_dir: comes_back.wait(30) and None)
    monkeypatch.setattr(launchers, "decide", lambda *_: comes_back.wait(30) and None)
    seen: dict[str, float] = {}
    watching = threading.Event()

    def look() -> None:
        for key in list(served.data):
            seen.setdefault(key.split("/")[0], time.monotonic())

    def watch() -> None:  # when the down record and the decision reach the store
        while not watching.is_set():
            look()
            watching.wait(0.02)

    threading.Thread(target=watch, daemon=True).start()
    try:
        decided = sup.recover(0, Watch(code=1, fault={"cause": "rank 0 died"}))
        look()  # (the decision came at the latest by now)
    finally:
        watching.set()
        comes_back.set()
        sup.chan.close()
        served.close()
    assert (decided.code, decided.end) == (STORAGE_EXIT, "storage"), decided.reason
    others_wait = supervise.DOWN_TIMEOUT_S + supervise.DECIDE_S + health.STORAGE_WAIT_S
    assert seen["next"] - seen["down"] < others_wait, seen
