"""`hpcshard plan` against measurement: the demo job trained in five shapes (the 2x2
reference here, its resumes on 1x1, 1x2, 1x4 and 3x2 in test_checkpoint); the planner's
per-rank parameter, gradient and optimizer bytes and its checkpoint size must match what
the ranks held and what was committed, within 5%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard.rundir import store
from hpcshard.runtime.planner import make_plan
from tests.conftest import hpcshard, metrics


def assert_planned(run: Path, nodes: int, gpus: int, ckpt_rel: float = 0.05) -> None:
    """The planner's per-rank parameter, gradient and optimizer bytes match what the ranks of
    the run's newest attempt held, and its checkpoint size the newest committed checkpoint,
    within 5% (`ckpt_rel` for the checkpoint)."""
    spec = json.loads((run / "spec.json").read_text())
    measured = [r for r in metrics(run) if r.get("event") == "memory"][-1]
    plan = make_plan(job=spec["job"], sets=spec["sets"], numbers={}, hf_config=None, nodes=nodes,
                     gpus=gpus, sharding="auto", precision=None, ac=None, micro_batch=None,
                     gpu_mem=80 * 2**30)
    predicted = plan["modes"][plan["sharding"]]
    for key in ("params", "grads", "optimizer"):
        assert measured[key] == pytest.approx(predicted[key], rel=0.05), (key, measured, predicted)
    newest = max(store.committed(run / store.CHECKPOINTS), key=lambda c: c.step)
    committed = json.loads((newest.path / store.MANIFEST).read_text())["bytes"]
    assert committed == pytest.approx(plan["checkpoint_bytes"], rel=ckpt_rel), (committed, plan)


def test_planner_matches_the_2x2_reference(uninterrupted: Path) -> None:
    """Also 1x1, 1x2, 1x4 and 3x2: test_checkpoint's resumes on other shapes check their runs."""
    assert_planned(uninterrupted, 2, 2)


def test_plan_command_bad_input_is_one_line() -> None:
    for args, needle in ((["--params", "70Q", "--layers", "80", "--hidden", "8192"],
                          "'70Q' is not a count"),
                         (["--params", "0", "--layers", "80", "--hidden", "8192"], "must be at least 1"),
                         (["--params", "7B", "--layers", "0", "--hidden", "4096"], "--layers 0"),
                         (["jobs/charlm.py", "--gpu-mem", "lots"], "--gpu-mem 'lots' does not parse"),
                         (["jobs/charlm.py", "--nodes", "1", "--gpus", "5"], "does not divide over"),
                         (["jobs/charlm.py", "--gpus", "2", "--set", "tp=4"],
                          "tp=4 does not divide the 2 ranks of a node"),
                         (["--params", "7B", "--layers", "32", "--hidden", "4000", "--heads", "48"],
                          "not divisible by --heads")):
        proc = hpcshard("plan", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, proc.stderr)
