"""The device mesh: HSDP's (replicate, shard), the FSDP1-style sharding modes that map onto
it, and tensor parallelism as an innermost `tp` dimension inside a node."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcshard.sections import Parallel, check_tp, resolve_sharding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# check_tp and resolve_sharding live with Parallel (stdlib, for the login node too); here
# for the code that imports them from the mesh.
__all__ = ["build_mesh", "check_tp", "dp_mesh", "mesh_shape", "resolve_sharding", "tp_mesh"]

def mesh_shape(mode: str, nodes: int, per_node: int, tp: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """hybrid: (nodes, per_node) as (replicate, shard); none: (world, 1); full/grad-op: (world,).
    With tp > 1 a `tp` dimension of that size comes last and the others hold world / tp.

    Ranks of one node are contiguous (torchrun numbers each agent's workers together), so
    the tp dimension (innermost) and the shard dimension stay inside a node and only the
    replicate all-reduce crosses nodes.
    """
    degrees = Parallel(nodes=nodes, per_node=per_node, tp=tp)
    dp, inner = degrees.dp_world, degrees.dp_per_node
    shape: tuple[int, ...]
    names: tuple[str, ...]
    if mode == "hybrid":
        shape, names = (nodes, inner), ("replicate", "shard")
    elif mode == "none":
        shape, names = (dp, 1), ("replicate", "shard")
    else:
        shape, names = (dp,), ("shard",)
    return (shape + (tp,), names + ("tp",)) if tp > 1 else (shape, names)


def build_mesh(device_type: str, nodes: int, per_node: int, sharding: str = "auto",
               tp: int = 1) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    mode = resolve_sharding(sharding, nodes)
    shape, names = mesh_shape(mode, nodes, per_node, tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data parallel part (what FSDP shards and replicates over): all but `tp`."""
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != "tp")
    return mesh if len(names) == mesh.ndim else mesh[names]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor parallel group of this rank, or None without tensor parallelism."""
    return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
