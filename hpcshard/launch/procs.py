"""A node's processes as its launcher sees them, from /proc (Linux; works in containers
without ps): what lies below a launcher, which of those are ranks, and how to end them
whatever state they are in."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Protocol

from hpcshard.launch.watchdog import process_state, started, stat_fields
from hpcshard.rundir import flight
from hpcshard.rundir.progress import boards
from hpcshard.rundir.rankenv import STACKS_SIGNAL

FLIGHT_WAIT_S = 0.3
"""How long the ranks get to write their flight records (a few ms each, measured)."""
STACKS_WAIT_S = 1.0
"""How long the ranks get to write their stacks before they are killed."""


class Agent(Protocol):
    """A cycle's torchrun (or warm) agent: a Popen, or a fork of the node's zygote."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...


def _parents() -> dict[int, list[int]]:
    """Every process's children, by parent, from one pass over /proc."""
    below: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(entry)  # empty when it exited while we looked
            if fields:
                below.setdefault(int(fields[1]), []).append(int(entry))
    return below


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    return _parents().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (a warm agent's forked ranks, torchrun's workers and
    whatever they started), from one pass over /proc: a pass per process of the tree cost
    each launcher the whole host's process table several times over at every fault, and
    128 emulated nodes on one host scanned it some 600 times at once."""
    below = _parents()
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = below.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def ranks_below(pids: list[int]) -> list[int]:
    """The ranks (pids, by global rank) below these launchers, from the boards of this
    host: whatever lies between (torchrun, a warm agent, the zygote), a rank is what
    reports on a board. A board left by a killed launcher may name a pid that now is
    another process (pids wrap): only a slot written since its process started counts
    (both on the boot clock: start times floor to a clock tick, so a slot of the process
    itself is never earlier)."""
    below = {d for pid in pids for d in descendants(pid)}
    slots = sorted((s.rank, s.pid) for board in boards() for s in board
                   if s.pid in below and s.since >= started(s.pid))
    return [pid for _, pid in slots]


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie: a killed rank stays a zombie until its agent reaps
    it, and must count as dead at once."""
    return process_state(pid) not in ("", "Z", "X")


def send(pids: list[int], sig: int) -> None:
    """`sig` to each of `pids` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_tree(proc: Agent, stacks: list[int] | tuple[int, ...] = (),
              also: list[int] | tuple[int, ...] = ()) -> list[int]:
    """End a cycle's agent and every rank below it, whatever state they are in; the pids
    killed. `stacks`: ranks asked first to write their Python stacks into their logs (what
    a hang was doing). `also`: ranks that may no longer be below it (an agent that died
    leaves orphans)."""
    pids = [*descendants(proc.pid), *(p for p in also if alive(p)), proc.pid]
    if stacks:  # which collective each rank waits in, before a stopped one may move again
        flight.ask([p for p in stacks if process_state(p) not in ("T", "t")])
        time.sleep(FLIGHT_WAIT_S)
    send(pids, signal.SIGCONT)  # a stopped process ignores all but SIGKILL until continued
    if stacks:  # where each rank is: its Python stacks, into its log
        send(list(stacks), STACKS_SIGNAL)
        time.sleep(STACKS_WAIT_S)
    killed = [*descendants(proc.pid), *pids]
    send(killed, signal.SIGKILL)
    proc.wait()
    return killed


def kill_below(pid: int) -> list[int]:
    """Every process below `pid`, at once and for good (SIGCONT first: a stopped one would
    not die of anything else); the pids killed."""
    below = descendants(pid)
    send(below, signal.SIGCONT)
    send(below, signal.SIGKILL)
    return below
