"""Tensor parallelism: tokens/s of the demo with tp=2 against tp=1 on the same 4 ranks of one
emulated node (tp=2: a (shard 2, tp 2) mesh; tp=1: shard 4), interleaved A/B, through the
real product path (`hpcshard submit`, local backend), throughput from the run's own
metrics after the warm-up.

CPU figures, labelled as such: on CPU/gloo a tensor parallel collective (an all-gather and
a reduce-scatter per matrix pair, in every layer) costs what a GPU's NVLink does not, and
the 4 ranks share 2 cores; the figure says what tensor parallelism costs here, not on a
GPU node. What TP buys there (activations and per-rank state divided by tp, batch sizes
FSDP alone cannot reach) does not show in tokens/s."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.common import Metric, hpcshard, median, records, save, show

NAME = "tp"
STEPS, WARMUP = 40, 10
SETS = {"dim": 256, "n_heads": 8, "n_layers": 4, "seq_len": 128, "batch_size": 16}


def planned_over_measured(run_dir: Path) -> float:
    """`hpcshard plan`'s per-rank parameter+gradient+optimizer bytes over what rank 0 held."""
    from hpcshard.runtime.planner import make_plan

    sets = json.loads((run_dir / "spec.json").read_text())["sets"]
    held = next(r for r in records(run_dir) if r.get("event") == "memory")
    plan = make_plan(job="jobs/charlm.py", sets=sets, numbers={}, hf_config=None, nodes=1, gpus=4,
                     sharding="auto", precision=None, ac=None, micro_batch=None, gpu_mem=80 * 2**30)
    mode = plan["modes"][plan["sharding"]]
    keys = ("params", "grads", "optimizer")
    return float(sum(mode[k] for k in keys) / sum(held[k] for k in keys))


def tokens_per_s(tmp: Path, tp: int, i: int, planned: list[float]) -> float:
    run_dir = tmp / f"tp{tp}-{i}"
    extra = [a for k, v in {**SETS, "tp": tp}.items() for a in ("--set", f"{k}={v}")]
    hpcshard("submit", "--backend", "local", "--nodes", "1", "--gpus", "4", "jobs/charlm.py",
             "--run-dir", str(run_dir), "--set", f"steps={STEPS}", "--set", "eval_every=0",
             "--set", "ckpt_every=100000", "--set", "log_every=10", *extra)
    steps = {r["step"]: r for r in records(run_dir) if "tokens_per_s" in r}
    t0, t1 = steps[WARMUP]["time"], steps[STEPS]["time"]
    planned.append(planned_over_measured(run_dir))
    return (STEPS - WARMUP) * SETS["batch_size"] * SETS["seq_len"] / (t1 - t0)


def main(pairs: int = 3) -> list[Metric]:
    one: list[float] = []
    two: list[float] = []
    planned: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-") as tmp:
        for i in range(pairs):  # A B, B A, A B: neither side always runs first
            for tp in ((1, 2) if i % 2 == 0 else (2, 1)):
                (one if tp == 1 else two).append(tokens_per_s(Path(tmp), tp, i, planned[tp]))
            print(f"  pair {i + 1}: tp=1 {one[-1]:.0f} tokens/s, tp=2 {two[-1]:.0f}", flush=True)
    ratios = [b / a for a, b in zip(one, two, strict=True)]
    metrics = [Metric(NAME, "demo (dim 256), 1 node x 4 ranks, tp=1 (shard 4), CPU", median(one), "tokens/s"),
               Metric(NAME, "the same, tp=2 (shard 2 x tp 2), CPU", median(two), "tokens/s"),
               Metric(NAME, f"tp=2 / tp=1 on CPU/gloo (median of {pairs} pairs)", median(ratios), "x",
                      note="CPU: TP's per-layer collectives are not NVLink's here"),
               *[Metric(NAME, f"hpcshard plan / measured per-rank state bytes, tp={tp}", median(v), "x",
                        "0.95-1.05", 0.95 <= median(v) <= 1.05) for tp, v in planned.items()]]
    save(NAME, metrics, {"tp1_tokens_per_s": one, "tp2_tokens_per_s": two, "ratios": ratios,
                         "planned_over_measured": planned,
                         "steps": STEPS, "warmup": WARMUP, "sets": SETS})
    return metrics


if __name__ == "__main__":
    show(main())
