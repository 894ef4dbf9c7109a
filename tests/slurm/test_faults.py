"""Faults inside a real Slurm allocation: a rank killed on one node is restarted with every
other rank, in place, by the node launchers that srun started (no requeue, same job)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch.liveness import LOST_S
from hpcshard.launch.procs import ranks_below
from hpcshard.rundir import ledger
from hpcshard.rundir.launchers import guards, launchers
from tests.conftest import NOT_ABOUT_HANGS, STEPS, hpcshard, hpcshard_bg, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
    trained_to,
)
from tests.slurm.conftest import SCRIPT, freeze, restarts, slurm, state, story, wait_state
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
                 *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS, **NOT_ABOUT_HANGS))
    wait_for(lambda: 4 in committed(run) and trained_to(run, 6), 240, "step 6, past the commit of step 4")
    wait_for(lambda: len(rank_pids(run)) == 4, 30, "the 4 ranks under the 2 node launchers")
    # A rank of the second task's launcher (c10d numbers agents by arrival: its ranks may
    # be 0 and 1, so go by the launcher, not by the rank).
    victim = ranks_below([launchers(run)[1]])[-1]
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


HEALTH = ('f="$HPCSHARD_RUN_DIR/first-node"; [ -e "$f" ] || echo "$SLURMD_NODENAME" > "$f"; '
          'if [ "$(cat "$f")" = "$SLURMD_NODENAME" ]; then echo "bad on purpose" >&2; exit 1; fi')
"""A site health check that fails on the first node it ever runs on, and on no other."""


@pytest.mark.debug_partition
def test_a_node_failing_the_health_check_is_excluded_and_never_used_again(
        cluster: dict[str, str], tmp_path: Path) -> None:
    """The profile's health check fails on the node the job first lands on: that node is
    bad for the run (ledger, status), the run goes on in a continuation job that excludes
    it (requeue_policy chain, the default) and trains on another node, before any step is
    lost. (The requeue policy's road, `ExcNodeList` on the same job, is the spare test's
    and the bench's.)"""
    site = tmp_path / "site.toml"
    site.write_text(f"[defaults]\nhealth_check = '{HEALTH}'\n")
    run = tmp_path / "health"
    proc = hpcshard("submit", "--backend", "slurm", "--nodes", "1", "--gpus", "2", "jobs/charlm.py",
                    "--run-dir", str(run), "--partition", "debug", "--time", "10:00",
                    *sets(steps=6, ckpt_every=3), env={**cluster, "HPCSHARD_SITE": str(site)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    wait_for(lambda: (run / "first-node").exists(), 120, "the first health check")
    first = (run / "first-node").read_text().strip()
    jobs = lambda: json.loads((run / "spec.json").read_text())["jobs"]  # noqa: E731
    try:
        wait_for(lambda: len(jobs()) == 2, 120, "the continuation job")
        assert wait_state(jobs()[1], DONE, 400) == "COMPLETED"
        # Drained in Slurm with the reason (root may: bad_nodes = "drain", the default).
        assert "bad on purpose" in slurm("sinfo", "-R", "-h", "-n", first, "-o", "%E")
    finally:
        slurm("scontrol", "update", f"NodeName={first}", "State=RESUME")
    records = ledger.read(run)
    (bad,) = [r for r in records if r["event"] == "bad_node"]
    assert bad["slurm_node"] == first and "bad on purpose" in bad["reason"] and bad["drained"]
    (chained,) = [r for r in records if r["event"] == "chain"]
    assert chained["job"] == job and chained["next"] == jobs()[1]
    assert restarts(job) == 0
    shown = slurm("scontrol", "show", "job", "-o", jobs()[1])
    assert f"ExcNodeList={first}" in shown and f" NodeList={first} " not in shown
    assert [r["attempt"] for r in records if r["event"] == "start"] == [1]  # never trained there
    assert [r["step"] for r in step_records(run)] == list(range(1, 7))
    status = hpcshard("status", str(run), env=cluster).stdout
    assert "bad nodes (1)" in status and first in status


def heartbeat(run: Path, node: int) -> dict[str, Any]:
    """The newest heartbeat of launcher `node` (it says which Slurm node it runs on)."""
    found: dict[str, Any] = json.loads((run / "launch" / f"alive-0-{node}.json").read_text())
    return found


@pytest.mark.debug_partition
def test_a_frozen_node_is_replaced_by_the_spare_and_the_job_ends_with_the_run(
        cluster: dict[str, str], uninterrupted: Path, tmp_path: Path) -> None:
    """2 nodes and a spare (`--spares 1`: 3 nodes, --no-kill). Every process of the second
    launcher's node is stopped: Slurm hears nothing from it. The launchers declare it lost
    within seconds, drain it in Slurm with the reason, and the spare takes its place in the
    same job: the run ends bitwise equal to an uninterrupted one. The node stays frozen: the
    job step would wait for its task, and the job for the node, until Slurm marks it DOWN
    after SlurmdTimeout (300 s, Slurm's default, on the local cluster too; 380 to 460 s
    measured). Once the run is done a launcher writes the release for the batch script, which
    sets the node DOWN while srun still waits (`launch.release`, the template's watch): the
    job ends COMPLETED within seconds, and `submit --follow` returns at the run's end."""
    run = tmp_path / "spare"
    follow = hpcshard_bg("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                         "--run-dir", str(run), "--partition", "debug", "--time", "10:00", "--spares", "1",
                         "--follow", *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS,
                                           **NOT_ABOUT_HANGS),
                         env=cluster)
    victim = ""
    try:
        wait_for(lambda: (run / "spec.json").exists() and json.loads((run / "spec.json").read_text())["jobs"],
                 120, "the job")
        job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
        wait_for(lambda: trained_to(run, 7), 240, "step 7, past the warm-up and a commit")
        victim = heartbeat(run, 1)["slurm_node"]
        frozen = freeze(victim)
        frozen_at = time.time()
        try:
            assert len(frozen) >= 3  # slurmd, a slurmstepd, the launcher and what is below it
            wait_for(lambda: (ledger.end_of(run, 0) or {}).get("reason") == "done", 300, "the run's end")
            ended_at = float((ledger.end_of(run, 0) or {})["time"])
            followed_at = released_at = 0.0
            deadline = time.monotonic() + 240
            while not (followed_at and released_at) and time.monotonic() < deadline:
                followed_at = followed_at or (time.time() if follow.poll() is not None else 0.0)
                released_at = released_at or (time.time() if state(job) in DONE else 0.0)
                time.sleep(0.5)
            out = follow.communicate(timeout=10)[0]
            print(f"run's end -> job ended: {released_at - ended_at:.1f} s; -> --follow returned: "
                  f"{followed_at - ended_at:.1f} s")
            assert released_at and released_at - ended_at < 90, "the job waited for SlurmdTimeout"
            assert followed_at and followed_at - ended_at < 60 and follow.returncode == 0, out
            assert state(job) == "COMPLETED" and restarts(job) == 0  # the spare took the node's place
        finally:
            freeze(victim, signal.SIGCONT)
        records = ledger.read(run)
        (fault,) = [r for r in records if r["event"] == "fault"]
        assert fault["restart"] and fault["lost"] == [1] and fault["active"] == [0, 2]
        assert fault["declared"] - frozen_at < LOST_S + 6  # lost within seconds, from its silence
        (bad,) = [r for r in records if r["event"] == "bad_node"]
        assert bad["slurm_node"] == victim and bad["drained"]
        (back,) = [r for r in records if r["event"] == "recovered"]
        assert back["seconds"] < 90  # (not DOWN_TIMEOUT_S, 120 s; loose: 4 ranks restart slowly under load)
        (released,) = [r for r in records if r["event"] == "cancel"]
        assert released["job"] == f"{job}.0" and victim in released["reason"]
        assert released["time"] >= ended_at  # the end (after the last commit) came first
        # From the batch script (outside the step: proctrack/cgroup kills no part of it), not
        # from a helper the launcher left behind.
        assert "the batch script is asked" in released["reason"], released
        batch_log = (run / "logs" / f"slurm-{job}.err").read_text()
        assert f"hpcshard (batch host): {victim} set DOWN: step {job}.0 ends now" in batch_log, batch_log
        launcher_logs = "".join(p.read_text() for p in (run / "submitit").glob(f"{job}_*_log.err"))
        assert "a helper left by this launcher" not in launcher_logs
        reference, mine = committed(uninterrupted), committed(run)
        assert STEPS in mine
        for step, path in mine.items():
            assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
        assert "hpcshard" in slurm("sinfo", "-R", "-h", "-n", victim, "-o", "%E")  # what an admin reads
    finally:
        if follow.poll() is None:
            follow.kill()
        if victim:
            slurm("scontrol", "update", f"NodeName={victim}", "State=RESUME")


@pytest.mark.debug_partition
def test_a_batch_node_set_down_ends_the_job_and_its_guard_takes_the_run_over(
        cluster: dict[str, str], uninterrupted: Path, tmp_path: Path) -> None:
    """`scontrol update State=DOWN` of the node that runs the batch script (an admin, a
    health daemon): Slurm kills the batch step with it, and a --no-kill job FAILS without
    a requeue. The job's guard (held with afternotok since the job started) takes the run
    over on the 2 nodes left, without the spare: the run ends bitwise equal to an
    uninterrupted one, and the guard's own guard is dropped by Slurm once it completes."""
    run = tmp_path / "guarded"
    job = submit(cluster, run, "--partition", "debug", "--time", "10:00", "--spares", "1",
                 *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS, **NOT_ABOUT_HANGS))
    wait_for(lambda: trained_to(run, 7), 240, "step 7, past the commit of step 4")
    (guard,) = guards(run)
    assert state(guard) == "PENDING"
    batch = heartbeat(run, 0)["slurm_node"]
    slurm("scontrol", "update", f"NodeName={batch}", "State=DOWN", "Reason=test: batch node down")
    try:
        assert wait_state(job, DONE, 120) == "FAILED"
        assert wait_state(guard, DONE, 300) == "COMPLETED"
    finally:  # (ReturnToService=2 may have brought it back already: RESUME then fails)
        subprocess.run(["scontrol", "update", f"NodeName={batch}", "State=RESUME"],
                       env={**os.environ, **cluster}, capture_output=True)
    records = ledger.read(run)
    (took,) = [r for r in records if r["event"] == "guard"]
    assert took["job"] == job and took["next"] == guard and took["attempt"] == 0
    assert json.loads((run / "spec.json").read_text())["jobs"] == [job, guard]
    starts = [r for r in records if r["event"] == "start"]
    assert [(s["attempt"], s["nodes"]) for s in starts] == [(0, 2), (1, 2)]
    reference, mine = committed(uninterrupted), committed(run)
    assert STEPS in mine and starts[1]["resumed_step"] in mine
    for step, path in mine.items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
    status = hpcshard("status", str(run), env=cluster).stdout
    assert f"guard job {guard} took the run over" in status
    second = guards(run)[-1]
    assert second != guard and wait_state(second, {"CANCELLED"}, 60) == "CANCELLED"


@pytest.mark.debug_partition
def test_a_killed_node_without_a_spare_leaves_the_run_on_fewer_nodes(
        cluster: dict[str, str], uninterrupted: Path, tmp_path: Path) -> None:
    """--min-nodes 1 and no spare: every process of node 1 SIGKILLed, its slurmd included (a
    dead node: Slurm itself hears nothing for SlurmdTimeout). Node 0's launcher declares it
    lost within seconds and the run goes on inside the allocation on node 0 alone (1x2: the
    mesh planned again, DCP reshards the 2x2 checkpoint), every step seeing the same global
    batch it would have seen on 2x2."""
    run = tmp_path / "fewer"
    job = submit(cluster, run, "--partition", "debug", "--time", "10:00", "--min-nodes", "1",
                 *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS, **NOT_ABOUT_HANGS))
    wait_for(lambda: trained_to(run, 7), 240, "step 7, past the warm-up and a commit")
    victim = heartbeat(run, 1)["slurm_node"]
    assert freeze(victim, signal.SIGKILL)
    killed_at = time.time()
    try:
        wait_for(lambda: (ledger.end_of(run, 0) or {}).get("reason") == "done", 300, "the run's end")
    finally:  # the dead node's task holds the job until SlurmdTimeout: cancel it, bring n back
        hpcshard("cancel", str(run), env=cluster)
        subprocess.run([str(SCRIPT), "revive", victim], capture_output=True, timeout=60)
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"],
                       env={**os.environ, **cluster}, capture_output=True)
    records = ledger.read(run)
    (fault,) = [r for r in records if r["event"] == "fault"]
    assert fault["restart"] and fault["active"] == [0] and "going on with 1 nodes" in fault["reason"]
    assert fault["lost"] == [1] and fault["declared"] - killed_at < 12
    assert [(r["attempt"], r["cycle"], r["world"]) for r in records if r["event"] == "start"] == [
        (0, 0, 4), (0, 1, 2)]
    assert restarts(job) == 0 and not any(r["event"] == "guard" for r in records)
    resumed = [r for r in records if r["event"] == "start"][-1]["resumed_step"]
    losses = {r["step"]: r["loss"] for r in step_records(run)}
    reference = {r["step"]: r["loss"] for r in step_records(uninterrupted)}
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(resumed + 1, STEPS + 1):  # another world size: another reduction order
        assert losses[step] == pytest.approx(reference[step], rel=2e-4), step


@pytest.mark.debug_partition
def test_a_frozen_batch_node_without_a_spare_continues_in_a_new_job(
        cluster: dict[str, str], uninterrupted: Path, tmp_path: Path) -> None:
    """No spare, the default chain policy: the node that runs the batch script freezes.
    Node 1's launcher declares it lost, decides alone, submits the continuation without it
    (at once, not after the job: Slurm holds a job whose step sits on a frozen node), cancels
    the job and marks the node DOWN, which ends the job at once instead of after
    SlurmdTimeout. The continuation trains on the 2 other nodes; the run ends
    bitwise equal. (With --no-kill the job would stay RUNNING on the nodes left, its batch
    script on the frozen node: then it is also cancelled. The chaos soak meets that.)"""
    run = tmp_path / "orphan"
    job = submit(cluster, run, "--partition", "debug", "--time", "10:00",
                 *sets(steps=STEPS, ckpt_every=4, keep_last=100, eval_every=STEPS, **NOT_ABOUT_HANGS))
    wait_for(lambda: trained_to(run, 7), 240, "step 7, past the commit of step 4")
    batch = heartbeat(run, 0)["slurm_node"]
    jobs = lambda: json.loads((run / "spec.json").read_text())["jobs"]  # noqa: E731
    freeze(batch)
    try:
        assert wait_state(job, DONE, 120) in ("NODE_FAIL", "CANCELLED"), story(run)
        wait_for(lambda: len(jobs()) == 2, 30, "the continuation job")
        assert wait_state(jobs()[1], DONE, 300) == "COMPLETED", story(run)
    finally:
        freeze(batch, signal.SIGCONT)
        subprocess.run(["scontrol", "update", f"NodeName={batch}", "State=RESUME"],
                       env={**os.environ, **cluster}, capture_output=True)
    records = ledger.read(run)
    (chained,) = [r for r in records if r["event"] == "chain"]
    assert chained["job"] == job and chained["next"] == jobs()[1]
    assert chained.get("at_once")  # not after the orphan: Slurm holds it ~60 s once cancelled
    assert [r["slurm_node"] for r in records if r["event"] == "node_down"] == [batch]
    assert f"ExcNodeList={batch}" in slurm("scontrol", "show", "job", "-o", jobs()[1])
    reference, mine = committed(uninterrupted), committed(run)
    assert STEPS in mine
    for step, path in mine.items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")


def test_bad_nodes_that_leave_the_partition_too_small_are_refused_before_submitting(
        cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`hpcshard resume` asks for the partition without the run's bad nodes: with 2 of
    debug's 3 nodes excluded, a 2-node request is one line, and a 1-node one fits."""
    from hpcshard.slurm import cluster as slurm_cluster
    from hpcshard.slurm.sbatch import SbatchRequest

    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    nodes = slurm("sinfo", "-h", "-N", "-p", "debug", "-o", "%N").split()
    assert slurm_cluster.usable_nodes("debug", nodes[:1]) == len(nodes) - 1
    req = SbatchRequest(job_name="x", nodes=2, gpus_per_node=1, partition="debug", exclude=nodes[:2])
    with pytest.raises(ValueError, match="leave partition 'debug' 1 node"):
        slurm_cluster.check_request(req)
    assert slurm_cluster.check_request(SbatchRequest(job_name="x", nodes=1, gpus_per_node=1,
                                                     partition="debug", exclude=nodes[:2])) == "debug"
