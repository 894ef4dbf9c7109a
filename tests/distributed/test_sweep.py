"""A sweep under the local backend, through the real CLI: every configuration is its own
run (two at a time), the status table and the overlaid curves; a bad configuration is named
before anything is made. (A job array on Slurm: tests/slurm/test_sweep.py.)"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from hpcshard.rundir import ledger
from tests.conftest import hpcshard, hpcshard_bg, metrics, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import trained_to


def test_a_local_sweep_runs_each_configuration_as_its_own_run(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    proc = hpcshard("sweep", "jobs/charlm.py", "--grid", "lr=1e-3,3e-3", "--grid", "dim=32,48",
                    "--max-parallel", "2", "--sweep-dir", str(root),
                    *sets(steps=4, eval_every=4, ckpt_every=4, log_every=1))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    configs = json.loads((root / "sweep.json").read_text())["configs"]
    assert configs == [{"lr": "1e-3", "dim": "32"}, {"lr": "1e-3", "dim": "48"},
                       {"lr": "3e-3", "dim": "32"}, {"lr": "3e-3", "dim": "48"}]
    spans = []
    for i, config in enumerate(configs):
        task = root / f"task-{i}"
        spec = json.loads((task / "spec.json").read_text())
        assert spec["sets"]["lr"] == config["lr"] and spec["resolved"]["config"]["dim"] == int(config["dim"])
        assert [r["step"] for r in step_records(task)] == [1, 2, 3, 4]
        starts = [r["time"] for r in ledger.read(task) if r["event"] == "start"]
        ends = [r["time"] for r in metrics(task) if r.get("event") == "end"]
        spans.append((starts[0], ends[-1]))
    # two at a time: task 1 started before task 0 ended; task 2 only after one of them did
    assert spans[1][0] < spans[0][1] and spans[2][0] > min(spans[0][1], spans[1][1])
    # different configurations, different runs: the same seed, other losses
    assert len({step_records(root / f"task-{i}")[-1]["loss"] for i in range(4)}) == 4
    table = hpcshard("status", str(root)).stdout
    assert "task    configuration   state  step  best eval  attempts" in table
    for i, config in enumerate(configs):
        line = next(x for x in table.splitlines() if x.startswith(f"task-{i} "))
        assert f"lr={config['lr']},dim={config['dim']}" in line and " done " in line and " 4/4 " in line
    plotted = hpcshard("plot", str(root))
    assert plotted.returncode == 0 and (root / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one task is an ordinary run: status, resume
    assert "progress: step 4/4" in hpcshard("status", str(root / "task-3")).stdout


def test_a_bad_configuration_is_named_before_anything_is_made(tmp_path: Path) -> None:
    """Every configuration is checked (one preflight process) before anything is made."""
    proc = hpcshard("sweep", "jobs/charlm.py", "--grid", "lr=1e-3,fast", "--sweep-dir", str(tmp_path / "s"))
    assert proc.returncode == 2 and not (tmp_path / "s").exists()
    assert "configuration 1 (lr=fast): --set lr='fast': expected float" in proc.stderr
    listed = tmp_path / "c.json"
    listed.write_text(json.dumps([{"dim": 32}, {"dimm": 32}]))
    proc = hpcshard("sweep", "jobs/charlm.py", "--configs", str(listed), "--sweep-dir", str(tmp_path / "s"))
    assert proc.returncode == 2 and "configuration 1 (dimm=32): unknown --set key 'dimm'" in proc.stderr


def test_cancel_stops_a_local_sweep_and_no_waiting_run_starts(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    proc = hpcshard_bg("sweep", "jobs/charlm.py", "--grid", "seed=1,2,3", "--sweep-dir", str(root),
                       *sets(steps=5000, ckpt_every=10000, eval_every=10000))
    wait_for(partial(trained_to, root / "task-0", 2), 120, "task 0 training")
    cancelled = hpcshard("cancel", str(root))
    assert cancelled.returncode == 0 and "cancelled 1 node launcher(s) of sweep" in cancelled.stdout
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "task 0 (seed=1): failed" in out and "task 1 (seed=2): started" not in out
    assert not any((root / f"task-{i}" / "metrics.jsonl").exists() for i in (1, 2))
    assert max(r["step"] for r in step_records(root / "task-0")) < 5000
