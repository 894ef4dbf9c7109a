"""The links between nodes, measured before an attempt trains (a health check that needs
the ranks: the launchers cannot send tensors).

Each node's first rank sends `health_link_mb` to the next node's and receives from the
previous one, then the other way round: every link between neighbours on the ring is timed
in both directions, at its receiver, while all the others carry the same load (as the
replicate all-reduce would). A link under `health_link_gbps` is slow; a node that every
slow link touches is the culprit (it needs 3 nodes or more: between two nodes, either end
may be at fault) and is declared bad like a straggler under `straggler_policy=bad_node`.
The other ranks only wait. Measured on every node count; judged only with a floor set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpcshard.runtime.device import DistEnv


@dataclass(frozen=True)
class Link:
    source: int
    """Node that sent."""
    target: int
    """Node that received and timed it."""
    gbps: float
    """GB/s the receiver saw."""


def measure(env: DistEnv, megabytes: float) -> list[Link]:
    """Every ring link between the nodes' first ranks, both directions (every rank calls
    this; all get the same list)."""
    nodes, per_node = env.nodes, env.per_node
    numel = max(1, int(megabytes * 2**20) // 4)
    times = torch.zeros(2 * nodes, dtype=torch.float64)
    me, first = env.rank // per_node, env.local_rank == 0
    send = torch.ones(numel if first else 1, dtype=torch.float32, device=env.device)
    recv = torch.empty_like(send)
    for direction, step in enumerate((1, -1)):
        to, frm = ((me + step) % nodes) * per_node, ((me - step) % nodes) * per_node
        if first:
            _exchange(send[:1024], recv[:1024], to, frm, env)  # warm-up: the connections
        # Every node starts the timed exchange together: a neighbour still busy with a
        # slow node must not look slow itself.
        dist.barrier()
        if first:
            times[direction * nodes + me] = _exchange(send, recv, to, frm, env)
    every = times.to(env.device)
    dist.all_reduce(every)  # each slot was written by one node's first rank only
    seconds = every.cpu().tolist()
    size = numel * 4 / 1e9
    links = []
    for direction, step in enumerate((1, -1)):
        for node in range(nodes):
            spent = seconds[direction * nodes + node]
            links.append(Link(source=(node - step) % nodes, target=node,
                              gbps=size / spent if spent > 0 else float("inf")))
    return links


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, env: DistEnv) -> float:
    """Send to one neighbour while receiving from the other; seconds until the receive was
    complete (the link into this node; the send is the next node's to time)."""
    start = time.perf_counter()
    sent, received = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to),
                                             dist.P2POp(dist.irecv, recv, frm)])
    received.wait()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    seconds = time.perf_counter() - start
    sent.wait()
    return seconds


def culprit(links: list[Link], floor_gbps: float, nodes: int) -> int | None:
    """The node every slow link touches, when there is exactly one and 3 nodes or more."""
    slow = [link for link in links if link.gbps < floor_gbps]
    if not slow or nodes < 3:
        return None
    common = set.intersection(*({link.source, link.target} for link in slow))
    return common.pop() if len(common) == 1 else None
