"""hpcshard on a real Slurm: 2 nodes x 2 (fake) GPUs, torchrun on every node, preemption
by a higher-priority partition, time limits, hard requeues."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from hpcshard.rundir import ledger, store
from tests.conftest import NOT_ABOUT_HANGS, ROOT, hpcshard, sets, step_records, wait_for
from tests.distributed.test_code_snapshot import edit, workspace
from tests.distributed.test_runtime_checkpoint import committed, trained_to
from tests.slurm.conftest import restarts, slurm, wait_state

COUNTER = str(ROOT / "tests" / "scripts" / "counter.py")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def submit(cluster: dict[str, str], run: Path, *args: str) -> str:
    proc = hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                    "--run-dir", str(run), *args, env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(json.loads((run / "spec.json").read_text())["jobs"][-1])


@pytest.mark.debug_partition
def test_demo_runs_as_four_ranks_on_two_nodes(cluster: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "demo"
    proc = hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                    "--run-dir", str(run), "--partition", "debug", "--time", "10:00", "--follow",
                    *sets(steps=8, eval_every=8),
                    env=cluster)
    job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"submitted job {job}" in proc.stdout and f"job {job}: COMPLETED" in proc.stdout
    assert "step 8/8" in proc.stdout  # --follow showed rank 0's log as it grew
    assert wait_state(job, DONE) == "COMPLETED"
    start = next(r for r in ledger.read(run) if r["event"] == "start")
    assert (start["world"], start["nodes"]) == (4, 2)
    meta = json.loads((run / store.CHECKPOINTS / store.step_name(8) / store.MANIFEST).read_text())
    assert meta["mesh"] == [2, 2] and meta["sharding"] == "hybrid"  # replicate across nodes
    hosts = {p.read_text().split()[0] for p in (run / "submitit").glob(f"{job}_*_log.out")}
    assert hosts  # one task per node, each ran its own torchrun
    status = hpcshard("status", str(run), env=cluster)
    assert status.returncode == 0, status.stderr
    assert "COMPLETED" in status.stdout and "step 8/8" in status.stdout
    logs = hpcshard("logs", job, env=cluster)  # by Slurm job id
    assert logs.returncode == 0 and "checkpoint step 8 committed" in logs.stdout

    # `resume` resubmits with the run's own sbatch settings and continues from step 8.
    resumed = hpcshard("resume", str(run), "--set", "steps=10", env=cluster)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    job2 = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    assert job2 != job and wait_state(job2, DONE) == "COMPLETED"
    starts = [r for r in ledger.read(run) if r["event"] == "start"]
    assert starts[-1]["resumed_step"] == 8 and 10 in committed(run)


def test_time_limit_notice_comes_before_the_limit_and_the_job_requeues(cluster: dict[str, str],
                                                                        tmp_path: Path) -> None:
    """Slurm's own --signal before the time limit (not scancel, not a preemption). A script
    that starts in a second and sleeps its steps makes the timing predictable: 2 minutes
    per attempt, the notice 70 s before the end (Slurm sends it a few seconds early and
    enforces the limit ~20 s late), 75 s of steps: the first attempt is stopped by the
    notice, the second finishes from the script's own last save. The runtime's answer to
    the same notice is tested by the preemption tests (the partition sends it too)."""
    run = tmp_path / "timed"
    proc = hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "1", COUNTER,
                    "--run-dir", str(run), "--partition", "low", "--time", "2", "--signal-lead", "70",
                    "--grace", "5", "--requeue-policy", "requeue",
                    "--", "--steps", "150", "--save-every", "10", "--step-seconds", "0.5",
                    env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    assert wait_state(job, DONE, 400) == "COMPLETED"
    records = ledger.read(run)
    ends = [r for r in records if r["event"] == "end"]
    assert len(ends) >= 2 and ends[-1]["reason"] == "done" and ends[-1]["saved_step"] == 150, ends
    # Every attempt but the last stopped on its notice. On a loaded host the two nodes' notices
    # can come seconds apart, and a fault one node sees meanwhile makes that stop the
    # decider's ("a stop notice came as well"): requeued all the same, from the same save.
    faults = [r for r in records if r["event"] == "fault"]
    assert all(e["reason"] == "stop" for e in ends[:-1]), (ends, faults)
    assert any("after the notice" in e["how"] for e in ends[:-1]), (ends, faults)
    assert restarts(job) == len(ends) - 1
    start = next(r for r in records if r["event"] == "start")
    log = (run / "logs" / "rank-0.log").read_text()
    deadline = float(log.split("deadline ", 1)[1].split()[0])
    assert 60 < deadline - start["time"] < 150  # HPCSHARD_DEADLINE: the end of --time 2
    status = hpcshard("status", str(run), env=cluster)
    assert status.stdout.count("stop") >= len(ends) - 1  # the ledger shows every attempt


@pytest.mark.debug_partition
def test_hard_requeue_without_notice_resumes_from_the_last_periodic_checkpoint(
        cluster: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "hard"
    job = submit(cluster, run, "--partition", "debug", "--time", "10:00", "--requeue-policy", "requeue",
                 *sets(steps=24, ckpt_every=4, **NOT_ABOUT_HANGS))
    wait_for(lambda: 8 in committed(run) and trained_to(run, 10), 240, "a periodic checkpoint")
    before = max(committed(run))
    slurm("scontrol", "requeue", job)  # no notice: Slurm kills the tasks outright
    assert wait_state(job, DONE, 400) == "COMPLETED"
    starts = [r for r in ledger.read(run) if r["event"] == "start"]
    assert len(starts) == 2
    # The newest periodic checkpoint at the kill (one more may have committed meanwhile).
    assert starts[1]["resumed_step"] in (before, before + 4)
    # No notice, so no stop: the killed attempt records no end, or, when rank 0 outlives a
    # peer on the other node by a moment, the collective error it saw.
    ends = [r for r in ledger.read(run) if r["event"] == "end"]
    assert [(e["attempt"], e["reason"]) for e in ends][-1] == (1, "done")
    assert all(e["reason"] == "error" and ("Connection closed by peer" in e["error"]
                                           or "Connection reset by peer" in e["error"]) for e in ends[:-1])


def test_sbatch_refusal_is_one_line_with_slurms_message(cluster: dict[str, str],
                                                        tmp_path: Path) -> None:
    run = tmp_path / "refused"
    proc = hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                    "--run-dir", str(run), "--constraint", "nosuchfeature", env=cluster)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("warning:")]
    assert len(errors) == 1 and errors[0].startswith("Error: sbatch refused the job: ")
    assert "Invalid feature specification" in errors[0]  # Slurm's own words, once
    assert not run.exists()


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "3"], "more than the nodes of partition 'low' have (2)"),
    (["--nodes", "3"], "more than partition 'low' has (2)"),
    (["--partition", "gpu-huge"], "'gpu-huge' does not exist; partitions: debug, high, low"),
    (["--time", "1h"], "is not a Slurm time limit"),
    (["--time", "2", "--signal-lead", "200"], "not shorter than the time limit"),
    (["--account", "nosuchaccount", "--qos", "x\ny"], "contains a newline"),
])
def test_bad_requests_are_refused_before_submission(cluster: dict[str, str], tmp_path: Path,
                                                    args: list[str], needle: str) -> None:
    run = tmp_path / "never"
    base = ["submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
            "--run-dir", str(run)]
    # later options win: the bad one overrides the base shape
    proc = hpcshard(*base, *args, env=cluster)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr and not run.exists()


def test_chain_policy_continues_in_new_jobs_where_requeue_is_forbidden(
        cluster: dict[str, str], tmp_path: Path) -> None:
    """Preempted twice: two continuation jobs in a row (each submitted from the script the
    one before it was given), and the run ends as one uninterrupted. The job, a copy of the
    demo outside the repository, is edited as soon as it is submitted: each of the three
    jobs runs the code submitted (`cli.snapshot`), the continuations too."""
    run, work = tmp_path / "chained", workspace(tmp_path)
    proc = hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", str(work / "job.py"),
                    "--run-dir", str(run), "--time", "10:00", "--requeue-policy", "chain",
                    *sets(steps=30, ckpt_every=4, **NOT_ABOUT_HANGS), env=cluster, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edit(work)
    job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    assert "#SBATCH --no-requeue" in (run / "submitit" / f"{job}_submission.sh").read_text()
    jobs = lambda: json.loads((run / "spec.json").read_text())["jobs"]  # noqa: E731
    for n, step in ((2, 6), (3, 14)):
        wait_for(partial(trained_to, run, step), 300, f"training to step {step}")
        slurm("sbatch", "-p", "high", "-N2", "--gpus-per-node=2", "-o", "/dev/null", "--wrap", "sleep 2")
        wait_for(partial(lambda count: len(jobs()) == count, n), 120, f"continuation job {n - 1}")
    first, second = jobs()[1:]
    assert wait_state(second, DONE, 400) == "COMPLETED"
    assert restarts(job) == restarts(first) == 0  # nothing was requeued
    records = ledger.read(run)
    ends = [r for r in records if r["event"] == "end"]
    starts = [r for r in records if r["event"] == "start"]
    assert [e["reason"] for e in ends] == ["stop", "stop", "done"]
    assert [s["attempt"] for s in starts] == [0, 1, 2]
    assert [r["next"] for r in records if r["event"] == "chain"] == [first, second]
    for start, end in zip(starts[1:], ends, strict=False):
        assert start["resumed_step"] == end["saved_step"] == end["step"]
    assert [r["step"] for r in step_records(run)] == list(range(1, 31))
    for each in (job, first, second):
        printed = "".join(p.read_text() for p in (run / "submitit").glob(f"{each}_*_log.out"))
        assert "code tag A" in printed and "code tag B" not in printed and "code tag C" not in printed, each


@pytest.mark.debug_partition
def test_requeue_cap_gives_up_with_a_clear_final_state(cluster: dict[str, str],
                                                      tmp_path: Path) -> None:
    run = tmp_path / "capped"
    job = submit(cluster, run, "--partition", "debug", "--time", "10:00", "--max-requeues", "0",
                 *sets(steps=200))
    wait_for(lambda: trained_to(run, 3), 240, "training to start")
    # `hpcshard preempt` on a Slurm run goes through Slurm (scancel --signal), not local pids.
    preempt = hpcshard("preempt", str(run), env=cluster)
    assert preempt.returncode == 0 and f"Slurm job {job}" in preempt.stdout
    wait_for(lambda: any(r["event"] == "gave_up" for r in ledger.read(run)), 120, "the give-up")
    assert wait_state(job, DONE | {"PENDING"}, 120) == "FAILED"  # (not done: afterok never starts)
    assert restarts(job) == 0
    status = hpcshard("status", str(run), env=cluster)
    assert "gave up: the cap of 0 is reached" in status.stdout
