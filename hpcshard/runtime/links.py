"""The links between nodes, measured before an attempt trains (a health check that needs
the ranks: the launchers cannot send tensors).

Each node's first rank sends `health_link_mb` to the next node's, then to the previous
one's: every link between neighbours on the ring is timed in both directions, at its
receiver, in phases where each node sends or receives one link's data and the phase's other
links carry the same load (as the replicate all-reduce would). A link under
`health_link_gbps` is slow; the one node whose every link is slow is the culprit (a bad NIC
or host: it needs 3 nodes or more, as between two nodes either end may be at fault) and is
declared bad like a straggler under `straggler_policy=bad_node`. A slow link between nodes
that each have a fast one (a cable, a congested moment) is no node's fault, and does not
clear a node that is slow everywhere. The other ranks only wait. Measured on every node
count; judged only with a floor set.
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


def ring_phases(nodes: int) -> list[list[tuple[int, int]]]:
    """The ring's links, (sender, receiver) both ways round, in phases where a node sends or
    receives at most one: a node slow to take its data must not hold up the link into it
    from the other side (gloo's sender thread is one per rank: measured, a throttled node 1
    made the healthy link 2 -> 0 look 100x slower when it was timed alongside 0 -> 1)."""
    ring = [(n, (n + step) % nodes) for step in (1, -1) for n in range(nodes)]
    phases: list[list[tuple[int, int]]] = []
    for link in dict.fromkeys(link for link in ring if link[0] != link[1]):  # 2 nodes: 2 links
        for phase in phases:
            if not {end for other in phase for end in other} & set(link):
                phase.append(link)
                break
        else:
            phases.append([link])
    return phases


def measure(env: DistEnv, megabytes: float) -> list[Link]:
    """Every ring link between the nodes' first ranks, both directions (every rank calls
    this; all get the same list)."""
    per_node = env.per_node
    numel = max(1, int(megabytes * 2**20) // 4)
    me, first = env.rank // per_node, env.local_rank == 0
    phases = ring_phases(env.nodes)
    times = torch.zeros(sum(map(len, phases)), dtype=torch.float64)
    buffer = torch.ones(numel if first else 1, dtype=torch.float32, device=env.device)
    slot = 0
    for phase in phases:
        mine = [(i, link) for i, link in enumerate(phase, slot) if me in link] if first else []
        for _, (src, dst) in mine:  # warm-up: the connection
            _transfer(buffer[:1024], src * per_node, dst * per_node, me == dst)
        # The phase's links start together: they load the fabric as an all-reduce would.
        dist.barrier()
        for i, (src, dst) in mine:
            spent = _transfer(buffer, src * per_node, dst * per_node, me == dst, env)
            if me == dst:
                times[i] = spent
        slot += len(phase)
    every = times.to(env.device)
    dist.all_reduce(every)  # each slot was written by its receiver only
    timed: list[float] = every.cpu().tolist()
    size = numel * 4 / 1e9
    return [Link(source=src, target=dst, gbps=size / spent if spent > 0 else float("inf"))
            for (src, dst), spent in zip((link for phase in phases for link in phase), timed,
                                           strict=True)]


def _transfer(buffer: torch.Tensor, src: int, dst: int, receive: bool,
              env: DistEnv | None = None) -> float:
    """Send the buffer from rank src to rank dst; on the receiver, seconds until it was all
    in (the sender's figure is not used)."""
    start = time.perf_counter()
    if receive:
        dist.recv(buffer, src)
    else:
        dist.send(buffer, dst)
    if env is not None and env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return time.perf_counter() - start


def culprit(links: list[Link], floor_gbps: float, nodes: int) -> int | None:
    """The node whose every link is slow, when there is exactly one and 3 nodes or more."""
    if nodes < 3:
        return None
    fast = {end for link in links if link.gbps >= floor_gbps for end in (link.source, link.target)}
    behind = {end for link in links for end in (link.source, link.target)} - fast
    return behind.pop() if len(behind) == 1 else None
