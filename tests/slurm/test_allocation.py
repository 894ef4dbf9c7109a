"""`hpcshard run` inside an allocation the user holds (salloc on the debug partition's
nodes): the run is a step of it, stopped by the allocation's notice with a checkpoint,
told how to go on, and resumed in a new allocation to the end an uninterrupted run
reaches; a run over while a frozen node holds its step ends that step, not the allocation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from hpcshard.rundir.rankenv import REQUEUE_EXIT
from tests.conftest import NOT_ABOUT_HANGS, ROOT, STEPS, hpcshard, quiet_env, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load, trained_to
from tests.slurm.conftest import freeze, slurm, state, story
from tests.slurm.test_faults import heartbeat

HPCSHARD = [sys.executable, "-m", "hpcshard"]


def salloc(cluster: dict[str, str], nodes: int, *command: str) -> list[str]:
    """salloc on the debug partition running `command` (no shell, no tty needed)."""
    return ["salloc", "-p", "debug", "-N", str(nodes), "--gpus-per-node=2", "--time", "10", *command]


def held(cluster: dict[str, str], nodes: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(salloc(cluster, nodes, *HPCSHARD, *args), cwd=ROOT, env=quiet_env(**cluster),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.debug_partition
def test_a_run_in_a_held_allocation_stops_on_its_notice_and_resumes_in_another_bitwise(
        cluster: dict[str, str], uninterrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "held"
    # 2 nodes x 2 GPUs: the allocation's shape, not asked for (the reference's: 2x2).
    proc = subprocess.Popen(salloc(cluster, 2, *HPCSHARD, "run", "jobs/charlm.py", "--run-dir", str(run),
                                   *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS,
                                         **NOT_ABOUT_HANGS)),
                            cwd=ROOT, env=quiet_env(**cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: trained_to(run, 6), 240, "step 6 in the allocation")
        spec = json.loads((run / "spec.json").read_text())
        (job,) = spec["jobs"]  # the allocation's own job: no new one
        assert (spec["backend"], spec["nodes"], spec["gpus"]) == ("allocation", 2, 2)
        status = hpcshard("status", str(run), env=cluster)
        assert f"slurm job {job}: RUNNING" in status.stdout and "backend allocation" in status.stdout
        # The time limit's notice as Slurm sends it (salloc --signal): to the steps.
        slurm("scancel", "--signal=USR2", job)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == REQUEUE_EXIT, out[-4000:]
    assert f"continue with: hpcshard resume {run} inside an allocation" in out, out[-4000:]
    stop = ledger.end_of(run, 0)
    assert stop is not None and stop["reason"] == "stop" and stop["saved_step"] == stop["step"] < STEPS
    assert not any(r["event"] in ("requeue", "chain", "gave_up") for r in ledger.read(run))

    # In a new allocation; stopped again by `hpcshard preempt`, which finds the run's step
    # by its name and signals that step alone (the allocation lives on: salloc's command
    # ends it).
    proc = subprocess.Popen(salloc(cluster, 2, *HPCSHARD, "resume", str(run)), cwd=ROOT,
                            env=quiet_env(**cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_for(lambda: trained_to(run, stop["saved_step"] + 1), 240, "training in the second allocation")
        preempt = hpcshard("preempt", str(run), env=cluster)
        assert preempt.returncode == 0 and "to step " in preempt.stdout, preempt.stdout + preempt.stderr
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == REQUEUE_EXIT, out[-4000:]
    again = ledger.end_of(run, 1)
    assert again is not None and again["reason"] == "stop" and again["saved_step"] > stop["saved_step"]

    resumed = held(cluster, 2, "resume", str(run))
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    jobs = json.loads((run / "spec.json").read_text())["jobs"]
    assert len(jobs) == 3 and jobs[0] == job  # each allocation it ran in
    starts = [r for r in ledger.read(run) if r["event"] == "start"]
    assert [s["attempt"] for s in starts] == [0, 1, 2]
    assert [s["resumed_step"] for s in starts[1:]] == [stop["saved_step"], again["saved_step"]]
    assert [r["step"] for r in step_records(run)] == list(range(1, STEPS + 1))  # nothing lost or redone
    assert_bitwise_equal(load(committed(run)[STEPS]), load(committed(uninterrupted)[STEPS]), "the end")
    shown = hpcshard("status", str(run), env=cluster).stdout
    assert f"slurm job {jobs[-1]}" in shown and shown.count(" stop ") >= 2, shown
    logs = hpcshard("logs", str(run), "--rank", "0", env=cluster).stdout
    assert all(f"==> attempt {a}" in logs for a in (0, 1, 2)), logs[-3000:]


@pytest.mark.debug_partition
def test_a_shape_larger_than_the_held_allocation_is_one_line(cluster: dict[str, str], tmp_path: Path) -> None:
    """What salloc's shell really says of its GPUs (--gpus-per-node) is read."""
    run = tmp_path / "never"
    for args, needle in ((["--gpus", "3"], "--gpus 3 is more than allocation"),
                         (["--nodes", "2"], "--nodes 2 is more than the allocation holds")):
        proc = held(cluster, 1, "run", "jobs/charlm.py", "--run-dir", str(run), *args)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
        assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr
        assert not run.exists()


@pytest.mark.debug_partition
def test_a_run_over_with_a_frozen_node_ends_its_step_within_seconds(cluster: dict[str, str],
                                                                     tmp_path: Path) -> None:
    """2 nodes and a spare in `salloc -N 3`; every process of the second launcher's node is
    stopped. The spare takes its place and the run ends done, while srun waits for the
    frozen node's task (until Slurm marks it DOWN: SlurmdTimeout, 300 s here as on most
    sites). The command cancels its own step once the kept launchers have exited and
    returns with the run's code within seconds of the run's end; the allocation is not
    cancelled and no node is set DOWN (salloc ends it when the command returns)."""
    run = tmp_path / "frozen"
    proc = subprocess.Popen(salloc(cluster, 3, *HPCSHARD, "run", "jobs/charlm.py", "--run-dir", str(run),
                                   "--nodes", "2", "--spares", "1",
                                   *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS,
                                         **NOT_ABOUT_HANGS)),
                            cwd=ROOT, env=quiet_env(**cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    victim = ""
    try:
        wait_for(lambda: trained_to(run, 7), 240, "step 7, past the warm-up and a commit")
        (job,) = json.loads((run / "spec.json").read_text())["jobs"]
        victim = heartbeat(run, 1)["slurm_node"]
        assert len(freeze(victim)) >= 3
        try:
            wait_for(lambda: (ledger.end_of(run, 0) or {}).get("reason") == "done", 300, "the run's end")
            ended_at = float((ledger.end_of(run, 0) or {})["time"])
            out, _ = proc.communicate(timeout=240)
            returned_at = time.time()
            print(f"run's end -> hpcshard run returned: {returned_at - ended_at:.1f} s")
            assert proc.returncode == 0, out[-4000:] + story(run)
            assert returned_at - ended_at < 90, "it waited for SlurmdTimeout"  # (300 s)
            assert f"cancelled step {job}." in out and f"allocation {job} is still yours" in out, out[-4000:]
            node = slurm("sinfo", "-h", "-n", victim, "-o", "%t").strip()
            assert not node.startswith("down"), node  # drained (bad_nodes = drain), never DOWN
        finally:
            freeze(victim, signal.SIGCONT)
        (cancel,) = [r for r in ledger.read(run) if r["event"] == "cancel"]
        assert cancel["job"].startswith(f"{job}.") and victim in cancel["reason"]
        assert "by hpcshard run" in cancel["reason"] and cancel["time"] >= ended_at
        (fault,) = [r for r in ledger.read(run) if r["event"] == "fault"]
        assert fault["lost"] == [1] and fault["active"] == [0, 2]
        print(f"allocation {job} after the command: {state(job)}")
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim:
            subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"],
                           env=quiet_env(**cluster), capture_output=True)
