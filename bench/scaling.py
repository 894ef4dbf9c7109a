"""Checkpoint scaling: bytes and save time per rank for 1, 2 and 4 shard ranks, and the
total size of a 1 x 4 and a 2 x 2 (HSDP) checkpoint: replicas must not multiply bytes."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.checkpoint import worker
from bench.common import RESULTS, Metric, median, save, show

NAME = "scaling"
DIM, LAYERS = 384, 6


def main() -> list[Metric]:
    results = {}
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        for nproc, per_node in ((1, 1), (2, 2), (4, 4), (4, 2)):
            results[f"{nproc // per_node}x{per_node}"] = worker(
                Path(tmp), "sync", nproc=nproc, per_node=per_node, repeats=2, dim=DIM, layers=LAYERS)
    metrics = []
    for shape, r in results.items():
        per_rank = max(r["rows"][-1]["rank_bytes"])
        metrics.append(Metric(NAME, f"{shape}: largest rank file", per_rank / 1e6, "MB"))
        metrics.append(Metric(NAME, f"{shape}: save time", median([x["total_s"] for x in r["rows"]]), "s"))
    total = {k: sum(r["rows"][-1]["rank_bytes"]) for k, r in results.items()}
    ratio = total["2x2"] / total["1x4"]
    metrics.append(Metric(NAME, "total bytes 2x2 / 1x4", ratio, "x", "<= 1.02", ratio <= 1.02))
    save(NAME, metrics, {"results": results, "total_bytes": total})
    return metrics


if __name__ == "__main__":
    show(main())
