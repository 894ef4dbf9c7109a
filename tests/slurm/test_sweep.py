"""A sweep as one Slurm job array on the local cluster, with accounting (slurmdbd and
MariaDB): a 2x2 grid, one task preempted and requeued by itself while the others carry on;
the status table and plot; and, once the controller has forgotten the jobs (MinJobAge is
short on the test cluster), their final state and history from accounting."""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

from hpcshard.rundir import ledger
from tests.conftest import hpcshard, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load, trained_to
from tests.slurm.conftest import CONF, restarts, state

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEPS = 30
SETS = sets(steps=STEPS, ckpt_every=10, eval_every=STEPS, log_every=1)


def forgotten(job: str) -> bool:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True,
                          env={"SLURM_CONF": str(CONF), "PATH": "/usr/bin:/bin"}).returncode != 0


def test_a_sweep_is_one_array_whose_tasks_are_requeued_each_by_itself(cluster: dict[str, str],
                                                                     tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    proc = hpcshard("sweep", "--backend", "slurm", "jobs/charlm.py", "--grid", "lr=1e-3,3e-3",
                    "--grid", "dim=32,48", "--nodes", "1", "--gpus", "1", "--partition", "low",
                    "--time", "10:00", "--sweep-dir", str(root),
                    *SETS, env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = json.loads((root / "sweep.json").read_text())["array"]
    assert f"submitted job array {array} (0-3)" in proc.stdout
    jobs = [json.loads((root / f"task-{i}" / "spec.json").read_text())["jobs"][-1] for i in range(4)]
    assert jobs == [f"{array}_{i}" for i in range(4)]
    # Task 3 is preempted (its notice, its job only); it saves, requeues itself and resumes.
    # (The array's last task has the array's own job id: `scontrol requeue ARRAY` would
    # requeue every task; it must requeue ARRAY_3.)
    task = root / "task-3"
    wait_for(partial(trained_to, task, 3), 240, "task 3 at step 3")
    assert hpcshard("preempt", str(task), env=cluster).returncode == 0
    wait_for(lambda: all(state(job) in DONE for job in jobs), 400, "every task done")
    assert [state(job) for job in jobs] == ["COMPLETED"] * 4
    assert [restarts(job) for job in jobs] == [0, 0, 0, 1]
    starts = [r for r in ledger.read(task) if r["event"] == "start"]
    stop = next(r for r in ledger.read(task) if r["event"] == "end")
    assert stop["reason"] == "stop" and starts[1]["resumed_step"] == stop["saved_step"]
    assert [(s["slurm_job"], s["slurm_run"]) for s in starts] == [(jobs[3], 0), (jobs[3], 1)]
    steps = [r["step"] for r in step_records(task)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))  # every step; the stop's own once more at most
    # As a single run resumes: the preempted task ends with the weights (and optimizer) of
    # its configuration run through once, without a stop (local backend, the same shape).
    alone = tmp_path / "alone"
    proc = hpcshard("submit", "--backend", "local", "jobs/charlm.py", "--run-dir", str(alone),
                    "--set", "lr=3e-3", "--set", "dim=48", *SETS)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert_bitwise_equal(load(committed(task)[STEPS]), load(committed(alone)[STEPS]), "task 3")
    for other in (0, 1, 2):  # never interrupted
        assert len([r for r in ledger.read(root / f"task-{other}") if r["event"] == "start"]) == 1
    table = hpcshard("status", str(root), env=cluster).stdout
    assert f"job array {array}" in table
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("task-")}
    assert "lr=3e-3,dim=48" in rows["task-3"] and rows["task-3"].split()[-1] == "2"  # attempts
    assert all(" COMPLETED " in rows[f"task-{i}"] and f" {STEPS}/{STEPS} " in rows[f"task-{i}"]
               for i in range(4))
    assert hpcshard("plot", str(root), env=cluster).returncode == 0 and (root / "plot.png").exists()

    # Accounting: the controller forgets a job MinJobAge after it ends; sacct still knows
    # its final state, every run and where it ran.
    wait_for(lambda: forgotten(jobs[3]), 150, f"scontrol to forget job {jobs[3]}")
    status = hpcshard("status", str(task), env=cluster)
    assert status.returncode == 0, status.stderr
    assert f"slurm job {jobs[3]}: COMPLETED, restarts 1" in status.stdout
    assert "(from accounting: the controller has forgotten it)" in status.stdout
    assert "slurm runs (2, from accounting):" in status.stdout
    runs = [line for line in status.stdout.splitlines() if line.startswith(f"  {jobs[3]}.")]
    assert [r.split()[1] for r in runs] == ["REQUEUED", "COMPLETED"] or \
        [r.split()[1] for r in runs] == ["PREEMPTED", "COMPLETED"], runs
    assert f"{jobs[3]}.0: " in status.stdout and f"{jobs[3]}.1: COMPLETED" in status.stdout  # per attempt
    by_id = hpcshard("status", jobs[3], env=cluster)  # the run found through accounting
    assert by_id.returncode == 0 and str(task) in by_id.stdout
    assert " COMPLETED " in hpcshard("status", str(root), env=cluster).stdout
    listed = hpcshard("ls", str(root), env=cluster)
    assert listed.returncode == 0 and listed.stdout.count("COMPLETED") == 4, listed.stdout
