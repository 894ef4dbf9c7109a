"""Light on the controller, on the local cluster: a sweep followed to its end with
`hpcshard status SWEEP --follow` asks Slurm once a poll for all its tasks (one squeue,
never scontrol job by job), polls at least poll_s apart, and sees every task end."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import hpcshard, sets

TASKS = 6
POLL_S, POLL_MAX_S = 1, 4


def test_a_followed_sweep_asks_one_squeue_a_poll(cluster: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    lrs = ",".join(f"{(i + 1) * 1e-3:g}" for i in range(TASKS))
    proc = hpcshard("sweep", "--backend", "slurm", "jobs/charlm.py", "--grid", f"lr={lrs}",
                    "--nodes", "1", "--gpus", "1", "--partition", "low", "--time", "10:00",
                    "--sweep-dir", str(root), *sets(steps=2), env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = json.loads((root / "sweep.json").read_text())["array"]
    site = tmp_path / "site.toml"
    site.write_text(f"[defaults]\npoll_s = {POLL_S}\npoll_max_s = {POLL_MAX_S}\n")
    log = tmp_path / "calls.log"
    start = time.time()
    followed = hpcshard("status", str(root), "--follow", timeout=480,
                        env={**cluster, "HPCSHARD_SITE": str(site), "HPCSHARD_SLURM_CALLS_LOG": str(log)})
    took = time.time() - start
    assert followed.returncode == 0, followed.stdout + followed.stderr
    out = followed.stdout
    assert f"following {TASKS} Slurm job(s)" in out and f"job array {array}" in out
    assert all(f"task-{i} (lr=" in out for i in range(TASKS))
    table = [line for line in out.splitlines() if line.startswith("task-") and "  " in line]
    assert len(table) == TASKS and all(" COMPLETED " in row for row in table), out
    calls = [line.split(" ", 1) for line in log.read_text().splitlines()]
    names = [name for _, name in calls]
    # The follow's polls are squeue alone; the table at its end: accounting, then squeue at most.
    assert set(names[:-2]) == {"squeue"}, names
    polls = [float(t) for t, name in calls[:-2]]
    gaps = [b - a for a, b in zip(polls, polls[1:], strict=False)]
    assert min(gaps, default=POLL_S) >= POLL_S * 0.9, gaps  # never two calls in one poll
    assert len(calls) <= took / POLL_S + 3, (len(calls), took)
