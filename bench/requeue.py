"""The road back through the queue, on the local Slurm cluster (scripts/local-slurm, 2 nodes
x 2 GPUs): the 2x2 demo preempted every PERIOD seconds (`hpcshard preempt`, what Slurm's
notice does), once with `--requeue-policy requeue` (the same job, `scontrol requeue`) and
once with `chain` (a continuation job, submitted with afterany when the stop is committed),
side by side. Per preemption: notice -> checkpoint committed, stop -> Slurm starting the
job again (Slurm's own hold), job start -> first resumed step, steps lost (target 0). Per
policy: the effective training time of the whole run, measured from the ledger and the
metrics (`hpcshard status --goodput`), not computed from the cycle."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, Metric, env, hpcshard, records, run, save, show, wait
from hpcshard.rundir import ledger
from hpcshard.rundir.goodput import account

NAME = "requeue"
CONF = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm")) / "etc" / "slurm.conf"
PERIOD = 60.0
"""Seconds between preemptions (the issue's figure: submitit reaches 0.80 on a trivial job)."""
PREEMPTIONS = 4



def slurm_times(job: str, e: dict[str, str]) -> dict[str, float]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                         env={**e, "SLURM_TIME_FORMAT": "%s"}).stdout
    fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
    return {k: float(fields[k]) for k in ("StartTime", "EndTime", "SubmitTime")
            if fields.get(k, "").isdigit()}


def preempted(policy: str, tmp: Path, e: dict[str, str]) -> dict[str, Any]:
    """One run under `policy`, preempted PREEMPTIONS times, PERIOD s apart; what it cost."""
    run_dir = tmp / policy
    hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
             "--run-dir", str(run_dir), "--time", "30:00", "--requeue-policy", policy,
             "--set", "steps=100000", "--set", "log_every=1", "--set", "eval_every=0",
             "--set", "ckpt_every=100000", env=e)
    created = json.loads((run_dir / "spec.json").read_text())["created"]
    cycles = []
    try:
        wait(lambda: any("loss" in r for r in records(run_dir)), 300, f"{policy}: training")
        for attempt in range(PREEMPTIONS):
            time.sleep(max(0.0, created + (attempt + 1) * PERIOD - time.time()))
            notice = time.time()
            hpcshard("preempt", str(run_dir), env=e)
            start = wait(lambda a=attempt: next((r for r in ledger.read(run_dir) if r["event"] == "start"
                                                 and r["attempt"] == a + 1), None), 300,
                         f"{policy}: attempt {attempt + 1}")
            first = wait(lambda s=start: next((r for r in records(run_dir) if "loss" in r
                                               and r["time"] > s["time"]), None), 300,
                         f"{policy}: a resumed step")
            end = next(r for r in ledger.read(run_dir) if r["event"] == "end" and r["attempt"] == attempt)
            job = json.loads((run_dir / "spec.json").read_text())["jobs"][-1]
            began = slurm_times(job, e)["StartTime"]
            cycles.append({"notice": notice, "committed": end["time"] - notice,
                           "held": began - end["time"], "start-up": first["time"] - began,
                           "cycle": first["time"] - notice, "lost": end["step"] - start["resumed_step"]})
        finished = created + (PREEMPTIONS + 1) * PERIOD
        time.sleep(max(0.0, finished - time.time()))
        good = account(run_dir, created, finished)
    finally:
        for job in json.loads((run_dir / "spec.json").read_text())["jobs"]:
            subprocess.run(["scancel", job], env=e, capture_output=True)
    return {"cycles": cycles, "effective": good.effective, "seconds": good.seconds, "wall": good.wall}


def main() -> list[Metric]:
    run([str(ROOT / "scripts" / "local-slurm"), "up", "2"], timeout=600)
    e = env(SLURM_CONF=str(CONF))
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        found = {policy: preempted(policy, Path(tmp), e) for policy in ("requeue", "chain")}
    metrics = []
    for policy, got in found.items():
        med = {k: statistics.median(c[k] for c in got["cycles"])
               for k in ("committed", "held", "start-up", "cycle")}
        lost = max(c["lost"] for c in got["cycles"])
        metrics += [
            Metric(NAME, f"{policy}: notice to checkpoint committed", med["committed"], "s"),
            Metric(NAME, f"{policy}: stop to Slurm starting the job again", med["held"], "s",
                   note="requeue_delay (cred_expire) for requeue; the scheduler's next pass for chain"),
            Metric(NAME, f"{policy}: job start to first resumed step", med["start-up"], "s"),
            Metric(NAME, f"{policy}: notice to first resumed step", med["cycle"], "s"),
            Metric(NAME, f"{policy}: steps lost (worst of {PREEMPTIONS})", lost, "steps", "0", lost == 0),
            Metric(NAME, f"{policy}: effective training time, preempted every {PERIOD:.0f} s",
                   100 * got["effective"], "%", "> 80", got["effective"] > 0.80,
                   note=f"measured over {got['wall']:.0f} s from submission"),
        ]
    ratio = (statistics.median(c["cycle"] for c in found["chain"]["cycles"])
             / statistics.median(c["cycle"] for c in found["requeue"]["cycles"]))
    metrics.append(Metric(NAME, "chain / requeue, notice to first resumed step", ratio, "x",
                          note="below 1: chain is faster"))
    save(NAME, metrics, {"period_s": PERIOD, "preemptions": PREEMPTIONS, **found})
    return metrics


if __name__ == "__main__":
    show(main())
