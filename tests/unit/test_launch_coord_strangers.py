"""What the launchers' store (`launch.coord.Server`) costs before a connection's key checks,
and where it listens. Anything on the cluster's network may connect to its port (derived
from the job id): four connections sending long lines without a newline grew node 0's
launcher from 23 to 265 MB, and the OOM killer then took a process of the job. In one
process, over real sockets: the server's loop is a thread, as in node 0's launcher."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import coord, ports

KEY = "k" * 32


def until(check: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


@pytest.fixture
def server() -> Iterator[coord.Server]:
    found = coord.Server(KEY, 0, "127.0.0.1").start()
    yield found
    found.close()


def closed_by_the_store(sock: socket.socket, timeout: float = 5.0) -> bool:
    """The store closed this connection within `timeout` (its end read: EOF, or a reset)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return bool(sock.recv(1))  # (the store says nothing first: open means no data, no EOF)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def hello(node: int, key: str = KEY) -> bytes:
    return json.dumps({"op": "hello", "id": 0, "node": node, "key": key, "attempt": 0,
                       "watch": list(coord.WATCHED)}).encode() + b"\n"


# -- bounded before authenticated -----------------------------------------------------------
def test_a_store_fed_unauthenticated_long_lines_stays_small(server: coord.Server) -> None:
    """Four connections each send 32 MB without a newline and no hello. The store read
    each into memory up to its 64 MB line limit before it looked at the key (122 MB here
    for the four, traced). Now a line before the hello is cut at HELLO_LIMIT: the
    connection is closed, and what it sent is dropped."""
    payload = b"x" * (32 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        sent: list[str] = []

        def feed() -> None:
            try:
                with socket.create_connection(("127.0.0.1", server.port)) as sock:
                    sock.sendall(payload)
                sent.append("all")
            except OSError:
                sent.append("cut")  # (the store closed it: a reset or a broken pipe)

        feeders = [threading.Thread(target=feed) for _ in range(4)]
        for feeder in feeders:
            feeder.start()
        for feeder in feeders:
            feeder.join(60)
        assert len(sent) == 4
        grown = (tracemalloc.get_traced_memory()[1] - before) / 2**20
    finally:
        tracemalloc.stop()
    assert grown < 8, f"the store grew by {grown:.0f} MB for four strangers"
    assert sent == ["cut"] * 4
    assert coord.Client("127.0.0.1", server.port, KEY, 1).connect(time.monotonic() + 2)
    until(lambda: 1 in server.conns and not server.unproven)


def test_a_stranger_s_first_read_is_small_too(server: coord.Server) -> None:
    """One read of a socket takes up to 256 KB in asyncio, whatever the reader's limit: a
    stranger that sends 1 MB at once cost the store 257 KB (traced) before its line was cut,
    and the cap is counted in connections (STRANGERS and two per launcher): a thousand
    launchers' worth of strangers doing it at once grew node 0's launcher from 39 to 284 MB.
    Until the key checks, a read takes HELLO_LIMIT at most."""
    payload = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        until(lambda: len(server.unproven) == 1)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # (what the socket takes at once is enough)
                sock.send(payload)
            until(lambda: not server.unproven)
            grown = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    assert grown < 64 << 10, f"a stranger cost the store {grown >> 10} KB"


def test_a_launcher_let_in_may_still_send_long_lines(tmp_path: Path, server: coord.Server) -> None:
    """After the hello, LINE_LIMIT stays the bound: a node's down record carries its ranks'
    flight records, each naming every group's members (about 4 MB for 8 ranks of 80,000)."""
    chan = coord.Channel(tmp_path, 1)
    assert chan.open("127.0.0.1", server.port, KEY, attempt=0, serve=False)
    flight = {"rank": 3, "pg_config": {"default_pg": {"ranks": list(range(80_000))}}}
    record = {"dead": [{"rank": 3}], "flight": {str(r): {**flight, "rank": r} for r in range(8)}}
    chan.mark_down(0, 0, 1, record)
    assert chan.downs(0, 0, 2)[0]["flight"]["7"]["pg_config"] == flight["pg_config"]
    assert len(json.dumps(server.data["down/0/0/1"], separators=(",", ":"))) > 3 << 20
    chan.close()


def test_a_hello_never_finished_is_closed_at_its_time_limit(server: coord.Server,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that sends a little and never a whole line (or nothing) holds its place
    among those yet to say their hello only for HELLO_S."""
    monkeypatch.setattr(coord, "HELLO_S", 0.3)
    with socket.create_connection(("127.0.0.1", server.port)) as slow, \
            socket.create_connection(("127.0.0.1", server.port)) as mute:
        slow.sendall(b'{"op": "hel')
        assert closed_by_the_store(slow) and closed_by_the_store(mute)
    until(lambda: not server.unproven)


def test_past_the_cap_the_oldest_stranger_goes_and_a_launcher_still_gets_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """STRANGERS connections that never say their hello fill the cap (two per launcher of
    the job beside them; none here). One more closes the oldest, not the newest: idle
    connections held open cannot keep a launcher out, and a launcher that connects while
    the cap is full is let in."""
    monkeypatch.setattr(coord, "STRANGERS", 4)
    monkeypatch.setattr(coord, "HELLO_S", 60.0)  # (none is closed for its time here, under any load)
    served = coord.Server(KEY, 0, "127.0.0.1").start()
    with contextlib.ExitStack() as stack:
        strangers = [stack.enter_context(socket.create_connection(("127.0.0.1", served.port)))
                     for _ in range(4)]
        until(lambda: len(served.unproven) == 4)
        strangers.append(stack.enter_context(socket.create_connection(("127.0.0.1", served.port))))
        assert closed_by_the_store(strangers[0], 2)
        assert all(still_open(s) for s in strangers[1:])
        assert len(served.unproven) == 4
        client = coord.Client("127.0.0.1", served.port, KEY, 1)
        assert client.connect(time.monotonic() + 2)
        until(lambda: 1 in served.conns)
        assert closed_by_the_store(strangers[1], 2) and all(still_open(s) for s in strangers[2:])
        client.close()
    served.close()


def test_every_launcher_of_the_job_may_connect_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of the job's launchers (node 0's store starts listening, and every launcher
    trying to connect comes within 0.2 s) is never cut down by the cap: two per launcher
    are counted beside STRANGERS. Here 40 launchers' connections are all open before any
    says its hello, and each is answered."""
    monkeypatch.setattr(coord, "STRANGERS", 4)
    monkeypatch.setattr(coord, "HELLO_S", 60.0)
    served = coord.Server(KEY, 0, "127.0.0.1", nodes=40).start()
    try:
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(socket.create_connection(("127.0.0.1", served.port)))
                     for _ in range(40)]
            until(lambda: len(served.unproven) == 40)
            for node, sock in enumerate(socks):
                sock.sendall(hello(node))
            for sock in socks:
                sock.settimeout(5)
                assert "instance" in json.loads(sock.makefile("rb").readline())
            until(lambda: len(served.conns) == 40 and not served.unproven)
    finally:
        served.close()


# -- where it listens ---------------------------------------------------------------------------
def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_node_0_s_store_listens_where_the_launchers_are_told_to_reach_it(tmp_path: Path) -> None:
    """Node 0's launcher serves the store at the job's rendezvous host (`NodeEnv.rdzv_host`:
    the Slurm node's name; the local backend's 127.0.0.1), not on every interface: it was
    reached through any address of the host (here 127.0.0.2, which loopback answers too)."""
    port = ports.listen_ports(1, "127.0.0.1")[0]
    chan = coord.Channel(tmp_path, 0)
    assert chan.open("127.0.0.1", port, KEY, attempt=0, serve=True)
    try:
        assert refused("127.0.0.2", port)
        assert coord.Client("127.0.0.1", port, KEY, 1).connect(time.monotonic() + 2)
        assert chan.server is not None and chan.server.bound == ["127.0.0.1"]
    finally:
        chan.close()


def test_the_standby_and_a_store_served_anew_listen_at_their_host(tmp_path: Path,
                                                                 server: coord.Server) -> None:
    """Node 1's standby, at the host it says in `standby/A/0`; a decider's store served
    anew (`Supervisor._serve_anew`), at the host its decision names (`Supervisor._host`)."""
    from tests.unit.test_launch_races import make_supervisor

    one = coord.Channel(tmp_path, 1)
    assert one.open("127.0.0.1", server.port, KEY, attempt=0, serve=False)
    try:
        assert one.stand_by("127.0.0.1") and one.standby is not None
        assert refused("127.0.0.2", one.standby.port) and one.standby.bound == ["127.0.0.1"]
    finally:
        one.close()
    sup = make_supervisor(tmp_path / "run", owner="", node_rank=1, nnodes=2)
    sup.chan.lost_why = "the store on 127.0.0.1 (node 0's launcher) went silent"
    anew = sup._serve_anew()
    assert anew is not None
    try:
        assert refused("127.0.0.2", anew.port) and anew.bound == [sup._host()] == ["127.0.0.1"]
    finally:
        anew.close()


def resolving(monkeypatch: pytest.MonkeyPatch, names: dict[str, list[str]]) -> None:
    """These host names resolve to these addresses (as /etc/hosts or DNS would say)."""
    real = socket.getaddrinfo

    def fake(host: Any, *args: Any, **kw: Any) -> Any:
        if host not in names:
            return real(host, *args, **kw)
        return [found for address in names[host] for found in real(address, *args, **kw)]

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_a_name_that_means_loopback_here_only_listens_on_every_interface(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's /etc/hosts names the host itself `127.0.1.1 NAME`: the peers, on other
    hosts, resolve NAME to its real address, which this host cannot learn from the name.
    Bound to 127.0.1.1, a multi-host job's store would be out of every peer's reach; on
    every interface it is where they come (and the local Slurm's node names, all
    127.0.0.1 on one host, work as before)."""
    resolving(monkeypatch, {"node0.debian": ["127.0.1.1"], "node0.both": ["127.0.1.1", "192.0.2.77"]})
    served = coord.Server(KEY, 0, "node0.debian").start()
    try:  # (a peer here comes by another address than 127.0.1.1, as a peer elsewhere does)
        assert coord.Client("127.0.0.1", served.port, KEY, 1).connect(time.monotonic() + 2)
        assert served.bound in (["::"], ["0.0.0.0"])
    finally:
        served.close()
    assert ports.addresses("node0.debian") == []
    assert [a for _, (a, *_) in ports.addresses("node0.both")] == ["192.0.2.77"]
    assert [a for _, (a, *_) in ports.addresses("127.0.0.1")] == ["127.0.0.1"]  # (an address as given)
    assert [a for _, (a, *_) in ports.addresses("::1")] == ["::1"]


def this_host_s_addresses() -> list[str]:
    """This host's addresses off loopback (the ones its routes leave by), if any."""
    found = []
    for family, target in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # (no packet is sent: the kernel picks a route)
            address = str(probe.getsockname()[0])
            if address not in ("127.0.0.1", "::1"):
                found.append(address)
    return found


def test_a_name_with_this_host_s_address_listens_there_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm node's name that resolves to its addresses (IPv4 and IPv6 alike) is listened
    on at each of them, on one port, and nowhere else (not loopback)."""
    mine = this_host_s_addresses()
    if not mine:
        pytest.skip("this host has no address but loopback")
    resolving(monkeypatch, {"node0.cluster": mine})
    served = coord.Server(KEY, 0, "node0.cluster").start()
    try:
        assert sorted(served.bound) == sorted(mine)
        for address in mine:
            client = coord.Client(address, served.port, KEY, mine.index(address))
            assert client.connect(time.monotonic() + 2), address
            client.close()
        assert refused("127.0.0.1", served.port)
    finally:
        served.close()


def test_a_name_for_an_address_this_host_does_not_have_listens_on_every_interface(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The name leads elsewhere here (a NAT, a floating address): bound nowhere, the store
    would fail and the job keep to the files; as before, every interface."""
    resolving(monkeypatch, {"node0.nat": ["203.0.113.7"]})
    served = coord.Server(KEY, 0, "node0.nat").start()
    try:
        assert served.bound in (["::"], ["0.0.0.0"])
    finally:
        served.close()


def test_a_name_that_does_not_resolve_here_listens_on_every_interface(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0's own look-up of its name failed (EAI_AGAIN: a DNS server busy as every node of
    the job starts); the peers' did not. Taken for a failed bind, it kept the whole attempt
    on the files; as before, the store listens on every interface, and the peers come."""
    real, looked = socket.getaddrinfo, list[str]()

    def flaky(host: Any, *args: Any, **kw: Any) -> Any:
        if host != "node0.flaky":
            return real(host, *args, **kw)
        looked.append(host)
        if len(looked) == 1:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real("127.0.0.1", *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", flaky)
    port = ports.listen_ports(1, "127.0.0.1")[0]
    chan = coord.Channel(tmp_path, 0)
    try:
        assert chan.open("node0.flaky", port, KEY, attempt=0, serve=True), chan.lost_why
        assert chan.server is not None and chan.server.bound in (["::"], ["0.0.0.0"])
        assert coord.Client("node0.flaky", port, KEY, 1).connect(time.monotonic() + 2)
    finally:
        chan.close()


def test_a_store_may_hold_more_connections_than_the_usual_soft_limit() -> None:
    """A store of 500 launchers holds 500 connections and up to 1,064 more waiting for their
    hello: past a soft limit of 1,024 open files, which the launcher never raised (measured
    in review: node 0's next open failed with EMFILE, and a launcher could not connect). The
    store raises it to the hard limit, the site's to set."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip(f"the hard limit here is {hard}: no finite one above 1,024 to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        served = coord.Server(KEY, 0, "127.0.0.1").start()
        served.close()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
