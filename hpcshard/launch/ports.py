"""Ports a launcher listens on (a rendezvous, the launchers' store), picked below the
host's ephemeral range.

A port from `bind(port 0)` is an ephemeral one: between the pick and the listen, any
outgoing connection of the host may take it as its source port, and the listen then
fails (under the whole suite's load a node's torchrun agent exited 1 before its ranks
started: its rendezvous port was taken). Below `ip_local_port_range` no connection's
source port ever lands, and no other `bind(0)` returns it. Slurm jobs derive their first
ports there too (`launch.slurm.rdzv_port`)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOW = 30000
"""The lowest port picked: above the range Slurm jobs derive their first ports from
(20000-29999, `launch.slurm.rdzv_port`), which two jobs sharing a host may use."""
TRIES = 200


def ephemeral_low() -> int:
    """The first port of this host's ephemeral range (Linux's default: 32768)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def listen_ports(n: int, host: str = "") -> list[int]:
    """`n` different ports free to listen on at `host` ("": every address), held together
    while picked. Where the range below the ephemeral one is too small or full, the
    kernel's pick (`bind(0)`)."""
    top = ephemeral_low()
    pick = random.SystemRandom()
    with contextlib.ExitStack() as held:
        found: list[int] = []
        for _ in range(TRIES if top - LOW >= 1000 else 0):
            if len(found) == n:
                break
            port = pick.randrange(LOW, top)
            s = held.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:
                continue
            found.append(port)
        while len(found) < n:
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            found.append(int(s.getsockname()[1]))
        return found
