"""Checkpoint cost, on a model with a few hundred MB of parameters and AdamW state
(the demo's architecture at dim 512 x 8 layers, 2 x 2 HSDP):

- sync save throughput (hpcshard's full commit: DCP write, manifest, rename, fsync) against
  `dd conv=fsync` of the same byte count on the same disk, interleaved (target >= 0.70);
- training time blocked by an async save against the sync save time (target <= 5%);
- load time on resume (a fresh trainer restoring the newest checkpoint)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.common import PY, RESULTS, Metric, median, run, save, show

NAME = "checkpoint"


def worker(tmp: Path, mode: str, nproc: int = 4, per_node: int = 2, repeats: int = 3,
           dd: bool = False, dim: int = 512, layers: int = 8) -> dict:
    out = tmp / f"{mode}-{nproc}-{per_node}.json"
    run([PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "bench/ckpt_worker.py",
         str(out), str(tmp / f"run-{mode}-{nproc}-{per_node}"), "--per-node", str(per_node),
         "--mode", mode, "--repeats", str(repeats), "--dim", str(dim), "--layers", str(layers),
         *(["--dd"] if dd else [])])
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> list[Metric]:
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        sync = worker(Path(tmp), "sync", dd=True)
        asyn = worker(Path(tmp), "async")
    rows = sync["rows"]
    nbytes = median([r["bytes"] for r in rows])
    save_s = median([r["total_s"] for r in rows])
    dd_s = median([r["dd_s"] for r in rows])
    ratio = median([r["dd_s"] / r["total_s"] for r in rows])
    blocked = median([r["blocked_s"] for r in asyn["rows"]])
    metrics = [
        Metric(NAME, f"checkpoint size ({sync['params'] / 1e6:.1f}M params + AdamW)", nbytes / 1e6, "MB"),
        Metric(NAME, "sync save (DCP + commit), 2x2", save_s, "s"),
        Metric(NAME, "dd conv=fsync, same bytes, same disk", dd_s, "s"),
        Metric(NAME, "save throughput / dd throughput", ratio, "x", ">= 0.70", ratio >= 0.70),
        Metric(NAME, "async save: training blocked", blocked, "s"),
        Metric(NAME, "async blocked / sync save", blocked / save_s, "x", "<= 0.05", blocked / save_s <= 0.05),
        Metric(NAME, "load on resume (fresh trainer)", sync["load_s"], "s"),
    ]
    save(NAME, metrics, {"sync": sync, "async": asyn})
    return metrics


if __name__ == "__main__":
    show(main())
