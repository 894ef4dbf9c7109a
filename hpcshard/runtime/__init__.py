"""The in-job runtime that every rank runs: mesh, sharding, training loop, data, metrics.

Everything here may import torch. Users with their own loop import the pieces directly:
`from hpcshard.runtime import init_distributed, build_mesh, shard_model, materialize`,
and `save_checkpoint` / `load_checkpoint` for exact resume (see `hpcshard.preemption`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use: `hpcshard.runtime.preflight` and `jobs/*.py` (which import `Job`)
# must not pay for FSDP, DTensor and DCP.
_WHERE = {
    "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "DistEnv": "device", "init_distributed": "device",
    "Job": "job", "load_job": "job",
    "build_mesh": "mesh",
    "ShardPlan": "shard", "find_blocks": "blocks", "materialize": "shard", "shard_model": "shard",
}

if TYPE_CHECKING:
    from hpcshard.runtime.blocks import find_blocks
    from hpcshard.runtime.checkpoint import load_checkpoint, save_checkpoint
    from hpcshard.runtime.device import DistEnv, init_distributed
    from hpcshard.runtime.job import Job, load_job
    from hpcshard.runtime.mesh import build_mesh
    from hpcshard.runtime.shard import ShardPlan, materialize, shard_model


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hpcshard.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpcshard.runtime.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DistEnv",
    "Job",
    "ShardPlan",
    "build_mesh",
    "find_blocks",
    "init_distributed",
    "load_checkpoint",
    "load_job",
    "materialize",
    "save_checkpoint",
    "shard_model",
]
