"""`hpcshard doctor --smoke`: a multi-node all-reduce through the same path a training job
takes (the profile's template, submitit, the per-node launcher, torchrun, the backend that
runtime.device picks). Each rank runs this module; rank 0 writes RUN_DIR/smoke.json."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

MEGABYTES = 64
ROUNDS = 5


def node_main(run_dir: str, per_node: int) -> int:
    """What submitit runs on every node of the smoke job."""
    from hpcshard.launch.node import run_node
    from hpcshard.launch.slurm import SlurmEnv, node_env

    return run_node(node_env(SlurmEnv.from_environ(), per_node), Path(run_dir),
                    module="hpcshard.launch.smoke")


def main() -> int:
    import torch
    import torch.distributed as dist

    from hpcshard.runtime.device import init_distributed

    env = init_distributed()
    hosts: list[str] = [""] * env.world
    dist.all_gather_object(hosts, socket.gethostname())
    ones = torch.ones(1, device=env.device)
    dist.all_reduce(ones)
    ok = int(ones.item()) == env.world
    data = torch.ones(MEGABYTES * 2**20 // 4, device=env.device)
    dist.all_reduce(data)  # warm-up: connections, buffers
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(data)
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    # Bus bandwidth, as nccl-tests reports it: 2(n-1)/n of the buffer crosses each link.
    busbw = data.numel() * 4 * 2 * (env.world - 1) / env.world / median / 1e9
    if env.is_main:
        result = {"ok": ok, "world": env.world, "hosts": sorted(set(hosts)), "backend": env.backend,
                  "megabytes": MEGABYTES, "median_s": median, "busbw_gbs": busbw}
        (Path(sys.argv[1]) / "smoke.json").write_text(json.dumps(result) + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
