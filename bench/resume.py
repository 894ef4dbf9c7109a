"""Resume latency: from `hpcshard submit` / `hpcshard resume` to the first training step,
fresh against resumed (target: resumed <= 1.3 x fresh), and where the time goes. Also the
warm start (ranks forked from a torchrun agent that imported torch and the runtime once)
against plain torchrun (HPCSHARD_WARM_START=0: each rank a new Python importing torch).

Each rank records when it started and when it had torch, its process group, its model and
its checkpoint (the `startup` field of the run's start event); the first step is its
metrics record. The demo job on 2 x 2, three of each, interleaved."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, Metric, env, hpcshard, median, records, save, show

NAME = "resume"
PHASES = ("cli, preflight, torchrun", "import torch", "rendezvous", "mesh, shard, init, data",
          "checkpoint load", "first step")


def phases(run_dir: Path, t0: float, first_step: int) -> list[float]:
    starts = [r for r in records(run_dir) if r.get("event") == "start"]
    s = starts[-1]["startup"]
    first = next(r for r in records(run_dir) if r.get("step") == first_step and "loss" in r)
    marks = [t0, s["entry"], s["torch"], s["rendezvous"], s["built"], s["loaded"], first["time"]]
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def main(repeats: int = 3) -> list[Metric]:
    fresh: list[list[float]] = []
    resumed: list[list[float]] = []
    plain: list[list[float]] = []
    common = ["--set", "eval_every=0", "--set", "log_every=1"]
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        for i in range(repeats):
            run_dir = Path(tmp) / f"run-{i}"
            t0 = time.time()
            hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                     "--run-dir", str(run_dir), "--set", "steps=3", *common)
            fresh.append(phases(run_dir, t0, 1))
            t0 = time.time()
            hpcshard("resume", str(run_dir), "--set", "steps=6")
            resumed.append(phases(run_dir, t0, 4))
            run_dir = Path(tmp) / f"plain-{i}"
            t0 = time.time()
            hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                     "--run-dir", str(run_dir), "--set", "steps=3", *common,
                     env=env(HPCSHARD_WARM_START="0"))
            plain.append(phases(run_dir, t0, 1))
    total_f, total_r = median([sum(x) for x in fresh]), median([sum(x) for x in resumed])
    total_p = median([sum(x) for x in plain])
    metrics = [Metric(NAME, "fresh: start to first step", total_f, "s"),
               Metric(NAME, "fresh, plain torchrun (no warm start): start to first step", total_p, "s"),
               Metric(NAME, "warm start / plain torchrun, start to first step", total_f / total_p, "x"),
               Metric(NAME, "resumed: start to first step", total_r, "s"),
               Metric(NAME, "resumed / fresh", total_r / total_f, "x", "<= 1.3", total_r / total_f <= 1.3)]
    for i, phase in enumerate(PHASES):
        metrics.append(Metric(NAME, f"resumed: {phase}", median([x[i] for x in resumed]), "s",
                              note=f"fresh {median([x[i] for x in fresh]):.2f} s, plain torchrun "
                                   f"{median([x[i] for x in plain]):.2f} s"))
    save(NAME, metrics, {"fresh": fresh, "resumed": resumed, "plain": plain, "phases": PHASES})
    return metrics


if __name__ == "__main__":
    show(main())
