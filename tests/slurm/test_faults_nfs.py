"""Faults on the nodes that are like a real cluster's (the nfs partition): the run directory
on NFS-like storage whose views cache lookups (a file one node creates stays invisible to
the others for the negative-lookup time), two of the three nodes with wall clocks 30 s
ahead and behind. The launchers coordinate through node 0's store, so nothing waits for a
file to appear on another host, and nothing compares two hosts' clocks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from hpcshard.launch.procs import ranks_below
from hpcshard.rundir import ledger
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.progress import boards
from tests.conftest import NOT_ABOUT_HANGS, STEPS, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
)
from tests.slurm.conftest import NFS_NODES, SHARED, SKEW, freeze, restarts, slurm, wait_state
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
