"""A preemption notice that arrives while the ranks are still importing torch is kept and
honoured at the first step boundary (not lost, and it does not kill the rank). Plain
torchrun (HPCSHARD_WARM_START=0) has that window at its widest: each rank is a new Python
that spends seconds importing torch; warm ranks are forked with torch already loaded."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hpcshard.launch.procs import children
from hpcshard.rundir import ledger
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.rankenv import REQUEUE_EXIT
from tests.conftest import catches, hpcshard_bg, sets, wait_for


def rank_pids(run: Path) -> list[int]:
    """Plain torchrun's workers, from the moment they exist (before they report anywhere):
    the children of each launcher's torchrun."""
    return [rank for launcher in launchers(run) for agent in children(launcher)
            for rank in children(agent)]


def test_a_notice_during_start_up_stops_the_run_at_the_first_boundary(tmp_path: Path) -> None:
    run = tmp_path / "early"
    proc = hpcshard_bg("submit", "--nodes", "1", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                       "--max-requeues", "0", *sets(steps=200), env={"HPCSHARD_WARM_START": "0"})
    wait_for(lambda: len(rank_pids(run)) == 2, 120, "both ranks to start")
    # past the entry point's first lines, long before torch has loaded (on a busy machine
    # 0.3 s after the ranks appeared was not always past them: the notice was lost)
    wait_for(lambda: all(catches(pid, signal.SIGUSR2) for pid in rank_pids(run)), 60, "the notice's handler")
    assert not (run / "metrics.jsonl").exists()  # still starting up
    for pid in rank_pids(run):
        os.kill(pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == REQUEUE_EXIT, out[-3000:]  # stopped with a checkpoint, cap 0
    end = next(r for r in ledger.read(run) if r["event"] == "end")
    assert end["reason"] == "stop" and end["step"] == 1 and end["saved_step"] == 1, end
