"""The baseline of `python -m bench gpu`: a minimal FSDP2 loop on one GPU, in one process
(no torchrun, no hpcshard runtime): the job's model built on the meta device, each block
`fully_shard`ed in bf16 with fp32 reductions (activation checkpointing where asked), the
root too, fused AdamW, gradient clipping, random windows of the job's own data. Prints
one JSON line per job: tokens/s between the warm-up and the last step (CUDA-synchronised),
and the allocator's peak.

    python -m bench.minimal_gpu --job jobs/charlm.py --steps 40 --warmup 10 --set 0:precision=bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

ROOT = Path(__file__).resolve().parents[1]


def train(job_path: str, sets: dict[str, str], steps: int, warmup: int) -> dict[str, float]:
    from hpcshard.config import build_config
    from hpcshard.runtime.blocks import find_blocks, on_meta
    from hpcshard.runtime.job import load_job

    job = load_job(job_path)
    cfg = build_config(job.config, sets)
    torch.manual_seed(0)
    with on_meta():
        model = job.model(cfg)
    flops = job.flops_per_token(cfg, model)
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = find_blocks(model, cfg.block, cfg.block_min_params)
    for i, block in enumerate(blocks):
        if cfg.ac == "full":
            wrapped = checkpoint_wrapper(block)
            parent = next(m for m in model.modules() if block in list(m.children()))
            name = next(n for n, c in parent.named_children() if c is block)
            setattr(parent, name, wrapped)
            block = wrapped
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for name, module in model.named_modules():
            job.init(model, name, module)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    data = torch.as_tensor(job.data(cfg).train.astype("int64"))
    gen = torch.Generator().manual_seed(0)
    b, t = cfg.batch_size, cfg.seq_len
    start = 0.0
    torch.cuda.reset_peak_memory_stats()
    for step in range(1, steps + 1):
        if step == warmup + 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        idx = torch.randint(0, len(data) - t - 1, (b,), generator=gen)
        x = torch.stack([data[i: i + t] for i in idx]).pin_memory().cuda(non_blocking=True)
        y = torch.stack([data[i + 1: i + 1 + t] for i in idx]).pin_memory().cuda(non_blocking=True)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": (steps - warmup) * b * t / seconds, "flops_per_token": flops,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item(),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", action="append", required=True, help="a job file (repeat for several)")
    p.add_argument("--set", action="append", default=[], metavar="JOB_INDEX:KEY=VALUE",
                   help="a setting for the N-th --job (0-based), e.g. 1:dim=2048")
    p.add_argument("--steps", type=int, action="append", default=[], help="per --job, in order [40]")
    p.add_argument("--warmup", type=int, action="append", default=[], help="per --job, in order [10]")
    args = p.parse_args()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    for n, job in enumerate(args.job):
        sets = dict(s.split(":", 1)[1].split("=", 1) for s in args.set if s.split(":", 1)[0] == str(n))
        steps = args.steps[n] if n < len(args.steps) else 40
        warmup = args.warmup[n] if n < len(args.warmup) else 10
        print(json.dumps({"job": job, **train(job, sets, steps, warmup)}), flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
