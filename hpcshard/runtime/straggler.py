"""Stragglers: a rank whose device (or host) computes consistently slower than the rest.

In a synchronous job every rank's step takes the same wall time (the collectives wait for
the slowest), so step times cannot tell which rank is slow. Every `straggler_every` steps
each rank instead times the same small local computation (a few milliseconds, no
communication) and the times are gathered: a rank slower than the median of the others by
`straggler_margin` at `straggler_patience` looks in a row is a straggler. It is named in
the log, the metrics and `hpcshard status`; with `straggler_policy=bad_node` the ranks
save, stop together, and the launchers declare its node bad (a spare takes its place,
the run goes on with fewer nodes, or it goes back through the queue without it).

What it does not see: a slow link. The probe is compute only; a node with a degraded
network shows in the health check's all-reduce instead.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

PROBE_SIZE = {"cuda": 4096}
"""Matrix side of the probe: big enough to time on the device, ~10 ms on a CPU core."""
PROBE_CPU_SIZE = 384
PROBE_MATMULS = 8
PROBE_RUNS = 3
"""The probe's time is the median of this many runs: one preempted run is noise."""


def probe(device: torch.device) -> float:
    """Seconds this rank takes for a fixed computation on its device."""
    n = PROBE_SIZE.get(device.type, PROBE_CPU_SIZE)
    runs = []
    for _ in range(PROBE_RUNS):
        a = torch.full((n, n), 1.0 / n, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(PROBE_MATMULS):
            a = a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def crowded(places: list[tuple[str, int, int]], device: torch.device) -> str:
    """Why CPU ranks cannot be compared ("" if they can): `places` is every rank's (host,
    cores, threads). Ranks whose threads outnumber their host's cores share cores, and who
    gets more of them is the scheduler's choice, not a slow device (the local backend's
    emulated nodes on a laptop). GPUs are always compared."""
    if device.type != "cpu":
        return ""
    for host in {h for h, _, _ in places}:
        mine = [(cores, threads) for h, cores, threads in places if h == host]
        if sum(threads for _, threads in mine) > mine[0][0]:
            return f"{len(mine)} ranks x {mine[0][1]} thread(s) on {host}'s {mine[0][0]} cores"
    return ""


def gather(seconds: float, device: torch.device) -> list[float]:
    """Every rank's probe time, by rank (an all-gather of one number per rank)."""
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(t.item()) for t in every]


class Stragglers:
    """Which ranks are consistently slow, from successive looks at every rank's probe."""

    def __init__(self, margin: float, patience: int) -> None:
        self.margin, self.patience = margin, patience
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()

    def look(self, times: list[float]) -> list[tuple[int, float]]:
        """The ranks that just became stragglers, with how many times slower than the
        median of the others they were at this look (each rank is named once)."""
        found = []
        for rank, t in enumerate(times):
            others = times[:rank] + times[rank + 1:]
            ratio = t / statistics.median(others) if others and statistics.median(others) > 0 else 1.0
            self.streak[rank] = self.streak.get(rank, 0) + 1 if ratio > self.margin else 0
            if self.streak[rank] >= self.patience and rank not in self.named:
                self.named.add(rank)
                found.append((rank, ratio))
        return found
