"""Faults inside a real Slurm allocation: a rank killed on one node is restarted with every
other rank, in place, by the node launchers that srun started (no requeue, same job)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from tests.conftest import STEPS, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
    trained_to,
)
from tests.slurm.conftest import restarts, wait_state
from tests.slurm.test_launch_slurm import DONE, submit


@pytest.mark.debug_partition
def test_a_killed_rank_is_restarted_within_the_allocation_and_the_run_ends_bitwise_equal(
        cluster: dict[str, str], uninterrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    # The reference is the local backend's 2x2 run: the same shape (mesh, sharding, batches
    # per rank) and the same settings but for how often it saves, which changes nothing
    # trained. Every "node" of the local cluster runs on this host (slurmd -N nX), so each
    # srun task's launcher (its pid in RUN_DIR/launch) and its ranks are local processes.
    job = submit(cluster, run, "--partition", "debug", "--time", "10:00",
                 *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS))
    wait_for(lambda: 4 in committed(run) and trained_to(run, 6), 240, "step 6, past the commit of step 4")
    wait_for(lambda: len(rank_pids(run)) == 4, 30, "the 4 ranks under the 2 node launchers")
    victim = rank_pids(run)[-1]  # a rank of the second node
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    assert wait_state(job, DONE, 300) == "COMPLETED"
    # The same allocation: Slurm never requeued the job, and no continuation job exists.
    assert restarts(job) == 0
    assert json.loads((run / "spec.json").read_text())["jobs"] == [job]

    records = ledger.read(run)
    (fault,) = [r for r in records if r["event"] == "fault"]
    starts = [r for r in records if r["event"] == "start"]
    assert fault["restart"] and fault["culprit"]["pid"] == victim and "died" in fault["cause"]
    assert fault["culprit"]["node"] == 1  # seen by the second task's launcher, decided by the first's
    assert fault["declared"] - killed_at < 5  # seconds, not torchrun's 300 s or gloo's 30 min
    assert [(s["attempt"], s["cycle"]) for s in starts] == [(0, 0), (0, 1)]
    assert starts[1]["resumed_step"] == fault["committed"] >= 4
    trained = [r["step"] for r in step_records(run)]  # only what the fault lost, twice
    assert sorted(set(trained)) == list(range(1, STEPS + 1))
    assert len(trained) - STEPS == fault["lost_steps"]
    reference, mine = committed(uninterrupted), committed(run)
    assert STEPS in mine
    for step, path in mine.items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
