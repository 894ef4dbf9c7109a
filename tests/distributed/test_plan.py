"""`hpcshard plan` against measurement: the demo job trained in three shapes; the planner's
per-rank parameter, gradient and optimizer bytes and its checkpoint size must match what
the ranks held and what was committed, within 5%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard import checkpoints as store
from hpcshard.runtime.planner import make_plan
from tests.conftest import hpcshard, metrics

SETS = {"steps": "2", "log_every": "1", "eval_every": "0", "batch_size": "24", "ckpt_every": "2"}


@pytest.mark.parametrize("nodes,gpus", [(1, 4), (2, 2), (1, 2)])
def test_planner_matches_measured_shards_and_checkpoint(nodes: int, gpus: int,
                                                        tmp_path: Path) -> None:
    run = tmp_path / f"run-{nodes}x{gpus}"
    args = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    proc = hpcshard("submit", "--backend", "local", "--nodes", str(nodes), "--gpus", str(gpus),
                    "jobs/charlm.py", "--run-dir", str(run), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    measured = next(r for r in metrics(run) if r.get("event") == "memory")
    plan = make_plan(job="jobs/charlm.py", sets=SETS, numbers={}, hf_config=None, nodes=nodes,
                     gpus=gpus, sharding="auto", precision=None, ac=None, micro_batch=None,
                     gpu_mem=80 * 2**30)
    predicted = plan["modes"][plan["sharding"]]
    for key in ("params", "grads", "optimizer"):
        assert measured[key] == pytest.approx(predicted[key], rel=0.05), (key, measured, predicted)
    manifest = json.loads((run / store.CHECKPOINTS / store.step_name(2) / store.MANIFEST).read_text())
    committed = manifest["bytes"]
    assert committed == pytest.approx(plan["checkpoint_bytes"], rel=0.05), (committed, plan)


def test_plan_command_bad_input_is_one_line() -> None:
    for args, needle in ((["--params", "70Q", "--layers", "80", "--hidden", "8192"],
                          "'70Q' is not a count"),
                         (["--params", "0", "--layers", "80", "--hidden", "8192"], "must be at least 1"),
                         (["--params", "7B", "--layers", "0", "--hidden", "4096"], "--layers 0"),
                         (["jobs/charlm.py", "--gpu-mem", "lots"], "--gpu-mem 'lots' does not parse"),
                         (["jobs/charlm.py", "--nodes", "1", "--gpus", "5"], "does not divide over"),
                         (["--params", "7B", "--layers", "32", "--hidden", "4000", "--heads", "48"],
                          "not divisible by --heads")):
        proc = hpcshard("plan", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, proc.stderr)
