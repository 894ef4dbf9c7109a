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

def mesh_shape(mode: str, nodes: int, per_node: int, tp: int = 1,
               shard: int = 0) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """hybrid: (world / tp / S, S) as (replicate, shard), S the shard degree (`shard`, or a
    node's data-parallel ranks); none: (world, 1); full/grad-op: (world,). With tp > 1 a
    `tp` dimension of that size comes last and the others hold world / tp (`Parallel.mesh`).

    Ranks of one node are contiguous (torchrun numbers each agent's workers together), so
    the tp dimension (innermost) and hybrid's default shard dimension stay inside a node
    and only the replicate all-reduce crosses nodes; a shard degree larger than a node's
    spans whole nodes (consecutive ranks).
    """
    return Parallel(nodes=nodes, per_node=per_node, tp=tp, sharding=mode, shard=shard).mesh()


def build_mesh(device_type: str, nodes: int, per_node: int, sharding: str = "auto",
               tp: int = 1, shard: int = 0) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = Parallel(nodes=nodes, per_node=per_node, tp=tp, sharding=sharding,
                            shard=shard).mesh()
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data parallel part (what FSDP shards and replicates over): all but `tp`."""
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != "tp")
    return mesh if len(names) == mesh.ndim else mesh[names]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor parallel group of this rank, or None without tensor parallelism."""
    return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
