"""What the control-plane bench (`bench.control`) reads besides the run directory: the fake
ranks' stamps (`bench/control_rank.py`) and the CPU time of the machine and of processes,
from /proc. Pure parsing apart from the reads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Stamp:
    """One line a fake rank wrote: `event cycle node pid unix-time`."""

    event: str
    cycle: int
    node: int
    pid: int
    time: float


def parse_stamps(text: str) -> list[Stamp]:
    """Every whole line (a line being written, or torn, is left out)."""
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue
        try:
            found.append(Stamp(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])))
        except ValueError:
            continue
    return found


def read_stamps(path: Path) -> list[Stamp]:
    try:
        return parse_stamps(path.read_text())
    except FileNotFoundError:
        return []


def stamped(stamps: list[Stamp], event: str, cycle: int) -> dict[int, Stamp]:
    """Each node's first stamp `event` of `cycle`, by node."""
    found: dict[int, Stamp] = {}
    for s in stamps:
        if s.event == event and s.cycle == cycle and s.node not in found:
            found[s.node] = s
    return found


def parse_cpu(stat: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from /proc/stat's text: busy is everything
    but idle and iowait (guest time, already in user time, is not counted twice). On a
    kernel shared with other tenants (containers) this is the whole machine's."""
    fields = [int(v) for v in stat.splitlines()[0].split()[1:9]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def machine_cpu() -> tuple[int, int]:
    return parse_cpu(Path("/proc/stat").read_text())


def cpu_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share (0-1) of the machine's CPU time that was busy between two `machine_cpu`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def process_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) these processes have used so far (gone ones: 0)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")
