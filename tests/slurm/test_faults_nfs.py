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
from tests.conftest import STEPS, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
)
from tests.slurm.conftest import NFS_NODES, SHARED, SKEW, restarts, wait_state
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
                     *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS))
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
