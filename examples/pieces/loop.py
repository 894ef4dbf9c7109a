"""Your own training loop, hpcshard's pieces: mesh, sharding, initialisation, clipping.

    torchrun --nproc_per_node=4 examples/pieces/loop.py --steps 50

No hpcshard job, no hpcshard loop: a plain torchrun script. It learns to imitate a fixed
random "teacher" network, so it needs no data on disk.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hpcshard.runtime import ShardPlan, build_mesh, init_distributed, materialize, shard_model
from hpcshard.runtime.train import clip_grad_norm_


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Residual(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)  # (batch, 1): FSDP2 warns about returning a view such as squeeze()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()

    env = init_distributed()  # cuda+nccl or cpu+gloo, decided in one place
    mesh = build_mesh(env.device.type, env.nodes, env.per_node, "auto")  # HSDP on >1 node
    with torch.device("meta"):  # no memory until sharded
        model = Net(args.dim, depth=4)
    shard_model(model, mesh, ShardPlan(mode="hybrid" if env.nodes > 1 else "full", ac_every=1))
    materialize(model, env.device, seed=0)  # same values on any world size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    teacher = torch.Generator().manual_seed(1234)
    w_true = torch.randn(args.dim, generator=teacher)
    data = torch.Generator().manual_seed(env.rank)  # each rank draws its own samples
    for step in range(1, args.steps + 1):
        x = torch.randn(64, args.dim, generator=data)
        y = torch.tanh(x @ w_true / args.dim**0.5)[:, None]
        loss = F.mse_loss(model(x.to(env.device)), y.to(env.device))
        loss.backward()
        norm = clip_grad_norm_(list(model.parameters()), 1.0)  # correct over all shards
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps:
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
            if env.is_main:
                print(f"step {step} loss {loss.item():.4f} grad_norm {norm.item():.3f}", flush=True)
    dist.barrier()  # every rank done with its collectives before the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
