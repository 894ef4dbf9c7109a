"""The in-job runtime that every rank runs: mesh, sharding, training loop, data, metrics.

Everything here may import torch. Users with their own loop import the pieces directly:
`from hpcshard.runtime import init_distributed, build_mesh, shard_model, materialize`,
and `save_checkpoint` / `load_checkpoint` for exact resume (see `hpcshard.preemption`).
"""

from hpcshard.runtime.checkpoint import load_checkpoint, save_checkpoint
from hpcshard.runtime.device import DistEnv, init_distributed
from hpcshard.runtime.job import Job, load_job
from hpcshard.runtime.mesh import build_mesh
from hpcshard.runtime.shard import ShardPlan, find_blocks, materialize, shard_model

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
