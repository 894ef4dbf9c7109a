"""The baseline for the overhead benchmark: a minimal hand-written FSDP2 training loop in
the shape of the PyTorch tutorial (init, mesh, fully_shard, AdamW, a loop), on the demo
job's model and data. Run under torchrun; rank 0 prints tokens/s between two steps.

    torchrun --nproc_per_node=4 bench/minimal_fsdp.py --steps 60 --warmup 10 --nodes 2
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

ROOT = Path(__file__).resolve().parents[1]


def charlm():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("charlm", ROOT / "jobs" / "charlm.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["charlm"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=0,
                   help="gloo's collective timeout in seconds, for every group including the "
                        "mesh's (0: torch's default, 30 min)")
    p.add_argument("--stamps", help="rank 0 appends 'restart step time' after every step here")
    args = p.parse_args()
    names = ("replicate", "shard")
    override: dict[int | str, str | C10dBackend.Options | tuple[str, C10dBackend.Options]] = {}
    if args.timeout:
        timeout = datetime.timedelta(seconds=args.timeout)
        dist.init_process_group("gloo", timeout=timeout)
        # The mesh's subgroups (where every FSDP collective runs) do not inherit the default
        # group's timeout: without this they keep torch's 30 min default and a hang never ends.
        override = {name: ("gloo", C10dBackend.Options("gloo", timeout)) for name in names}
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (args.nodes, world // args.nodes), mesh_dim_names=names,
                            backend_override=override or None)
    job = charlm()
    cfg = job.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = job.CharLM(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for module in model.modules():  # the tutorial's reset_parameters pass
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = torch.as_tensor(job.job.data(cfg).train.astype("int64"))
    per_rank = cfg.batch_size // world
    gen = torch.Generator().manual_seed(rank)
    start = 0.0
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            dist.barrier()
            start = time.perf_counter()
        idx = torch.randint(0, len(data) - cfg.seq_len - 1, (per_rank,), generator=gen)
        x = torch.stack([data[i: i + cfg.seq_len] for i in idx])
        y = torch.stack([data[i + 1: i + 1 + cfg.seq_len] for i in idx])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.stamps and rank == 0:  # the faults benchmark: when each step ended
            with open(args.stamps, "a") as f:
                f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {step} {time.time()}\n")
        if step % args.log_every == 0:
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        done = (args.steps - args.warmup) * cfg.batch_size * cfg.seq_len
        print(f"tokens_per_s {done / seconds:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and os.environ.get("RANK") is not None:
    main()
