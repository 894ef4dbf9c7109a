"""Ports a launcher listens on (a rendezvous, the launchers' store), picked below the
host's ephemeral range, and the addresses the store listens on (`listen`).

A port from `bind(port 0)` is an ephemeral one: between the pick and the listen, any
outgoing connection of the host may take it as its source port, and the listen then
fails (under the whole suite's load a node's torchrun agent exited 1 before its ranks
started: its rendezvous port was taken). Below `ip_local_port_range` no connection's
source port ever lands, and no other `bind(0)` returns it. Slurm jobs derive their first
ports there too (`launch.slurm.rdzv_port`)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import random
import resource
import socket
from pathlib import Path
from typing import Any

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


Address = tuple[socket.AddressFamily, tuple[Any, ...]]
"""A family and a socket address to bind (the port left to `listen`)."""


def addresses(host: str) -> list[Address]:
    """Where to listen for peers told to reach this host as `host` (they resolve it on their
    own hosts): an address as given; for a name, the addresses it has here, but none of
    loopback. A name this host alone resolves to loopback (Debian's `127.0.1.1 NAME` in
    /etc/hosts; the local Slurm's node names) says nothing of the address its peers get
    for it. Empty: every interface, the only place sure to be where they come. ("": every
    interface; so is a name that does not resolve here: its look-up may have failed for a
    moment, EAI_AGAIN from a DNS server busy as every node of the job starts, and the
    peers' own may not.)"""
    if not host:
        return []
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    literal = _is_address(host)
    chosen: list[Address] = []
    for family, _, _, _, sockaddr in found:
        if family not in (socket.AF_INET, socket.AF_INET6) or (family, sockaddr) in chosen:
            continue
        if literal or not ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback:
            chosen.append((family, sockaddr))
    return chosen


def _is_address(host: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host.split("%")[0])
        return True
    return False


def listen(host: str, port: int, tries: int = 5) -> list[socket.socket]:
    """Listening sockets on `port` (0: a free one, the same at every address) at `host`'s
    `addresses`. An address this host does not have (the name leads its peers elsewhere: a
    NAT, a floating address) is left out; none left: every interface, as for a name that
    means loopback here only. An OSError when the port is taken."""
    wanted = addresses(host)
    for _ in range(tries - 1):
        with contextlib.suppress(_Taken):
            return _listen_at(wanted, port) or [_listen_everywhere(port)]
    return _listen_at(wanted, port) or [_listen_everywhere(port)]


class _Taken(OSError):
    """A free port picked at the first address was taken at another: pick again."""


def _listen_at(wanted: list[Address], port: int) -> list[socket.socket]:
    """One socket per address, all on one port (the first picks it where `port` is 0)."""
    held: list[socket.socket] = []
    try:
        for family, sockaddr in wanted:
            at = int(held[0].getsockname()[1]) if held else port
            try:
                held.append(socket.create_server((sockaddr[0], at, *sockaddr[2:]), family=family))
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    continue
                if err.errno == errno.EADDRINUSE and held and port == 0:
                    raise _Taken(err.errno, err.strerror) from err
                raise
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


def _listen_everywhere(port: int) -> socket.socket:
    """One socket on `port` for every address family: asyncio, given no host, binds one
    socket per family, and with port 0 each gets a port of its own (the store named one; a
    launcher reaching its host by the other family found nothing there). A dual-stack IPv6
    socket takes IPv4 too; without IPv6, IPv4 alone."""
    if not socket.has_dualstack_ipv6():
        return socket.create_server(("", port))
    return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)


def raise_fd_limit() -> None:
    """Open files up to the hard limit: a store holds a connection per launcher and up to
    `coord.STRANGERS` + 2 per launcher waiting for their hello, past the usual soft limit
    of 1,024 from about 320 nodes (its next open, a file or a connection, then failed with
    EMFILE). The hard limit is the site's to set; raising the soft one to it is every
    process's right."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # (an unlimited one is refused: kept)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
