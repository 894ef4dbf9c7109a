"""The examples run as a user would run them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, hpcshard, quiet_env


def test_own_loop_example_trains_on_two_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "examples/pieces/loop.py", "--steps", "20"], cwd=ROOT,
                          env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_custom_job_example(tmp_path: Path) -> None:
    run = tmp_path / "custom"
    proc = hpcshard("submit", "--gpus", "2", "examples/custom_job/job.py", "--run-dir", str(run),
                    "--set", "steps=12", "--set", "log_every=6", "--set", "data=README.md")
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in recs if r.get("event") == "start")
    assert start["blocks"] == 4  # GatedConv found as the repeated block
    losses = [r["loss"] for r in recs if "loss" in r and "event" not in r]
    assert losses[-1] < losses[0]
    assert "evaluation is off" in (run / "logs" / "rank-0.log").read_text()  # README is small
