"""The 2D HSDP mesh and the FSDP1-style sharding modes that map onto it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcshard.config import SHARDING_MODES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def resolve_sharding(mode: str, nodes: int) -> str:
    """`auto` is hybrid when there is more than one node, else full."""
    if mode not in SHARDING_MODES:
        raise ValueError(f"sharding={mode!r} is not valid; choose one of: {', '.join(SHARDING_MODES)}")
    if mode == "auto":
        return "hybrid" if nodes > 1 else "full"
    return mode


def mesh_shape(mode: str, nodes: int, per_node: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """hybrid: (nodes, per_node) as (replicate, shard); none: (world, 1); full/grad-op: (world,).

    Ranks of one node are contiguous (torchrun numbers each agent's workers together), so
    the shard dimension stays inside a node and only the replicate all-reduce crosses nodes.
    """
    world = nodes * per_node
    if mode == "hybrid":
        return (nodes, per_node), ("replicate", "shard")
    if mode == "none":
        return (world, 1), ("replicate", "shard")
    return (world,), ("shard",)


def build_mesh(device_type: str, nodes: int, per_node: int, sharding: str = "auto") -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    mode = resolve_sharding(sharding, nodes)
    shape, names = mesh_shape(mode, nodes, per_node)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
