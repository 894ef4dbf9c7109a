"""Runtime overhead: hpcshard's training loop against a minimal hand-written FSDP2 loop
(bench/minimal_fsdp.py) on the same model, data, batch and ranks (2 x 2 HSDP on CPU/gloo),
interleaved A/B, tokens/s of each and the ratio (target >= 0.98).

hpcshard's side is the real product path: `hpcshard submit --backend local`, two emulated
nodes of two ranks; throughput is taken from its own metrics between two logged steps
after the warm-up, so start-up and the final checkpoint are outside the window."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from bench.common import PY, Metric, hpcshard, median, records, run, save, show

NAME = "overhead"
STEPS, WARMUP = 60, 10


def ours(tmp: Path, i: int) -> float:
    run_dir = tmp / f"hpcshard-{i}"
    hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
             "--run-dir", str(run_dir), "--set", f"steps={STEPS}", "--set", "eval_every=0",
             "--set", "ckpt_every=100000", "--set", "log_every=10")
    steps = {r["step"]: r for r in records(run_dir) if "tokens_per_s" in r}
    t0, t1 = steps[WARMUP]["time"], steps[STEPS]["time"]
    start = next(r for r in records(run_dir) if r.get("event") == "start")
    tokens = (STEPS - WARMUP) * 32 * 128
    assert start["world"] == 4
    return tokens / (t1 - t0)


def minimal() -> float:
    proc = run([PY, "-m", "torch.distributed.run", "--nproc_per_node=4", "bench/minimal_fsdp.py",
                "--steps", str(STEPS), "--warmup", str(WARMUP), "--nodes", "2"])
    m = re.search(r"tokens_per_s ([0-9.]+)", proc.stdout)
    assert m, proc.stdout
    return float(m.group(1))


def main(pairs: int = 3) -> list[Metric]:
    a: list[float] = []
    b: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-") as tmp:
        for i in range(pairs):  # A B, B A, A B: neither side always runs first
            order = [("a", i), ("b", i)] if i % 2 == 0 else [("b", i), ("a", i)]
            for side, _ in order:
                if side == "a":
                    a.append(ours(Path(tmp), i))
                else:
                    b.append(minimal())
            print(f"  pair {i + 1}: hpcshard {a[-1]:.0f} tokens/s, minimal {b[-1]:.0f}", flush=True)
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    metrics = [Metric(NAME, "hpcshard loop, 2x2 HSDP", median(a), "tokens/s"),
               Metric(NAME, "minimal FSDP2 loop, 2x2 HSDP", median(b), "tokens/s"),
               Metric(NAME, f"hpcshard / minimal (median of {pairs} pairs)", median(ratios), "x",
                      ">= 0.98", median(ratios) >= 0.98)]
    save(NAME, metrics, {"hpcshard_tokens_per_s": a, "minimal_tokens_per_s": b, "ratios": ratios,
                         "steps": STEPS, "warmup": WARMUP})
    return metrics


if __name__ == "__main__":
    show(main())
