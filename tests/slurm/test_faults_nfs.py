"""Faults on the nodes that are like a real cluster's (the nfs partition): the run directory
on NFS-like storage whose views cache lookups (a file one node creates stays invisible to
the others for the negative-lookup time), two of the three nodes with wall clocks 30 s
ahead and behind. The launchers coordinate through node 0's store, so nothing waits for a
file to appear on another host, and nothing compares two hosts' clocks: not the time-limit
stop either, which the node behind plans from the controller's notice."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from hpcshard.launch.procs import ranks_below
from hpcshard.rundir import ledger
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.progress import boards
from hpcshard.runtime.train import STOP_MARGIN_S
from tests.conftest import NOT_ABOUT_HANGS, STEPS, hpcshard, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import (
    FAULTY,
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
)
from tests.slurm.conftest import (
    NFS_CACHE_S,
    NFS_NODES,
    SHARED,
    SKEW,
    freeze,
    job_info,
    restarts,
    slurm,
    state,
    story,
    wait_state,
)
from tests.slurm.test_faults import heartbeat
from tests.slurm.test_launch_slurm import DONE, submit


def trained_on_board(step: int) -> bool:
    """Some rank of this host reports `step` or later on its progress board."""
    return any(s.step >= step for board in boards() for s in board)


@pytest.mark.nfs_partition
def test_a_killed_rank_on_nfs_like_storage_and_skewed_clocks_restarts_in_place_bitwise_equal(
        cluster: dict[str, str], uninterrupted: Path) -> None:
    """2 nodes and a spare on the nfs partition (every node's clock but one off by 30 s, one
    ahead, one behind). A rank SIGKILLed on the second launcher's node: declared, decided
    and restarted in place through the store, with no healthy node taken for lost (nor the
    spare), and the run ends bitwise equal to an uninterrupted one."""
    run = SHARED / f"killed-{uuid.uuid4().hex[:8]}"
    try:
        job = submit(cluster, run, "--partition", "nfs", "--time", "10:00", "--spares", "1",
                     *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS, **NOT_ABOUT_HANGS))
        # (by the ranks' own boards: what this host's view of the run directory shows lags
        # by its cache times, and a 16-step run is over by then)
        wait_for(lambda: len(rank_pids(run)) == 4 and trained_on_board(6), 240, "step 6 on the boards")
        os.kill(ranks_below([launchers(run)[1]])[-1], signal.SIGKILL)
        assert wait_state(job, DONE, 300) == "COMPLETED"
        assert restarts(job) == 0
        records = ledger.read(run)
        faults = [r for r in records if r["event"] == "fault"]
        assert len(faults) == 1, faults
        (fault,) = faults
        assert fault["restart"] and "died" in fault["cause"]
        assert fault["lost"] == [] and fault["bad"] == [] and fault["active"] == [0, 1]
        assert not [r for r in records if r["event"] == "bad_node"]
        # Through node 0's store, not the run directory's files (but the decision's one,
        # created exclusively: the arbiter of a job cut in two).
        files = [p.name for p in (run / "launch").iterdir()]
        assert not [name for name in files if name.startswith(("fault-", "down-"))]
        assert [name for name in files if name.startswith("next-")] == ["next-0-0.json"]
        # (every nfs node had a launcher: the skewed ones among them)
        where = {json.loads(p.read_text()).get("slurm_node") for p in (run / "launch").glob("alive-0-*.json")}
        assert where == set(NFS_NODES) and set(SKEW) < where
        (back,) = [r for r in records if r["event"] == "recovered"]
        assert back["seconds"] > 0  # (on one launcher's monotonic clock: no skew in it)
        trained = [r["step"] for r in step_records(run)]
        assert sorted(set(trained)) == list(range(1, STEPS + 1))
        reference, mine = committed(uninterrupted), committed(run)
        assert STEPS in mine
        for step, path in mine.items():
            assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
    finally:
        shutil.rmtree(run, ignore_errors=True)  # (the backing directory outlives the cluster)


@pytest.mark.nfs_partition
def test_a_frozen_node_0_on_nfs_like_storage_is_replaced_through_the_standby_store(
        cluster: dict[str, str], uninterrupted: Path) -> None:
    """2 nodes and a spare on the nfs partition; every process of node 0's Slurm node
    stopped: its launcher's store with it. The others find the store silent and move to
    the standby node 1 serves (they knew where from node 0's store): node 0 is declared
    lost, the spare takes its place and training goes on, without a file that must show
    through the views' lookup caches (through the files this recovery cost 72 s on 30 s
    caches in the chaos soak, against 15 s on a coherent disk). Node 0 thawed leaves."""
    run = SHARED / f"frozen0-{uuid.uuid4().hex[:8]}"
    victim = ""
    try:
        job = submit(cluster, run, "--partition", "nfs", "--time", "10:00", "--spares", "1",
                     *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS, **NOT_ABOUT_HANGS))
        wait_for(lambda: len(rank_pids(run)) == 4 and trained_on_board(6), 240, "step 6 on the boards")
        victim = heartbeat(run, 0)["slurm_node"]
        assert freeze(victim)
        wait_for(lambda: any(r["event"] == "recovered" for r in ledger.read(run)), 180,
                 "training again on the spare")
        freeze(victim, signal.SIGCONT)
        assert wait_state(job, DONE, 300) == "COMPLETED"
        assert restarts(job) == 0  # (inside the allocation: the spare took node 0's place)
        records = ledger.read(run)
        (fault,) = [r for r in records if r["event"] == "fault"]
        assert fault["restart"] and fault["lost"] == [0] and fault["active"] == [1, 2]
        (bad,) = [r for r in records if r["event"] == "bad_node"]
        assert bad["node"] == 0 and bad["slurm_node"] == victim
        # Through the standby store, not the run directory's files (but the decision's one,
        # created exclusively: the arbiter of a job cut in two).
        files = [p.name for p in (run / "launch").iterdir()]
        assert not [name for name in files if name.startswith(("fault-", "down-"))], files
        assert [name for name in files if name.startswith("next-")] == ["next-0-0.json"]
        (back,) = [r for r in records if r["event"] == "recovered"]
        # (on one launcher's monotonic clock; loose, as restarts are slow under the suite's
        # load: the files not written, above, are what says the standby carried it)
        assert back["seconds"] < 60, back
        reference, mine = committed(uninterrupted), committed(run)
        assert STEPS in mine
        for step, path in mine.items():
            assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
    finally:
        if victim:
            freeze(victim, signal.SIGCONT)
            slurm("scontrol", "update", f"NodeName={victim}", "State=RESUME")
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.nfs_partition
def test_a_node_whose_clock_is_behind_stops_before_its_time_limit_and_requeues(
        cluster: dict[str, str]) -> None:
    """One node whose wall clock is 30 s behind the controller's (the nfs node with the
    feature clock_behind), a job with a 3 minute limit and the notice 60 s before it. The
    ranks train on after the notice and must stop, in true time, with their save (twice
    over), two steps and the margin left before the limit. Planned on the node's clock
    against the controller's EndTime, the stop came 30 s late: its save crossed the limit,
    and a job that reaches its limit ends TIMEOUT, which is never requeued (whether Slurm
    killed it first was up to its timer: the stop's time is what this test asserts). Each
    step sleeps 0.8 s (tests/jobs/faulty.py): time passes, not CPU. The notice comes 60-90 s
    before the limit (Slurm looks every 30 s), 90-120 s after the start: room for a start
    under the suite's load to have measured its first save, which the plan needs (a lead of
    90 left 60 s, under a loaded start's minute)."""
    run = SHARED / f"behind-{uuid.uuid4().hex[:8]}"
    (node,) = [n for n, skew in SKEW.items() if skew < 0]
    job = ""
    try:
        proc = hpcshard("submit", "--backend", "slurm", "--nodes", "1", "--gpus", "1", FAULTY,
                        "--run-dir", str(run), "--partition", "nfs", "--constraint", "clock_behind",
                        "--time", "3", "--signal-lead", "60", "--requeue-policy", "requeue",
                        *sets(steps=2000, ckpt_every=3, keep_last=2, sleep_s=0.8, **NOT_ABOUT_HANGS),
                        env=cluster)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
        wait_state(job, {"RUNNING"}, 120)
        info = job_info(job)
        assert info["NodeList"] == node, info
        # The limit's end on the controller's clock, which is this host's (a time of day
        # without a zone, as scontrol prints it: this host's zone).
        limit = time.mktime(time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S"))
        wait_for(lambda: ledger.end_of(run, 0) is not None, 300, "the first attempt's end")
        end = ledger.end_of(run, 0)
        assert end is not None and end["reason"] == "stop", end
        # The end record was written after the stop's save, on the node's wall clock.
        stopped = end["time"] - SKEW[node]
        assert stopped < limit - STOP_MARGIN_S / 2, (limit - stopped, story(run))
        rank0 = run / "logs" / "rank-0.log"  # (its lines reach this host's view as the ledger's do)
        wait_for(lambda: "as the notice says" in rank0.read_text(), 6 * NFS_CACHE_S, "rank 0's stop line")
        log = rank0.read_text()
        assert "time-limit notice: training on until" in log, (log[-3000:], story(run))  # (not at once)
        assert "as the notice says" in log, log[-3000:]  # (the node's own deadline is too late)
        wait_for(lambda: restarts(job) >= 1, 120, "the requeue")  # (requeued: not TIMEOUT)
        # The requeue's record, written on n8 through its own view, reaches this host's view
        # once its caches expire (NFS_CACHE_S; the suite once read the ledger a moment before).
        wait_for(lambda: any(r["event"] == "requeue" for r in ledger.read(run)), 6 * NFS_CACHE_S,
                 "the requeue's record")
    finally:
        if job:  # (requeued, it would train on: it has shown what it had to)
            cancel(job)
        shutil.rmtree(run, ignore_errors=True)


def cancel(job: str, within: float = 120) -> None:
    """scancel `job` until it has ended: Slurm refuses to cancel a job on its way back
    through the queue (COMPLETING after a requeue), which then runs again."""
    deadline = time.monotonic() + within
    while state(job) not in DONE:
        assert time.monotonic() < deadline, f"job {job} still {state(job)} after {within}s of scancel"
        with contextlib.suppress(subprocess.CalledProcessError):
            slurm("scancel", job)
        time.sleep(1)
