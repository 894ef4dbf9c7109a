"""The requeue cycle on the local Slurm cluster (scripts/local-slurm, 2 nodes x 2 GPUs):
from the preemption notice to the first resumed step, how much of it is Slurm's own
requeue delay, the steps lost (target 0), and what that cycle costs a run preempted every
N minutes."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, Metric, env, hpcshard, records, run, save, show, wait

NAME = "requeue"
CONF = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm")) / "etc" / "slurm.conf"


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def slurm_start(job: str, e: dict[str, str]) -> float:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                         env={**e, "SLURM_TIME_FORMAT": "%s"}).stdout
    fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
    return float(fields["StartTime"])


def main() -> list[Metric]:
    run([str(ROOT / "scripts" / "local-slurm"), "up", "2"], timeout=600)
    e = env(SLURM_CONF=str(CONF))
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        run_dir = Path(tmp) / "run"
        hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                 "--run-dir", str(run_dir), "--time", "20:00", "--set", "steps=100000",
                 "--set", "log_every=1", "--set", "eval_every=0", "--set", "ckpt_every=100000", env=e)
        job = json.loads((run_dir / "spec.json").read_text())["jobs"][-1]
        try:
            wait(lambda: any(r.get("step", 0) >= 20 for r in records(run_dir) if "loss" in r), 300,
                 "training")
            notice = time.time()
            hpcshard("preempt", str(run_dir), env=e)
            start2 = wait(lambda: next((r for r in ledger(run_dir) if r["event"] == "start"
                                        and r["attempt"] == 1), None), 300, "the requeued attempt")
            first2 = wait(lambda: next((r for r in records(run_dir) if "loss" in r
                                        and r["step"] > start2["resumed_step"]
                                        and r["time"] > start2["time"]), None), 300, "a resumed step")
            requeued_at = slurm_start(job, e)
            end0 = next(r for r in ledger(run_dir) if r["event"] == "end" and r["attempt"] == 0)
            rq = next(r for r in ledger(run_dir) if r["event"] == "requeue")
        finally:
            subprocess.run(["scancel", job], env=e, capture_output=True)
    lost = end0["step"] - start2["resumed_step"]
    cycle = first2["time"] - notice
    metrics = [Metric(NAME, "notice to checkpoint committed (ranks stopped)", end0["time"] - notice, "s"),
               Metric(NAME, "scontrol requeue to Slurm starting the job again", requeued_at - rq["time"], "s",
                      note="Slurm's own requeue delay"),
               Metric(NAME, "job start to first resumed step", first2["time"] - requeued_at, "s"),
               Metric(NAME, "notice to first resumed step", cycle, "s"),
               Metric(NAME, "steps lost", lost, "steps", "0", lost == 0)]
    for minutes in (15, 60):
        eff = minutes * 60 / (minutes * 60 + cycle)
        metrics.append(Metric(NAME, f"effective training time, preempted every {minutes} min",
                              eff * 100, "%"))
    save(NAME, metrics, {"notice": notice, "end": end0, "requeue": rq, "start": start2,
                         "first_step": first2, "slurm_start": requeued_at})
    return metrics


if __name__ == "__main__":
    show(main())
