"""Checkpoint measurements inside a torchrun job, on hpcshard's own Trainer and
Checkpointer (the product path: DCP into step-N.tmp, manifest, rename, fsync).

    torchrun --nproc_per_node=4 bench/ckpt_worker.py OUT.json RUN_DIR --per-node 2 --mode sync

Rank 0 writes OUT.json: bytes, save seconds (sync), seconds blocked (async, every rank's
and the slowest), dd of the same byte count on the same file system (interleaved with
the saves), load seconds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcshard.config import build_config
from hpcshard.runtime.device import init_distributed
from hpcshard.runtime.job import load_job
from hpcshard.runtime.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def dd(path: Path, nbytes: int) -> float:
    """Write nbytes of zeros with fsync: the disk's sequential limit for that amount."""
    count = max(1, nbytes // 2**22)
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds * nbytes / (count * 2**22)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("run_dir")
    p.add_argument("--per-node", type=int, default=0)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dd", action="store_true")
    args = p.parse_args()
    env = init_distributed()
    if args.per_node:  # emulate nodes on one torchrun: the mesh is (world / per_node, per_node)
        env = dataclasses.replace(env, per_node=args.per_node)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = load_job(str(ROOT / "jobs" / "charlm.py"))
    sets = {"dim": str(args.dim), "n_layers": str(args.layers), "n_heads": "8", "seq_len": "64",
            "batch_size": str(env.world), "eval_every": "0", "ckpt_every": "100000000",
            "async_save": str(args.mode == "async").lower(), "keep_last": "2"}
    trainer = Trainer(job, build_config(job.config, sets), env, run_dir)
    assert trainer.ckpt is not None
    trainer.train_step()  # optimizer state exists from here on
    rows = []
    for _ in range(args.repeats):
        dist.barrier()
        step_s = time.perf_counter()
        trainer.train_step()
        step_s = time.perf_counter() - step_s
        dist.barrier()
        start = time.perf_counter()
        trainer.ckpt.save(trainer.step, "bench")
        blocked = time.perf_counter() - start
        during_s = 0.0
        if args.mode == "async":  # train while the write runs, as the loop does
            during_s = time.perf_counter()
            trainer.train_step()
            during_s = time.perf_counter() - during_s
            trainer.ckpt.wait()
        total = time.perf_counter() - start
        # Training goes on at the pace of its slowest rank: keep every rank's blocked time.
        each: list[Any] = [None] * env.world
        dist.all_gather_object(each, blocked)
        row: dict[str, Any] = {"blocked_s": max(each), "blocked_ranks": each, "total_s": total,
                               "step_s": step_s, "during_s": during_s}
        if env.is_main:  # the commit (manifest, sizes, save time) is rank 0's
            row.update(bytes=trainer.ckpt.last_bytes, save_seconds=trainer.ckpt.save_seconds[-1])
            ckpt = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir())[-1]
            row["rank_bytes"] = sorted(f.stat().st_size for f in ckpt.glob("__*_*.distcp"))
            if args.dd:
                row["dd_s"] = dd(run_dir / "dd.bin", row["bytes"])
        dist.barrier()
        rows.append(row)
    # Load: a fresh trainer in the same run directory restores the newest checkpoint.
    dist.barrier()
    fresh = Trainer(job, build_config(job.config, sets), env, run_dir)
    start = time.perf_counter()
    loaded = fresh.restore("auto")
    load_s = time.perf_counter() - start
    if env.is_main:
        Path(args.out).write_text(json.dumps({
            "world": env.world, "per_node": env.per_node, "mode": args.mode, "rows": rows,
            "load_s": load_s, "loaded_step": loaded.step if loaded else None,
            "params": trainer.n_params}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
