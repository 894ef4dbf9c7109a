"""`hpcshard logs JOB -f` on a real Slurm: found by the job id, it follows a run through a
requeue of its job (the same job runs again) in one stream, each attempt headed with the
job and the nodes its ranks ran on, and ends when the job does."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import NOT_ABOUT_HANGS, hpcshard, hpcshard_bg, sets, wait_for
from tests.distributed.test_runtime_checkpoint import trained_to
from tests.slurm.conftest import restarts, wait_state

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.mark.debug_partition
def test_logs_follow_a_requeued_job_in_one_stream(cluster: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "followed"
    sub = hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "1", "jobs/charlm.py",
                   "--run-dir", str(run), "--partition", "debug", "--time", "10:00",
                   "--requeue-policy", "requeue", *sets(steps=16, ckpt_every=4, log_every=1,
                                                        **NOT_ABOUT_HANGS), env=cluster)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    follow = hpcshard_bg("logs", job, "-f", env=cluster)  # by the job id, before it runs
    try:
        wait_for(partial(trained_to, run, 3), 300, "step 3")
        assert hpcshard("preempt", str(run), env=cluster).returncode == 0
        assert wait_state(job, DONE, 400) == "COMPLETED"
        shown, _ = follow.communicate(timeout=90)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
    assert follow.returncode == 0, shown[-4000:]
    assert restarts(job) == 1
    heads = [line for line in shown.splitlines() if line.startswith("==> attempt ")]
    assert [h.split(":")[0] for h in heads] == ["==> attempt 0 (restart 0)",
                                                "==> attempt 1 (restart 0)"], shown
    for head in heads:  # the same job, run twice; the nodes named by the ranks themselves
        assert f"job {job}, nodes n" in head and "ranks 0,1" in head, head
    assert "checkpoint step 16 committed" in shown
