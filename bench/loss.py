"""`python -m bench loss`: a masked step on 4 ranks (2 nodes x 2, CPU/gloo) against its whole
global batch computed in one process (tests/distributed/loss_worker.py): on HSDP with
accumulation and with tensor parallelism, uneven masks over micro-batches and ranks. The
step's logged loss must be the mean over its learnt tokens and its reduced gradients the
whole batch's, to float reduction order; `sharding=none` all-reduces once per step."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import PY, ROOT, Metric, env, save, show

NAME = "loss"
WORKER = ROOT / "tests" / "distributed" / "loss_worker.py"


def main() -> list[Metric]:
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-loss-") as tmp:
        out = Path(tmp) / "facts.json"
        subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER),
                        str(out)], env=env(), check=True, capture_output=True, timeout=900)
        facts: dict[str, Any] = json.loads(out.read_text())
    metrics = []
    for name, what in (("hybrid", "HSDP 2x2, 2 micro-batches"), ("tp", "tp=2 on 2x2, 4 micro-batches")):
        step = facts[name]
        gap = abs(step["loss"] - step["whole_loss"]) / abs(step["whole_loss"])
        metrics.append(Metric(NAME, f"masked step loss vs whole batch in one process, {what}", gap,
                              "rel", "<= 1e-5", gap <= 1e-5))
        metrics.append(Metric(NAME, f"masked step gradient vs whole batch, {what}", step["grad_error"],
                              "rel", "<= 1e-5", step["grad_error"] <= 1e-5))
    save(NAME, metrics, facts)
    return metrics


if __name__ == "__main__":
    show(main())
    sys.exit(0)
