"""A plain FSDP2 training script, the shape of the PyTorch FSDP2 tutorial: meta-device
init, a device mesh, fully_shard per block, a DistributedSampler, DCP checkpoints.

    torchrun --nproc_per_node=4 examples/own_loop/plain.py --steps 60
    hpcshard submit --nodes 2 --gpus 2 examples/own_loop/plain.py -- --steps 60

It knows nothing of hpcshard. A preemption kills it and it restarts from its last
periodic save; `train.py` beside it is this file plus the handful of lines that make the
resume exact (docs/user/scripts.md shows the diff).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.LayerNorm):
                m.reset_parameters()


def dataset(dim: int, size: int = 4096) -> TensorDataset:
    """A fixed random teacher to imitate: no data on disk, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, dim, generator=g)
    w = torch.randn(dim, generator=g)
    return TensorDataset(x, torch.tanh(x @ w / dim**0.5)[:, None])


def save(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir / f"step-{step}"))


def load(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    steps = [int(p.name[5:]) for p in ckpt_dir.glob("step-*") if p.name[5:].isdigit()]
    if not steps:
        return 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir / f"step-{max(steps)}"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return max(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--final", help="write the trained weights here (rank 0, one file)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="slow down (for demos)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    # HSDP: shard within a node, replicate across nodes.
    mesh = init_device_mesh(device.type, (world // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net(args.dim, depth=4)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ckpt_dir = Path(args.ckpt_dir)
    start = load(ckpt_dir, model, optimizer)
    data = dataset(args.dim)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            step += 1
            if step <= start:  # already trained before the restart
                continue
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(args.step_seconds)
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step % args.save_every == 0:
                save(ckpt_dir, step, model, optimizer)
            if step == args.steps:
                break
        epoch += 1

    if args.final:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, args.final)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
