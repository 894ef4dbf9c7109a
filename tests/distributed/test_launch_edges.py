"""What comes at the edges of supervision, with real processes on the local backend (2 nodes):
a stop notice or a cancel that comes before there are ranks or an agent to hear it, and a
disk that fills up while the launchers handle a fault. The runs that end bitwise equal to
an uninterrupted one are 2 x 1 (`uninterrupted_2x1`): what they test is between the
launchers, and a 2 x 2 start costs about 9 CPU-s more."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from hpcshard.launch.procs import children, descendants
from hpcshard.rundir import ledger
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.rankenv import STORAGE_EXIT
from tests.conftest import STEPS, hpcshard, hpcshard_bg, sets, step_records, tmpfs, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
    trained_to,
)

pytestmark = pytest.mark.dist


def started(run: Path) -> bool:
    """Both launchers run (their signal handlers are in before their pid files are written)
    and no rank has started yet."""
    return len(launchers(run)) == 2 and not [r for r in ledger.read(run) if r["event"] == "start"]


def agent(launcher: int) -> int | None:
    """The warm agent a launcher's zygote forked for this cycle (None: not yet)."""
    for zygote in children(launcher):
        if b"hpcshard.launch.zygote" in Path(f"/proc/{zygote}/cmdline").read_bytes():
            found = children(zygote)
            return found[0] if found else None
    return None


def test_a_notice_during_the_rendezvous_reaches_the_ranks_and_the_run_requeues_bitwise_equal(
        uninterrupted_2x1: Path, tmp_path: Path) -> None:
    """Defect 8: a notice that came while the agents were in their rendezvous (no rank
    forked yet) reached nobody: the run trained on, and a time-limit notice so lost ended in
    TIMEOUT, never requeued. Node 1's agent is held (SIGSTOP) so that neither node's ranks
    can start while the notice comes; every rank that joins the board after it gets it."""
    run = tmp_path / "early"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=STEPS, ckpt_every=4, keep_last=100))
    wait_for(lambda: len(launchers(run)) == 2 and agent(launchers(run)[1]), 120, "node 1's agent")
    first = agent(launchers(run)[1])
    assert first is not None
    # (the static rendezvous lets each agent fork its ranks at once; they meet in the
    # process group's join: node 1's agent and whatever it forked are held there)
    held = [first, *descendants(first)]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: agent(launchers(run)[0]), 60, "node 0's agent")
        time.sleep(0.5)
        assert not trained_to(run, 1)  # no step anywhere yet: every rank waits for node 1's
        assert hpcshard("preempt", str(run)).returncode == 0
        time.sleep(1.0)
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    ends = [r for r in ledger.read(run) if r["event"] == "end"]
    assert [(e["attempt"], e["reason"]) for e in ends] == [(0, "stop"), (1, "done")], ends
    assert ends[0]["saved_step"] < 4  # it stopped at its first step boundary, not at the end
    assert_bitwise_equal(load(committed(run)[STEPS]), load(committed(uninterrupted_2x1)[STEPS]), "the end")


def test_a_cancel_before_the_agent_exists_ends_the_run_at_once(tmp_path: Path) -> None:
    """Defect 8: a TERM (`hpcshard cancel` of a local run) during the agent's start was
    noted but signalled no one: the run trained on to its end."""
    run = tmp_path / "cancelled"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=400))
    wait_for(partial(started, run), 120, "the launchers, before any rank")
    assert hpcshard("cancel", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert len(step_records(run)) < 400
    assert not [r for r in ledger.read(run) if r["event"] == "end" and r.get("reason") == "done"]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """48 MiB: room for the run and two of its 11 MB checkpoints, until it is filled."""
    with tmpfs(tmp_path / "disk", "48m") as mnt:
        yield mnt


def fill(mnt: Path) -> Path:
    """Take every byte left on `mnt` (what the cluster's quota or a neighbour's job does)."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, shutil.disk_usage(mnt).free)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


def test_a_disk_that_fills_during_a_fault_stops_the_run_for_its_storage_and_blames_no_node(
        uninterrupted_2x1: Path, disk: Path) -> None:
    """Defects 2 and 3: a full run directory made every fault-path write raise (the launcher
    died before it killed its ranks, left no `done`, its peers took its node for lost), and
    a full disk failed node health checks (nodes drained, one per requeue). Now the ranks
    are killed, the run stops with STORAGE_EXIT and one line saying what is full, no node is
    bad, and once there is room again `resume` ends it bitwise equal to an uninterrupted run."""
    run = disk / "run"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=STEPS, ckpt_every=4, keep_last=1))
    wait_for(partial(trained_to, run, 6), 180, "step 6, past the commit of step 4")
    victims = rank_pids(run)
    filler = fill(disk)
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == STORAGE_EXIT, out[-4000:]
    assert f"the run directory {run} is full" in out
    time.sleep(1)
    assert not [p for p in victims if Path(f"/proc/{p}").exists()]  # every rank was killed
    assert not [r for r in ledger.read(run) if r["event"] == "bad_node"]  # no node blamed
    filler.unlink()
    done = hpcshard("resume", str(run))
    assert done.returncode == 0, done.stdout[-4000:]
    assert_bitwise_equal(load(committed(run)[STEPS]), load(committed(uninterrupted_2x1)[STEPS]), "the end")
