"""Data loading: (a) how long a step waits for its batches, as a share of the step, on the
demo at 2 nodes x 2 ranks (`hpcshard submit --backend local`) on a mixture of prepared
corpora, with the background loader (data_prefetch=1) and without it (0); (b) the
sampler's memory per rank at 1e8, 1e10 and 1e13 tokens (sparse shard files), the per-index
Feistel order against the randperm table (8 bytes per sample, estimated where it cannot
be built)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PY, Metric, env, hpcshard, median, records, save, show

NAME = "data"
STEPS, WARMUP = 40, 5
SEQ_LEN, BATCH = 1024, 32
SIZES = (10**8, 10**10, 10**13)
SHARD_TOKENS = 10**12
"""Sparse shards of at most this many tokens (2 TB of uint16: under ext4's 16 TiB)."""


def write_corpus(folder: Path, docs: list[np.ndarray] | None = None, tokens: int = 0) -> None:
    """A prepared corpus: `docs` written out, or `tokens` of sparse zeros in one document
    per shard (nothing is written but the sizes)."""
    folder.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    sizes = [len(d) for d in docs] if docs is not None else []
    if docs is not None:
        flat = np.concatenate(docs).astype("<u2")
        flat.tofile(folder / "shard-00000.bin")
        np.cumsum([0, *sizes], dtype="<i8").tofile(folder / "shard-00000.idx")
        shards.append({"name": "shard-00000", "tokens": len(flat), "documents": len(docs), "sha256": ""})
    for k, start in enumerate(range(0, tokens, SHARD_TOKENS)):
        n = min(SHARD_TOKENS, tokens - start)
        name = f"shard-{k:05d}"
        with open(folder / f"{name}.bin", "wb") as f:
            f.truncate(n * 2)
        np.array([0, n], dtype="<i8").tofile(folder / f"{name}.idx")
        shards.append({"name": name, "tokens": n, "documents": 1, "sha256": ""})
    manifest = {"format": "hpcshard-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
                "eos_id": 0, "tokenizer": {"path": "", "sha256": ""}, "source": {"bench": NAME},
                "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def demo_corpora(root: Path) -> None:
    """Two sources of random bytes in documents of 50-3000 tokens (4M tokens each)."""
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        docs, total = [], 0
        while total < 4_000_000:
            docs.append(np.append(rng.integers(1, 256, int(rng.integers(50, 3000))), 0))
            total += len(docs[-1])
        write_corpus(root / name, docs)


def wait_share(root: Path, prefetch: int) -> dict[str, float]:
    """The demo at 2x2 on the mixture: median over steps of data_wait_s / step time."""
    run_dir = root / f"run-{prefetch}"
    hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
             "--run-dir", str(run_dir), "--set", f"steps={STEPS}", "--set", "eval_every=0",
             "--set", "ckpt_every=100000", "--set", "log_every=1", "--set", "data=web:0.7,code:0.3",
             "--set", f"data_root={root}", "--set", f"data_prefetch={prefetch}")
    steps = sorted((r for r in records(run_dir) if "data_wait_s" in r), key=lambda r: r["step"])
    shares, waits, times = [], [], []
    for before, r in zip(steps[WARMUP:], steps[WARMUP + 1:], strict=False):
        step_s = r["time"] - before["time"]
        shares.append(r["data_wait_s"] / step_s)
        waits.append(r["data_wait_s"])
        times.append(step_s)
    return {"share": median(shares), "wait_s": median(waits), "step_s": median(times)}


MEASURE = """
import json, sys, tracemalloc
from hpcshard.runtime.corpus import load_blend
from hpcshard.runtime.data import GlobalBatches

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024

blend = load_blend(sys.argv[1])
before = rss()
tracemalloc.start()
b = GlobalBatches(blend, seq_len={seq}, batch_size={batch}, micro={batch}, rank=0, world=1, seed=0,
                  order=sys.argv[2])
for _ in range(3):
    b.next()
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({{"samples": b.samples, "rss_delta": rss() - before, "traced_peak": peak}}))
"""


def sampler_memory(root: Path, tokens: int, order: str) -> dict[str, Any]:
    folder = root / f"sparse-{tokens:.0e}"
    if not folder.exists():
        write_corpus(folder, tokens=tokens)
    samples = (tokens - min(1 << 20, tokens // 20) - 1) // SEQ_LEN
    if order == "randperm" and samples * 8 > 2**30:  # the table would not fit here
        return {"samples": samples, "estimate": samples * 8}
    code = MEASURE.format(seq=SEQ_LEN, batch=BATCH)
    out = subprocess.run([PY, "-c", code, str(folder), order], env=env(), capture_output=True,
                         text=True, timeout=1200, check=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def main() -> list[Metric]:
    metrics: list[Metric] = []
    details: dict[str, Any] = {"steps": STEPS, "warmup": WARMUP}
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-data-") as tmp:
        root = Path(tmp)
        demo_corpora(root)
        for prefetch in (1, 0):
            found = wait_share(root, prefetch)
            details[f"prefetch_{prefetch}"] = found
            print(f"  data_prefetch={prefetch}: {found}", flush=True)
            metrics.append(Metric(NAME, f"data wait / step, demo 2x2, data_prefetch={prefetch}",
                                  found["share"] * 100, "%", "<= 1" if prefetch else "",
                                  found["share"] <= 0.01 if prefetch else None))
        for tokens in SIZES:
            for order in ("feistel", "randperm"):
                found = sampler_memory(root, tokens, order)
                details[f"{order}_{tokens:.0e}"] = found
                print(f"  {order} {tokens:.0e} tokens: {found}", flush=True)
                if "estimate" in found:
                    metrics.append(Metric(NAME, f"sampler memory, {order}, {tokens:.0e} tokens",
                                          found["estimate"] / 2**20, "MiB", note="estimate: 8 B/sample"))
                else:
                    metrics.append(Metric(NAME, f"sampler memory, {order}, {tokens:.0e} tokens",
                                          max(found["rss_delta"], found["traced_peak"]) / 2**20, "MiB"))
    save(NAME, metrics, details)
    return metrics


if __name__ == "__main__":
    show(main())
    sys.exit(0)
