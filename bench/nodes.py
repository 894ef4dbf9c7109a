"""Whole nodes lost, 2x2 demo plus spares on the local backend: every process of the
newest non-leader active node (its launcher, zygote, agent and ranks) SIGSTOPped, REPEATS
times in one run with REPEATS spares. Per loss: the fault declared (the ranks of the other
node hang first: the watchdog), the node declared lost (its heartbeat silent for LOST_S),
and the spare training in its place (declared -> the first step that advances training).
Targets from the issue: lost <= 10 s after the node went silent, training again on the
spare <= 20 s after that."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import PY, RESULTS, ROOT, Metric, env, median, records, save, show, wait
from hpcshard.rundir import ledger

NAME = "nodes"
REPEATS = 3



def _freeze(run_dir: Path, node: int) -> float:
    from hpcshard.launch.procs import descendants
    from hpcshard.rundir.launchers import pid_file, read_pid

    launcher = read_pid(pid_file(run_dir, node))
    assert launcher is not None, f"node {node}'s launcher is not running"
    for pid in [launcher, *descendants(launcher)]:
        os.kill(pid, signal.SIGSTOP)
    return time.time()


def main(repeats: int = REPEATS) -> list[Metric]:
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        run_dir = Path(tmp) / "run"
        sets = {"steps": 100000, "log_every": 1, "eval_every": 0, "ckpt_every": 10, "keep_last": 2,
                "straggler_every": 0}
        argv = [PY, "-m", "hpcshard", "submit", "--nodes", "2", "--gpus", "2", "--spares", str(repeats),
                "jobs/charlm.py", "--run-dir", str(run_dir), "--max-restarts", str(repeats + 1),
                *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
        proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        active = [0, 1]
        try:
            for cycle in range(repeats):
                since = wait(lambda c=cycle: next((r["time"] for r in ledger.read(run_dir)
                                                   if r["event"] == "start" and r.get("cycle") == c), None),
                             300, f"cycle {cycle}")
                wait(lambda t=since: sum(1 for r in records(run_dir) if "loss" in r and r["time"] > t) >= 13,
                     300, f"cycle {cycle} to train 13 steps")
                victim = active[-1]
                frozen = _freeze(run_dir, victim)
                print(f"  node {victim} frozen in cycle {cycle}", flush=True)
                back = wait(lambda c=cycle: next((r for r in ledger.read(run_dir) if r["event"] == "recovered"
                                                  and r["cycle"] == c + 1), None), 300, "the spare")
                led = ledger.read(run_dir)
                fault = next(r for r in led if r["event"] == "fault" and r["cycle"] == cycle)
                bad = next(r for r in led if r["event"] == "bad_node" and r["node"] == victim)
                active = fault["active"]
                rows.append({"declared": fault["declared"] - frozen, "lost": bad["time"] - frozen,
                             "spare": back["seconds"], "total": back["time"] - frozen})
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    declared = median([r["declared"] for r in rows])
    metrics = [
        Metric(NAME, f"frozen -> fault declared (median of {len(rows)})", declared, "s",
               note="the other node's ranks hang first: the watchdog's 5 s floor"),
        Metric(NAME, "frozen -> node declared lost", median([r["lost"] for r in rows]), "s", "<= 10 s",
               median([r["lost"] for r in rows]) <= 10),
        Metric(NAME, "declared -> training again on a spare", median([r["spare"] for r in rows]), "s",
               "<= 20 s", median([r["spare"] for r in rows]) <= 20),
        Metric(NAME, "frozen -> training again", median([r["total"] for r in rows]), "s"),
    ]
    save(NAME, metrics, {"losses": rows})
    return metrics


if __name__ == "__main__":
    show(main())
