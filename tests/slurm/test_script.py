"""Bring your own script on the real local Slurm cluster: the plain FSDP2 example with
hpcshard.preemption survives a preemption bit for bit; a script that ignores the notice is
requeued exactly once and its ledger names what it lost; a script whose framework
requeues the job itself (as Lightning does) is not requeued a second time."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from hpcshard.rundir import ledger
from tests.conftest import ROOT, hpcshard, wait_for
from tests.slurm.conftest import restarts, slurm, wait_state
from tests.slurm.test_launch_slurm import DONE

EXAMPLE = ROOT / "examples" / "own_loop"
COUNTER = str(ROOT / "tests" / "scripts" / "counter.py")


def submit_script(cluster: dict[str, str], run: Path, script: str, *args: str) -> str:
    proc = hpcshard("submit", "--backend", "slurm", "--run-dir", str(run), script, *args,
                    env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(json.loads((run / "spec.json").read_text())["jobs"][-1])


def log_has(run: Path, text: str) -> bool:
    log = run / "logs" / "rank-0.log"
    return log.exists() and text in log.read_text()


def test_own_loop_example_preempted_ends_with_the_uninterrupted_weights(
        cluster: dict[str, str], tmp_path: Path) -> None:
    args = ["--steps", "30", "--save-every", "20"]
    # Reference: the unmodified plain script, uninterrupted, on the same 2x2 shape (local).
    ref = tmp_path / "plain"
    proc = hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "2",
                    str(EXAMPLE / "plain.py"), "--run-dir", str(ref), "--", *args,
                    "--ckpt-dir", str(ref / "own"), "--final", str(ref / "final.pt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run = tmp_path / "preempted"
    job = submit_script(cluster, run, str(EXAMPLE / "train.py"), "--nodes", "2", "--gpus", "2",
                        "--time", "10:00", "--requeue-policy", "requeue", "--", *args,
                        "--final", str(run / "final.pt"), "--step-seconds", "0.2")
    wait_for(lambda: log_has(run, "step 10 "), 240, "training to reach step 10")
    # A job in the high partition needs every GPU: Slurm preempts ours (notice, then requeue).
    slurm("sbatch", "-p", "high", "-N2", "--gpus-per-node=2", "-o", "/dev/null", "--wrap", "sleep 2")
    assert wait_state(job, DONE, 400) == "COMPLETED"
    assert restarts(job) == 1
    records = ledger.read(run)
    stop, done = [r for r in records if r["event"] == "end"]
    assert stop["reason"] == "stop" and "REQUEUE" in stop["how"]
    assert 10 <= stop["saved_step"] < 30 and stop["saved_step"] != 20  # saved on the notice
    assert done["reason"] == "done"
    mine, theirs = torch.load(run / "final.pt"), torch.load(ref / "final.pt")
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def test_a_script_ignoring_the_notice_is_requeued_exactly_once(cluster: dict[str, str],
                                                               tmp_path: Path) -> None:
    run = tmp_path / "ignores"
    submitted = time.time()
    job = submit_script(cluster, run, COUNTER, "--nodes", "2", "--gpus", "1", "--time", "10:00",
                        "--requeue-policy", "requeue",
                        "--script-signal", "none", "--grace", "3", "--",
                        "--steps", "48", "--save-every", "8", "--step-seconds", "0.4")
    # Noticed at step 3, killed about 8 steps later (more on a loaded machine: the notice
    # goes through the CLI, scancel and slurmd), after at least the save at step 8.
    wait_for(lambda: log_has(run, "rank 0 step 3\n"), 240, "step 3")
    assert hpcshard("preempt", str(run), env=cluster).returncode == 0
    assert wait_state(job, DONE, 300) == "COMPLETED"
    assert restarts(job) == 1
    records = ledger.read(run)
    assert len([r for r in records if r["event"] == "requeue"]) == 1
    stop, done = [r for r in records if r["event"] == "end"]
    assert stop["reason"] == "stop" and stop["how"] == "killed 3s after the notice (the grace period)"
    saved = stop["saved_step"]
    assert saved >= 8 and saved % 8 == 0 and stop["saved"] == f"checkpoint-{saved}.json"
    assert stop["lost_seconds"] > 0
    log = (run / "logs" / "rank-0.log").read_text()
    first_attempt = log[:log.index(f"starts after step {saved}")]
    reached = max(int(n) for n in re.findall(r"rank 0 step (\d+)\n", first_attempt))
    # The steps since its own last save were lost, as the ledger says (none when the kill
    # lands just after a save: under load it came right after the save at step 16).
    assert reached >= saved
    assert done["reason"] == "done" and done["saved_step"] == 48
    deadline = float(re.search(r"deadline ([0-9.]+)", log).group(1))  # type: ignore[union-attr]
    assert submitted + 9 * 60 < deadline < submitted + 11 * 60 + 30  # --time 10:00
    assert "deadline None" not in log
    status = hpcshard("status", str(run), env=cluster).stdout
    assert "stop" in status and "done" in status


def test_a_framework_that_requeues_itself_is_not_requeued_twice(cluster: dict[str, str],
                                                                tmp_path: Path) -> None:
    run = tmp_path / "self-requeue"
    job = submit_script(cluster, run, COUNTER, "--nodes", "2", "--gpus", "1", "--time", "10:00",
                        "--requeue-policy", "requeue",
                        "--script-signal", "USR1", "--grace", "20", "--",
                        "--steps", "24", "--save-every", "4", "--step-seconds", "0.4",
                        "--requeue-on-usr1")
    wait_for(lambda: log_has(run, "rank 0 step 6\n"), 240, "step 6")
    assert hpcshard("preempt", str(run), env=cluster).returncode == 0
    assert wait_state(job, DONE, 300) == "COMPLETED"
    assert restarts(job) == 1  # Slurm counted one requeue: the script's own
    log = (run / "logs" / "rank-0.log").read_text()
    assert "SIGUSR1: requeueing myself" in log
    requeues = [r for r in ledger.read(run) if r["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["by"] == "the job itself", requeues
