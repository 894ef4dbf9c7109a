"""Shared storage is never one node's fault (issue 42, defect 1), without processes: the run
directory's write probe, errno by errno; the decider's facts when the run directory refused
the launchers' records; and the waits of a launcher without ranks, each with its end.

Before: any error of the probe other than ENOSPC, EDQUOT and EROFS that persisted was "from
this node", and each launcher declared itself bad (drained) before anything was compared:
an EIO drained both nodes of a 2-node job. With an EACCES the bad-node records could not
be written, the decider (which read them from the ledger only) restarted both nodes, and
both idled without ranks until the time limit."""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import health
from hpcshard.launch.liveness import LOST_S, UNHEARD_S
from hpcshard.launch.policy import Action
from hpcshard.launch.supervise import ALL_LOST_S, Watch
from hpcshard.rundir import launchers, ledger, store
from hpcshard.rundir.rankenv import STORAGE_EXIT
from tests.unit.test_launch_races import make_supervisor

pytestmark = pytest.mark.unit

E = errno
# (name, what the probe's fsync raises in turn, what the storage is said to be (a pattern;
# "": nothing wrong), whether a person must act (no wait helps), how many writes the probe made)
PROBES = [
    ("a write that lands", [], "", False, 1),
    ("one ESTALE passes: a file server's blip", [E.ESTALE], "", False, 2),
    ("two EIOs, then a write: passes", [E.EIO, E.EIO], "", False, 3),
    ("an EIO that persists is the storage's (a soft NFS mount, an evicted Lustre client)",
     [E.EIO] * 3, r"^the run directory \S+ takes no write \(EIO: Input/output error\) \(3 tries\)$",
     False, 3),
    ("an EACCES that persists is the storage's (a ticket expired, root squash)",
     [E.EACCES] * 3, r"takes no write \(EACCES: Permission denied\) \(3 tries\)$", False, 3),
    ("an ESTALE that persists is the storage's (a re-export)", [E.ESTALE] * 3,
     r"takes no write \(ESTALE: Stale file handle\)", False, 3),
    ("a FUSE or network client gone (ENOTCONN) is the storage's", [E.ENOTCONN] * 3,
     r"takes no write \(ENOTCONN: ", False, 3),
    ("full: at once, no retry helps", [E.ENOSPC], r"^the run directory \S+ is full$", True, 1),
    ("over quota: at once", [E.EDQUOT], r"is over its quota$", True, 1),
    ("read-only: at once", [E.EROFS], r"is read-only$", True, 1),
]


@pytest.mark.parametrize("name,raised,said,lasting,writes", PROBES, ids=[p[0] for p in PROBES])
def test_every_error_of_the_probe_is_the_storages_and_never_the_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, raised: list[int], said: str,
        lasting: bool, writes: int) -> None:
    real, calls = os.fsync, []

    def failing(fd: int) -> None:
        calls.append(fd)
        if len(calls) <= len(raised):
            code = raised[len(calls) - 1]
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    monkeypatch.setattr(health.time, "sleep", lambda s: None)
    found = health.check(tmp_path, leader=True, ranks=1, command="", waiting=lambda: None)
    assert found.node == ""  # never the node's: no node is bad for the run directory
    assert re.search(said, found.storage.why) if said else found.storage.why == "", found.storage
    assert found.storage.lasting == lasting  # (the rest may pass: the run waits for it)
    assert len(calls) == writes
    assert not [p for p in (tmp_path / launchers.LAUNCH).iterdir() if "probe" in p.name]  # none left


def test_a_probe_that_hangs_is_the_storage_hung_and_the_launcher_beats_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hard NFS mount whose server is gone blocks a write until it is back: a launcher
    silent meanwhile is taken for lost, and its node blamed for the storage."""
    release, beats = threading.Event(), []
    monkeypatch.setattr(health, "_probe", lambda run_dir: release.wait(30) and None)
    try:
        said = health.storage_problem(tmp_path, waiting=lambda: beats.append(1), within=1.0)
    finally:
        release.set()
    assert said == health.Storage(f"the run directory {tmp_path} did not answer a write within 1 s (hung)",
                                  hung=True)
    assert len(beats) >= 3


def test_the_leaders_listing_of_the_checkpoints_is_inside_the_probes_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader sizes the next checkpoint from a listing of the committed ones, which a
    hung mount hangs too (a stat of a file on a Lustre OST that is gone, a hard NFS mount):
    that listing was made before the bounded probe started, and the leader was silent for
    as long as it hung (its peers, whose probes passed, would take node 0 for lost)."""
    listing = threading.Event()
    monkeypatch.setattr(store, "committed", lambda path: listing.wait(30) and [])
    monkeypatch.setattr(health, "PROBE_WAIT_S", 1.0)
    beats: list[int] = []
    found: list[health.Health] = []
    checking = threading.Thread(target=lambda: found.append(health.check(
        tmp_path, leader=True, ranks=1, command="", waiting=lambda: beats.append(1))), daemon=True)
    checking.start()
    checking.join(10)
    listing.set()
    assert found, "the leader's health check hung with the listing"
    assert found[0].storage.why == f"the run directory {tmp_path} did not answer a write within 1 s (hung)"
    assert len(beats) >= 3


def two_nodes_and_a_spare(tmp_path: Path) -> tuple[Any, Path]:
    """Node 0 (the decider) of a job of two nodes and a spare (node 2), its run directory
    coordinated through the files."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=0, nnodes=3)
    sup.roster = type(sup.roster)((0, 1), (2,))
    (run / launchers.LAUNCH).mkdir()
    return sup, run


def unreadable(*_: Any) -> Any:
    raise OSError(errno.EIO, "Input/output error")


def test_a_bad_node_whose_record_the_storage_refused_gets_no_ranks_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 failed its health check; its bad-node record never reached the ledger, and
    the ledger cannot even be read. Its down record says it: the spare takes its place
    (before: `Facts.bad` came from the ledger alone, and the decider restarted node 1)."""
    sup, run = two_nodes_and_a_spare(tmp_path)
    launchers.mark_down(run, 0, 0, 0, {"dead": [], "reached": 0})
    launchers.mark_down(run, 0, 0, 1, {"dead": [], "reached": 0,
                                       "bad": {"1": "health check: nvidia-smi lists 0 GPU(s)"}})
    launchers.mark_down(run, 0, 0, 2, {"dead": [], "reached": 0})
    monkeypatch.setattr(ledger, "read", unreadable)
    decided = sup.decide(0, Watch(code=1, fault={"cause": "node 1 failed its health check"}))
    assert decided.action is Action.RESTART and decided.active == (0, 2) and decided.bad == (1,)
    assert "health check: nvidia-smi lists 0 GPU(s)" in decided.reason


def test_the_deciders_own_declarations_count_without_the_ledger(tmp_path: Path) -> None:
    """The decider declared node 1 bad itself (a lost spare, its own failed check): what it
    knows in memory is a fact, whatever the ledger holds."""
    sup, run = two_nodes_and_a_spare(tmp_path)
    sup.declared = {1: "health check: 1.0 GiB of 64 GiB memory available"}
    for n in (0, 1, 2):
        launchers.mark_down(run, 0, 0, n, {"dead": [], "reached": 0})
    decided = sup.decide(0, Watch(code=1, fault={"cause": "x"}))
    assert decided.active == (0, 2) and decided.bad == (1,)


EIO = "the run directory {run} takes no write (EIO: Input/output error) (3 tries)"
FULL = "the run directory {run} is full"
# (name, what each node's down record says of the run directory (node: error, "" for a
# write that landed; "+" marks one a person must fix), action, active, words in the reason)
ONE_NODES_VIEW = [
    ("a stale mount on node 1 alone: it sits the attempt out, the spare takes its place",
     {0: "", 1: EIO, 2: ""}, Action.RESTART, (0, 2),
     f"node(s) [1] sit this attempt out ({EIO}, seen from node(s) [1], not from [0, 2]): spare node(s) [2]"),
    ("...on the decider's node alone: the same", {0: EIO, 1: "", 2: ""}, Action.RESTART, (1, 2),
     "node(s) [0] sit this attempt out"),
    ("...on the spare alone: it is not used", {0: "", 1: "", 2: EIO}, Action.RESTART, (0, 1),
     "restart 1 of 3"),
    ("full as node 1 alone sees it: its view, not the storage's", {0: "", 1: "+" + FULL, 2: ""},
     Action.RESTART, (0, 2), "node(s) [1] sit this attempt out (the run directory"),
    ("every node that reported: the run stops, whatever the spare", {0: "+" + FULL, 1: "+" + FULL, 2: EIO},
     Action.STOP, (), f"{FULL}; no node is blamed"),
]


@pytest.mark.parametrize("name,said,action,active,reason", ONE_NODES_VIEW, ids=[c[0] for c in ONE_NODES_VIEW])
def test_a_storage_error_one_node_alone_saw_is_no_reason_to_stop_and_makes_no_node_bad(
        tmp_path: Path, name: str, said: dict[int, str], action: Action, active: tuple[int, ...],
        reason: str) -> None:
    """A stale mount on one node stopped the whole run (issue 42's review): the decider had
    the others' writes that landed, and stopped all the same. Now the nodes that alone saw
    an error sit this attempt out: no bad-node record, no drain, no exclusion in later jobs;
    a spare, fewer nodes or the queue, as for a bad node. Only when every node that reported
    saw it does the run stop for its storage."""
    sup, run = two_nodes_and_a_spare(tmp_path)
    for n, error in said.items():
        why = error.lstrip("+").format(run=run)
        launchers.mark_down(run, 0, 0, n, {"dead": [], "reached": 5, **(
            {"storage": why, "lasting": error.startswith("+")} if why else {})})
    decided = sup.decide(0, Watch(code=1, fault={"cause": "rank 1 died"}))
    assert decided.action is action and decided.bad == ()
    assert reason.format(run=run) in decided.reason, decided.reason
    if action is Action.RESTART:
        assert decided.active == active
    else:
        assert (decided.code, decided.end) == (STORAGE_EXIT, "storage")
    assert not ledger.bad_nodes(run)


def idle_bounded(sup: Any, monkeypatch: pytest.MonkeyPatch, looks: int = 50) -> None:
    """`idle` waits through `chan.wait`: past `looks` of them it would wait for good."""
    waited = []

    def wait(seconds: float, on_store: float | None = None) -> None:
        waited.append(seconds)
        if len(waited) > looks:
            raise AssertionError(f"idle() still waiting after {looks} looks: no end in sight")

    monkeypatch.setattr(sup.chan, "wait", wait)


def test_a_node_given_ranks_it_cannot_run_declares_a_fault_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 failed its health check, and the decider (not knowing) gave it ranks in cycle
    1: it declares a fault for that cycle instead of idling while its peers wait for its
    ranks (with every node of the cycle like it, nobody declared anything, ever)."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=1, nnodes=2)
    (run / launchers.LAUNCH).mkdir()
    sup.unhealthy = "failed its health check: nvidia-smi lists 0 GPU(s); this node runs 1 ranks"
    launchers.beat(run, 0, 0, {"node": 0, "pid": 1, "seq": 1})
    idle_bounded(sup, monkeypatch)
    watch = sup.idle(1)
    assert watch.fault is not None and watch.fault["cause"] == (
        "node 1 failed its health check: nvidia-smi lists 0 GPU(s); this node runs 1 ranks")
    assert launchers.fault(run, 0, 1) == watch.fault


def test_a_spare_whose_active_nodes_are_all_lost_declares_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launcher with ranks went silent (their nodes died at once): nobody but the
    spare is left to declare it, and it waited for them for good."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=2, nnodes=3)
    sup.roster = type(sup.roster)((0, 1), (2,))
    (run / launchers.LAUNCH).mkdir()
    sup.peers.began -= UNHEARD_S + ALL_LOST_S + 1  # never heard of since: lost
    sup.peers.heard_since -= UNHEARD_S + ALL_LOST_S + 1
    idle_bounded(sup, monkeypatch)
    watch = sup.idle(0)
    assert watch.fault is not None and watch.fault["lost"] == [0, 1]
    assert watch.fault["cause"] == f"node(s) [0, 1] lost: silent for {ALL_LOST_S:.0f} s"


def test_a_spare_does_not_take_launchers_silent_together_for_lost_seconds_for_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both launchers with ranks beat last LOST_S + 1 s ago: starved together (a save, a
    swap storm; each comes back, `_stood_still`), or heard through node 0's store that
    was just lost (the spare moves to the standby a beat later, and hears node 1 there).
    The spare declared both lost at LOST_S and, the decider then, drained both."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=2, nnodes=3)
    sup.roster = type(sup.roster)((0, 1), (2,))
    (run / launchers.LAUNCH).mkdir()
    for n in (0, 1):
        launchers.beat(run, 0, n, {"node": n, "pid": 100 + n, "seq": 7})
    sup.peers.heard_since -= LOST_S + 2
    sup.peers.observe(launchers.beats(run, 0, 3), now=time.monotonic() - LOST_S - 1)
    idle_bounded(sup, monkeypatch, looks=20)
    with pytest.raises(AssertionError, match="still waiting"):
        sup.idle(0)
    assert launchers.fault(run, 0, 0) is None


def test_a_spare_waits_while_a_node_with_ranks_beats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """...and not while one of them is alive (it trains: an idle spare may wait for days)."""
    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=2, nnodes=3)
    sup.roster = type(sup.roster)((0, 1), (2,))
    (run / launchers.LAUNCH).mkdir()
    sup.peers.began -= UNHEARD_S + LOST_S + 1
    sup.peers.heard_since -= UNHEARD_S + LOST_S + 1
    launchers.beat(run, 0, 0, {"node": 0, "pid": 1, "seq": 1})
    idle_bounded(sup, monkeypatch, looks=20)
    with pytest.raises(AssertionError, match="still waiting"):
        sup.idle(0)
    assert launchers.fault(run, 0, 0) is None


def test_a_write_that_hangs_is_given_up_and_the_launcher_beats_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record written on a hung mount (a hard NFS mount whose server is gone) held the
    fault path for as long as the mount hung: every wait has a bound."""
    from hpcshard.launch import supervise

    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=0, nnodes=1)
    monkeypatch.setattr(supervise, "WRITE_WAIT_S", 0.5, raising=False)
    beats: list[int] = []
    monkeypatch.setattr(sup, "beat", lambda *_, **__: beats.append(1))
    hung, said = threading.Event(), []
    writing = threading.Thread(target=lambda: said.append(sup._try("the fault's record", hung.wait, 30)))
    writing.start()
    writing.join(10)
    hung.set()
    assert said == [False] and len(beats) >= 2
