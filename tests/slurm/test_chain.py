"""Chains of runs on the local cluster: a Hugging Face run submitted with `--then
export-hf=DIR --then eval` is exported (a directory `from_pretrained` loads) and evaluated
by jobs of their own once it has ended done, and a run submitted `--after` it waits in the
queue until it has ended; `status` shows both ends of the chain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from tests.conftest import ROOT, hpcshard, wait_for
from tests.slurm.conftest import job_info, state

pytest.importorskip("transformers")

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
HF_SETS = {"steps": 4, "log_every": 1, "warmup_steps": 1, "eval_every": 0, "layers": 2, "batch_size": 4,
           "seq_len": 32, "data": ROOT / "hpcshard", "pattern": "*.py"}


def set_args(values: dict[str, object]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def newest_job(run: Path) -> str:
    return str(json.loads((run / "spec.json").read_text())["jobs"][-1])


@pytest.mark.debug_partition
def test_a_chain_exports_after_training_and_holds_the_next_run(cluster: dict[str, str],
                                                              tmp_path: Path) -> None:
    first, second, out = tmp_path / "first", tmp_path / "second", tmp_path / "hf"
    common = ["--backend", "slurm", "--nodes", "1", "--gpus", "1", "--partition", "debug", "--time", "10:00"]
    sub = hpcshard("submit", *common, "jobs/hf_causal_lm.py", "--run-dir", str(first),
                   "--then", f"export-hf={out}", "--then", "eval", *set_args(HF_SETS), env=cluster)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    assert "then: export-hf" in sub.stdout
    job = newest_job(first)
    export_job, eval_job = (t["jobs"][0] for t in json.loads((first / "chain.json").read_text())["then"])
    after = hpcshard("submit", *common, "jobs/charlm.py", "--run-dir", str(second), "--after", str(first),
                     "--set", "steps=2", "--set", "log_every=1", env=cluster)
    assert after.returncode == 0, after.stdout + after.stderr
    waiting = newest_job(second)
    info = job_info(waiting)
    if state(job) not in DONE:  # (looked at after: the first was going when `info` was read)
        assert info["JobState"] == "PENDING" and f"afterok:{job}" in info.get("Dependency", ""), info
    # else the first ended before it was looked at (4 steps on an idle cluster; Slurm then
    # shows the met dependency as "(null)"): the order of the two runs' records says it below
    status = hpcshard("status", str(second), env=cluster)
    assert f"after: afterok {first.resolve()}" in status.stdout, status.stdout

    jobs = (job, export_job, eval_job, waiting)
    wait_for(lambda: all(state(j) in DONE for j in jobs), 500, "the run, its steps, the run after it")
    assert [state(j) for j in jobs] == ["COMPLETED"] * 4
    # The second run started only once the first had ended done.
    ended = next(r for r in ledger.read(first) if r["event"] == "end")
    began = next(r for r in ledger.read(second) if r["event"] == "start")
    assert ended["reason"] == "done" and began["time"] > ended["time"]

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == HF_SETS["layers"]
    status = hpcshard("status", str(first), env=cluster)
    assert status.returncode == 0, status.stderr
    assert f"then: export-hf {out}: done: step 4 written to {out}" in status.stdout, status.stdout
    assert f"followed by: {second.resolve()} (afterok" in status.stdout, status.stdout
    assert "then: eval: done: eval loss " in status.stdout and "at step 4" in status.stdout, status.stdout


@pytest.mark.debug_partition
def test_a_run_that_fails_fails_its_job_and_holds_back_what_waits_for_it_done(
        cluster: dict[str, str], tmp_path: Path) -> None:
    """A bug in the job (the same again after one restart: not restarted): the run ends
    `bug`, its job FAILED (not
    COMPLETED: submitit's task exits 0 whatever the launcher returns, so before, Slurm
    showed every run's job COMPLETED), and a run queued `--after` it (afterok) never
    starts: Slurm holds it as DependencyNeverSatisfied."""
    first, second = tmp_path / "failing", tmp_path / "after"
    common = ["--backend", "slurm", "--nodes", "1", "--gpus", "1", "--partition", "debug", "--time", "10:00"]
    sub = hpcshard("submit", *common, str(ROOT / "tests" / "jobs" / "faulty.py"), "--run-dir", str(first),
                   "--max-requeues", "0", "--set", "steps=8", "--set", "fail_at=2", "--set", "fail_rank=0",
                   env=cluster)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = newest_job(first)
    after = hpcshard("submit", *common, "jobs/charlm.py", "--run-dir", str(second), "--after", str(first),
                     "--set", "steps=2", env=cluster)
    waiting = newest_job(second) if after.returncode == 0 else ""
    try:
        # (the follower is refused when the first has ended already: then only the job's state)
        assert after.returncode == 0 or "ended" in after.stderr, after.stdout + after.stderr
        wait_for(lambda: state(job) in DONE, 300, "the failing run's job")
        assert state(job) == "FAILED"
        assert [r["reason"] for r in ledger.read(first) if r["event"] == "end"][-1] == "bug"
        if waiting:
            wait_for(lambda: "DependencyNeverSatisfied" in job_info(waiting).get("Reason", ""), 60,
                     "the follower held for ever")
            assert job_info(waiting)["JobState"] == "PENDING"
            assert not [r for r in ledger.read(second) if r["event"] == "start"]
    finally:
        if waiting:
            hpcshard("cancel", str(second), env=cluster)
