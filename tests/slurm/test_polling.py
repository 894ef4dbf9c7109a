"""Light on the controller, on the local cluster: a sweep followed to its end with
`hpcshard status SWEEP --follow` asks Slurm once a poll for all its tasks (one squeue,
never scontrol job by job), polls at least poll_s apart, and sees every task end."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import hpcshard, sets
from tests.slurm.conftest import POLL_S, follow_sweep

TASKS = 6


def test_a_followed_sweep_asks_one_squeue_a_poll(cluster: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    lrs = ",".join(f"{(i + 1) * 1e-3:g}" for i in range(TASKS))
    proc = hpcshard("sweep", "--backend", "slurm", "jobs/charlm.py", "--grid", f"lr={lrs}",
                    "--nodes", "1", "--gpus", "1", "--partition", "low", "--time", "10:00",
                    "--sweep-dir", str(root), *sets(steps=2), env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = json.loads((root / "sweep.json").read_text())["array"]
    out, calls = follow_sweep(cluster, root, tmp_path, timeout=480)
    assert f"following {TASKS} Slurm job(s)" in out and f"job array {array}" in out
    assert all(f"task-{i} (lr=" in out for i in range(TASKS))
    table = [line for line in out.splitlines() if line.startswith("task-") and "  " in line]
    assert len(table) == TASKS and all(" COMPLETED " in row for row in table), out
    # (follow_sweep: squeue alone a poll, no more calls than polls)
    polls = [float(t) for t, name in calls[:-2]]
    gaps = [b - a for a, b in zip(polls, polls[1:], strict=False)]
    assert min(gaps, default=POLL_S) >= POLL_S * 0.9, gaps  # never two calls in one poll
