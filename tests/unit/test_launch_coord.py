"""The launchers' store (`launch.coord`): one answer per contested key, pushes to every
launcher, a store that goes silent given up for the files, and a stranger kept out. In
one process: the server's loop and each client's reader are threads, over loopback."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import coord
from hpcshard.launch.liveness import Peers
from hpcshard.rundir import launchers

KEY = "k" * 32


@pytest.fixture
def server() -> Iterator[coord.Server]:
    found = coord.Server(KEY, 0, "127.0.0.1").start()
    yield found
    found.close()


def channel(tmp_path: Path, server: coord.Server, node: int) -> coord.Channel:
    chan = coord.Channel(tmp_path, node)
    assert chan.open("127.0.0.1", server.port, KEY, attempt=0, serve=False)
    return chan


def until(check: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


def test_the_first_declaration_and_decision_stand_and_reach_every_launcher(tmp_path: Path,
                                                                         server: coord.Server) -> None:
    a, b, c = (channel(tmp_path, server, n) for n in range(3))
    assert a.declare_fault(0, 0, {"cause": "rank 3 died", "node": 0})
    assert not b.declare_fault(0, 0, {"cause": "exit 1", "node": 1})
    until(lambda: c.fault(0, 0) is not None)  # pushed: c asked nothing
    assert c.fault(0, 0)["cause"] == "rank 3 died" == b.fault(0, 0)["cause"]  # type: ignore[index]
    assert c.fault(0, 1) is None and c.fault(1, 0) is None
    assert b.decide(0, 0, {"restart": True, "port": 1})["port"] == 1
    assert a.decide(0, 0, {"restart": False})["port"] == 1  # the first decider's stands
    until(lambda: c.decision(0, 0) is not None)
    assert c.decision(0, 0) == {"restart": True, "port": 1}
    # Nothing of it went through the run directory but the decision's one file, created
    # exclusively (the arbiter of a job cut in two), and never polled.
    assert not list((tmp_path / launchers.LAUNCH).glob("fault-*"))
    assert [p.name for p in (tmp_path / launchers.LAUNCH).glob("next-*")] == ["next-0-0.json"]
    for chan in (a, b, c):
        chan.close()


def test_a_launcher_connecting_late_gets_what_was_pushed_before(tmp_path: Path, server: coord.Server) -> None:
    a = channel(tmp_path, server, 0)
    a.declare_fault(2, 1, {"cause": "x"})
    a.fence(2, "taken over by job 9")
    late = channel(tmp_path, server, 1)
    assert late.fault(2, 1) == a.fault(2, 1) and late.fenced(2) == "taken over by job 9"


def test_downs_and_heartbeats_go_to_those_who_ask(tmp_path: Path, server: coord.Server) -> None:
    a, b = channel(tmp_path, server, 0), channel(tmp_path, server, 1)
    b.mark_down(0, 3, 1, {"dead": [{"rank": 2}], "reached": 7})
    a.mark_down(0, 3, 0, {"dead": [], "reached": 7})
    assert a.nodes_down(0, 3, 2) == [0, 1] and a.downs(0, 3, 2)[1]["dead"] == [{"rank": 2}]
    # (who is down: the names alone cross the wire, not each node's ranks and flight records)
    bare = a.store.call("scan", prefix="down/0/3/", keys=True) if a.store else {}
    assert bare["values"] == {"down/0/3/0": None, "down/0/3/1": None}
    b.beat(0, 1, {"pid": 5, "seq": 1})
    # A node first asked for is fetched at once, then watched: each heartbeat brings it.
    until(lambda: a.beats(0, 2, [1]).get(1, {}).get("seq") == 1)
    b.beat(0, 1, {"pid": 5, "seq": 2})
    time.sleep(0.1)
    a.beat(0, 0, {"pid": 4, "seq": 1})
    until(lambda: a.beats(0, 2, [1])[1]["seq"] == 2)
    assert 0 not in a.beats(0, 2)  # (its own is never among them)


def test_a_store_that_stops_answering_is_given_up_for_the_files(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose host froze: the connection stays up and nothing comes back. After
    LOST_S of silence the launcher takes node 0 for lost and carries on through the files."""
    monkeypatch.setattr(coord, "LOST_S", 0.5)
    frozen = socket.create_server(("127.0.0.1", 0))
    port = frozen.getsockname()[1]

    def hello_then_freeze() -> None:
        conn, _ = frozen.accept()
        conn.recv(4096)
        conn.sendall(json.dumps({"id": 0, "instance": "i", "pushed": {}}).encode() + b"\n")
        time.sleep(60)  # (reads nothing more, answers nothing; its close is not what gives it up)
        conn.close()

    threading.Thread(target=hello_then_freeze, daemon=True).start()
    chan = coord.Channel(tmp_path, 1)
    assert chan.open("127.0.0.1", port, KEY, attempt=0, serve=False)
    chan.beat(0, 1, {"pid": 1, "seq": 1})
    assert chan.store is not None  # (not yet: silence is timed)
    began = time.monotonic()
    assert chan.declare_fault(0, 0, {"cause": "node 0 lost"})  # waits, gives up, then the files
    # LOST_S of silence, and not the minute until the frozen store's close: its silence gave it up
    assert 0.4 < time.monotonic() - began < 30
    assert chan.store is None and "did not answer" in chan.lost_why
    assert launchers.fault(tmp_path, 0, 0)["cause"] == "node 0 lost"  # type: ignore[index]
    chan.beat(0, 1, {"pid": 1, "seq": 2})
    assert launchers.beats(tmp_path, 0, 2)[1]["seq"] == 2
    frozen.close()


def test_a_store_whose_launcher_died_is_given_up_at_once(tmp_path: Path) -> None:
    server = coord.Server(KEY, 0, "127.0.0.1").start()
    chan = channel(tmp_path, server, 1)
    server.close()  # (its process gone: the kernel closes its connections)
    until(lambda: chan.store is None, coord.LOST_S / 2)  # (at once: not after LOST_S of silence)
    assert chan.decision(0, 0) is None and chan.lost_why


def test_a_launcher_that_stood_still_does_not_blame_the_store(tmp_path: Path, server: coord.Server,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that waited while this launcher itself was stopped are not the store's
    silence: `woke` times them from now (the supervisor calls it after a stall)."""
    monkeypatch.setattr(coord, "LOST_S", 0.3)
    chan = channel(tmp_path, server, 1)
    client = chan.client
    assert client is not None
    client.heard = time.monotonic() - 10  # as after a stall: nothing read for 10 s...
    client.pending[999] = (time.monotonic() - 10, threading.Event(), [], None)  # ...one sent before it
    assert client.silent()
    chan.woke()
    assert not client.silent()
    del client.pending[999]


def test_a_stranger_an_older_attempt_or_a_second_node_0_is_refused(tmp_path: Path,
                                                                   server: coord.Server) -> None:
    began = time.monotonic()
    assert not coord.Client("127.0.0.1", server.port, "wrong", 0).connect(time.monotonic() + 0.5)
    assert time.monotonic() - began < 3
    assert not coord.Client("127.0.0.1", server.port, KEY, 0, attempt=1).connect(time.monotonic() + 0.3)
    assert not server.conns
    first = channel(tmp_path, server, 0)
    assert not coord.Client("127.0.0.1", server.port, KEY, 0).connect(time.monotonic() + 0.3)
    assert first.store is not None and list(server.conns) == [0]  # (the first keeps its place)


def test_a_port_taken_leaves_the_job_on_the_files(tmp_path: Path, server: coord.Server,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coord, "UNHEARD_S", 0.5)
    chan = coord.Channel(tmp_path, 0)
    assert not chan.open("127.0.0.1", server.port + 0, "other key", attempt=0, serve=False)
    assert chan.store is None and "no store answered" in chan.lost_why
    taken = coord.Channel(tmp_path, 0)
    assert not taken.open("127.0.0.1", server.port, KEY, attempt=0, serve=True)  # (bind fails)
    assert "could not serve" in taken.lost_why
    # Either way each launcher's heartbeat file is there from its start.
    assert launchers.beats(tmp_path, 0, 1)[0]["seq"] == 0


def test_peers_that_left_the_store_are_known_to_its_host(tmp_path: Path, server: coord.Server) -> None:
    """A peer that gives the store up closes its connection; one that ended said so first
    (its last heartbeat): only the first kind left it (`Supervisor._store_left`)."""
    a, b, c = (channel(tmp_path, server, n) for n in range(3))
    c.beat(0, 2, {"pid": 3, "seq": 9, "done": 0})
    until(lambda: 2 in server.ended)
    b.close()
    c.close()
    until(lambda: not {1, 2} & set(server.conns))
    assert server.left() == {1}
    a.close()


def test_an_older_heartbeat_read_later_is_not_a_sign_of_life() -> None:
    """After a fallback to the files a node's first heartbeat file (seq 0) is read after its
    store heartbeats (seq 57): not movement, or a frozen node 0 would seem alive LOST_S more."""
    peers = Peers(began=0.0, heard_since=0.0)
    peers.observe({0: {"pid": 7, "seq": 57}}, now=1.0)
    assert peers.lost([0], {0: {"pid": 7, "seq": 0}}, now=10.0) == [0]
    assert peers.lost([0], {0: {"pid": 7, "seq": 58}}, now=11.0) == []


def test_hpcshard_coord_names_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCSHARD_COORD", "file")
    with pytest.raises(ValueError, match="HPCSHARD_COORD='file' is not one of store, files"):
        coord.mode()
    monkeypatch.setenv("HPCSHARD_COORD", "files")
    assert coord.mode() == "files"


def test_node_0_thawed_after_its_peers_left_its_store_leaves_the_run(tmp_path: Path) -> None:
    """Node 0 froze past LOST_S; its peers gave its store up (said so, closed their connections),
    declared it lost through the files and went on. Thawed, it must not train on nor speak
    for the run: it finds them gone from its store and is fenced. A stall its peers sat
    out (still connected) is not."""
    from hpcshard.launch.supervise import Fenced
    from tests.unit.test_launch_races import make_supervisor

    sup = make_supervisor(tmp_path / "run", owner="", nnodes=2)
    sup.chan.server = coord.Server(KEY, 0, "127.0.0.1").start()
    peer = channel(tmp_path / "run", sup.chan.server, 1)
    sup._stood_still(3 * coord.LOST_S)  # (its peer still there: it carries on)
    peer._give_up("the store on 127.0.0.1 (node 0's launcher) went silent")
    until(lambda: sup.chan.server is not None and sup.chan.server.quit == {1})
    with pytest.raises(Fenced, match="its peers left its store"):
        sup._stood_still(3 * coord.LOST_S)
    sup.chan.close()


def test_a_peer_that_found_the_run_taken_over_takes_every_launcher_out(tmp_path: Path,
                                                                      server: coord.Server) -> None:
    from hpcshard.launch.supervise import TakenOver
    from tests.unit.test_launch_races import make_supervisor

    sup = make_supervisor(tmp_path / "run", owner="", nnodes=2)
    sup.chan = channel(tmp_path / "run", server, 0)
    channel(tmp_path / "run", server, 1).fence(0, "taken over by job 7")
    until(lambda: sup.chan.fenced(0) != "")
    with pytest.raises(TakenOver, match="job 7"):
        sup.lost([1])


def test_flight_records_travel_in_the_down_record_cut_to_what_names_the_missing_rank(tmp_path: Path) -> None:
    """On NFS the decider may not see another host's new flight files for 30-60 s: each
    launcher reads its own ranks' (written on its host) and sends them, cut to each group's
    newest collective, in its down record. What `missing` finds is the same."""
    from hpcshard.rundir import flight

    def record(rank: int, enqueued: int, completed: int) -> dict[str, object]:
        entries = [{"process_group": ["0", ""], "collective_seq_id": s, "profiling_name": f"gloo:op{s}",
                    "input_sizes": [[s]]} for s in range(1, enqueued + 1)]
        return {"rank": rank, "entries": entries,
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": [0, 1, 2]}},
                "pg_status": {"0": {"last_enqueued_collective": enqueued,
                                    "last_completed_collective": completed}}}

    full = {0: record(0, 110, 109), 1: record(1, 109, 109), 2: record(2, 110, 109)}
    where = flight.folder(tmp_path, 0, 0)
    where.mkdir(parents=True)
    for rank, rec in full.items():
        (where / f"rank-{rank}.json").write_text(json.dumps(rec))
    mine = flight.read_ranks(tmp_path, 0, 0, [0, 1, 2, 3])  # (rank 3: no record, stopped)
    assert sorted(mine) == [0, 1, 2] and all(len(r["entries"]) == 1 for r in mine.values())
    assert len(json.dumps(mine)) < len(json.dumps(full)) / 20
    sent = json.loads(json.dumps({str(r): rec for r, rec in mine.items()}))  # (as the store carries it)
    assert flight.missing({int(r): rec for r, rec in sent.items()}) == flight.missing(full)
    assert flight.missing(full)[0]["missing"] == [1] and flight.missing(full)[0]["op"] == "gloo:op110"


def test_a_launcher_that_fell_back_alone_leaves_instead_of_blaming_the_others(tmp_path: Path) -> None:
    """It gave node 0's store up; each peer gets LOST_S from then to show up in the files.
    When most have not (they stayed with the store: it was this one that was cut off or
    starved), it leaves the run and declares nobody lost. Measured before: at 128 emulated
    nodes one starved launcher fell back alone and declared 118 healthy nodes lost."""
    from hpcshard.launch.supervise import Fenced
    from tests.unit.test_launch_races import make_supervisor

    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=2, nnodes=5)
    (run / launchers.LAUNCH).mkdir(exist_ok=True)
    for n in range(5):  # (what the store showed last, and the start-up files)
        launchers.beat(run, 0, n, {"pid": 100 + n, "seq": 0})
    sup.peers.observe({n: {"pid": 100 + n, "seq": 40} for n in range(4)})  # (node 4 never watched)
    sup.chan.fell_back, sup.chan.gave_up, sup.chan.moves = True, {0}, 1
    sup._isolated()  # (the fallback: a grace for the others, not for node 0)

    def later(seconds: float) -> None:
        sup.peers.seen = {n: (mark, at - seconds) for n, (mark, at) in sup.peers.seen.items()}
        sup.peers.heard_since -= seconds
        sup.peers.began -= seconds

    later(coord.UNHEARD_S + coord.LOST_S - 1)  # (the grace: as long as NFS may hide their files)
    sup._isolated()  # nobody lost yet, the one never watched (node 4) neither
    later(2)
    launchers.beat(run, 0, 1, {"pid": 101, "seq": 41})  # node 1 fell back too
    launchers.beat(run, 0, 3, {"pid": 103, "seq": 41})  # and node 3
    sup._isolated()  # 1 of 3 (node 4) did not: node 0 is lost, not this launcher
    assert sup.lost([0]) == [0]
    later(coord.LOST_S + 1)
    launchers.beat(run, 0, 1, {"pid": 101, "seq": 42})  # only node 1 moves on
    with pytest.raises(Fenced, match="2 of its 3 other peers did not: it is the one cut off"):
        sup._isolated()
    assert not ledger_has_bad(run)


def ledger_has_bad(run: Path) -> bool:
    from hpcshard.rundir import ledger

    return bool(ledger.bad_nodes(run))


def test_the_launcher_serving_the_store_never_gives_its_own_up(tmp_path: Path, server: coord.Server,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 starved of the CPU answers itself late; it is not cut off from itself."""
    monkeypatch.setattr(coord, "LOST_S", 0.2)
    chan = channel(tmp_path, server, 0)
    chan.server = server
    client = chan.client
    assert client is not None
    client.pending[999] = (time.monotonic() - 10, threading.Event(), [], None)
    client.heard = time.monotonic() - 20
    assert client.silent() and chan.store is client
    chan.server = None
    assert chan.store is None and chan.fell_back


def test_a_store_served_anew_on_a_free_port_is_reached_on_every_address_family(tmp_path: Path) -> None:
    """`Supervisor._serve_anew` serves on port 0, every interface: asyncio bound one socket
    per family, each on a free port of its own, and named either one's (measured here: `::`
    on 34013, 0.0.0.0 on 36389): launchers reaching the decider's host by the other family
    found nothing there, and waited UNHEARD_S in vain at the start of the next cycle."""
    served = coord.Server(KEY, 0).start()
    families = ["127.0.0.1"]
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        families.append("::1")
    try:
        for host in families:
            client = coord.Client(host, served.port, KEY, families.index(host))
            assert client.connect(time.monotonic() + 0.5), host
            client.close()
    finally:
        served.close()


def test_the_store_sends_each_line_as_it_is_written(tmp_path: Path) -> None:
    """TCP_NODELAY on every connection the store accepted: asyncio sets it only where the
    socket's proto says TCP, and `socket.create_server`'s accepted sockets say 0. Without
    it a push written right behind an answer waited for the launcher's delayed ACK (Nagle):
    every launcher heard the decision 40 ms after the store set it (`bench.coord_scale`)."""
    for host in ("127.0.0.1", ""):  # (the store's host named; and every interface, dual-stack)
        served = coord.Server(KEY, 0, host).start()
        try:
            chan = coord.Channel(tmp_path, 1)
            assert chan.open("127.0.0.1", served.port, KEY, attempt=0, serve=False)
            until(lambda s=served: 1 in s.conns)  # type: ignore[misc]
            sock = served.conns[1][0].get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, host
            chan.close()
        finally:
            served.close()


def test_heartbeats_landing_on_the_reader_thread_do_not_break_a_read_of_them(
        tmp_path: Path, server: coord.Server) -> None:
    """A heartbeat's answer lands on the client's reader thread (`Channel.beat`'s `then`),
    which adds each node first heard (a launcher that started late) to `beats_seen` while
    the supervisor reads them: iterating the dict as it grew raised RuntimeError in the
    supervisor, which kills its ranks and ends the launcher with 1."""
    chan = channel(tmp_path, server, 0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (the race, made likely)
    try:
        chan.beats_seen.update({n: {"seq": 1} for n in range(1, 2000)})
        chan.watched |= set(range(1, 2000))
        stop = threading.Event()

        def landing() -> None:  # (what `landed` does on the reader thread)
            n = 2000
            while not stop.is_set() and n < 1_000_000:
                chan.beats_seen[n] = {"seq": 1}
                n += 1

        thread = threading.Thread(target=landing, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline and thread.is_alive():
                chan.beats(0, 2000)
        finally:
            stop.set()
            thread.join()
    finally:
        sys.setswitchinterval(interval)
        chan.close()


def test_a_launcher_waiting_for_the_store_beats_in_the_files_meanwhile(
        tmp_path: Path, server: coord.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 could not serve the store (its port, derived from the job id, taken: here by
    another job's store, which refuses this job's key) and went on through the files. Node 1
    tried to connect for UNHEARD_S with its heartbeat file at seq 0: node 0 timed its
    silence from there, declared it lost after LOST_S and drained it where asked."""
    from dataclasses import replace

    from tests.unit.test_launch_races import make_supervisor

    monkeypatch.setattr(coord, "UNHEARD_S", 3.0)
    sup = make_supervisor(tmp_path / "run", owner="", node_rank=1, nnodes=2)
    sup.node = replace(sup.node, coord_port=server.port)
    opening = threading.Thread(target=sup._open, daemon=True)
    opening.start()
    seen = set()
    while opening.is_alive():
        seen.add(launchers.beats(tmp_path / "run", 0, 2).get(1, {}).get("seq"))
        time.sleep(0.1)
    assert sup.chan.store is None and "no store answered" in sup.chan.lost_why
    assert len(seen - {None}) >= 3, seen  # (its heartbeat moved all along)


def serving_supervisor(run_dir: Path, nnodes: int = 3) -> tuple[Any, coord.Server]:
    """Node 0's supervisor, serving its store and connected to it, as `_run` leaves it."""
    from tests.unit.test_launch_races import make_supervisor

    sup = make_supervisor(run_dir, owner="", nnodes=nnodes)
    served = coord.Server(KEY, 0, "127.0.0.1").start()
    sup.chan = channel(run_dir, served, 0)
    sup.chan.server = served
    return sup, served


def test_a_launcher_looks_for_the_decider_two_at_a_time_from_the_lowest(tmp_path: Path) -> None:
    """After a fault every launcher finds its decider, the lowest one not lost. Watching
    every launcher below it, N launchers brought N^2/2 heartbeats through node 0's store
    with every beat of the recovery (at 512 nodes 11 MB and 0.37 s of its loop). It looks
    at two at a time: the next two only once those are gone (two lowest lost at once are
    still both seen lost after LOST_S, not one LOST_S after the other)."""
    from tests.unit.test_launch_races import make_supervisor

    run = tmp_path / "run"
    served = coord.Server(KEY, 0, "127.0.0.1").start()
    sup = make_supervisor(run, owner="", node_rank=5, nnodes=8)
    sup.chan = channel(run, served, 5)
    peers = [channel(run, served, n) for n in range(8) if n != 5]
    try:
        for peer in peers:
            peer.beat(0, peer.node, {"pid": 100 + peer.node, "seq": 1})
        until(lambda: {f"alive/0/{n}" for n in (0, 1, 2, 3, 4)} <= set(served.data))
        assert sup.decider() == 0
        assert set(sup.chan.asked) == {0, 1}  # (not 2, 3, 4: nor brought by its heartbeats)
        # Nodes 0 and 1 lost together (their heartbeats stood still for LOST_S): node 2
        # decides, and node 4 is still not watched.
        sup.peers.heard_since -= coord.LOST_S + 1
        for gone in (0, 1):
            mark, _ = sup.peers.seen[gone]
            sup.peers.seen[gone] = (mark, time.monotonic() - coord.LOST_S - 1)
        assert sup.decider() == 2
        assert set(sup.chan.asked) == {0, 1, 2, 3}
    finally:
        for chan in [*peers, sup.chan]:
            chan.close()
        served.close()


def test_node_0_whose_peer_gave_its_store_up_leaves_the_run_though_it_never_stood_still(
        tmp_path: Path) -> None:
    """Node 0's launcher ran on, but its store did not answer node 1 for LOST_S (its loop
    behind under load, a network blip): node 1 gave the store up, went on through the files
    and took node 0 for lost there, while node 0, on its store, took node 1 for lost (its
    heartbeats stopped coming) and decided on its own: two decisions for one cycle, a
    healthy node drained on each side. Node 0 must leave as soon as it hears of it, and its
    store with it (every other launcher then falls back too)."""
    from hpcshard.launch.supervise import Fenced

    sup, served = serving_supervisor(tmp_path / "run")
    try:
        peer = channel(tmp_path / "run", served, 1)
        ended = channel(tmp_path / "run", served, 2)
        ended.beat(0, 2, {"pid": 3, "seq": 1, "done": 0})  # (one that ended is no such thing)
        until(lambda: 2 in served.ended)
        ended.close()
        sup.beaten = 0.0
        sup.beat()
        peer._give_up("the store on 127.0.0.1 (node 0's launcher) went silent")
        until(lambda: 1 in served.left())
        sup.beaten = 0.0
        with pytest.raises(Fenced, match=r"node\(s\) \[1\] gave its store up"):
            sup.beat()
    finally:
        sup.chan.close()


def test_node_0_whose_own_store_went_silent_to_it_leaves_the_run(tmp_path: Path) -> None:
    """Node 0's own connection gave its store up (its loop stood LOST_S behind): every peer
    will too, and take node 0 for lost; node 0 leaves rather than go on alone."""
    from hpcshard.launch.supervise import Fenced

    sup, _ = serving_supervisor(tmp_path / "run", nnodes=2)
    try:
        sup.chan._give_up("the store on 127.0.0.1 (node 0's launcher) went silent")
        sup.beaten = 0.0
        with pytest.raises(Fenced, match="its own store"):
            sup.beat()
    finally:
        sup.chan.close()


def test_a_peer_whose_launcher_died_does_not_take_node_0_out(tmp_path: Path) -> None:
    """A launcher killed (SIGKILL, the OOM killer) closes its connection without a word:
    a node lost like any other, for node 0 to declare; not a peer that gave the store up."""
    sup, served = serving_supervisor(tmp_path / "run", nnodes=2)
    try:
        peer = channel(tmp_path / "run", served, 1)
        assert peer.client is not None
        peer.client.close()
        until(lambda: 1 not in served.conns)
        sup.beaten = 0.0
        sup.beat()  # (no Fenced)
    finally:
        sup.chan.close()


def test_node_0_fenced_closes_its_store_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fenced (thawed after its peers left, or told a peer gave its store up), node 0 kept
    its store open LINGER_S for the launchers still on it: they went on through it, the
    others through the files, each side deciding for itself. Closed at once, they fall back
    to the files with the others."""
    from hpcshard.launch import supervise
    from hpcshard.launch.supervise import Fenced

    sup, served = serving_supervisor(tmp_path / "run", nnodes=3)
    still = channel(tmp_path / "run", served, 2)  # (a peer still on the store)

    def fenced() -> int:
        raise Fenced("its peers left its store while it stood still for 9 s")

    monkeypatch.setattr(sup, "_run", fenced)
    monkeypatch.setattr(supervise, "kill_below", lambda pid: [])
    began = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - began < supervise.LINGER_S / 2  # closed at once, not kept LINGER_S
    until(lambda: still.store is None, 2)


def test_a_decider_that_cannot_reach_the_store_it_served_anew_closes_it_and_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own store unreachable (as the others find it too: they stay on the files), the
    decider closes it rather than take its silence for its peers having left it."""
    from hpcshard.launch.policy import Action, Decision
    from tests.unit.test_launch_races import make_supervisor

    monkeypatch.setattr(coord, "UNHEARD_S", 0.5)
    sup = make_supervisor(tmp_path / "run", owner="", node_rank=1, nnodes=2)
    sup.chan._give_up("the store on 127.0.0.1 (node 0's launcher) went silent")
    served = coord.Server("not this job's key", 0).start()
    sup._join(Decision(action=Action.RESTART, reason="node 0 lost", active=(1,), host="127.0.0.1", port=1,
                       coord_port=served.port), 1)
    assert sup.chan.server is None and coord.Server.serving(served.port) is None
    sup.beaten = 0.0
    sup.beat()  # (not fenced: it serves nothing)


def test_answers_waiting_to_be_read_are_not_the_store_s_silence(tmp_path: Path) -> None:
    """This launcher stood still past LOST_S (its node frozen) with a request out: thawed,
    any of its threads (a write `_try` runs on one) may ask `silent()` before the reader
    thread has read the answers that came meanwhile, and before the supervisor's beat calls
    `woke`. The store answered: giving it up then (and saying so: node 0 leaves the run
    for it) would be this launcher's standstill blamed on the store."""
    mine, theirs = socket.socketpair()
    client = coord.Client("127.0.0.1", 1, KEY, 1)
    client.sock = mine  # (connected; its reader thread not yet run, as just after a thaw)
    client.heard = time.monotonic() - 20
    client.pending[7] = (time.monotonic() - 10, threading.Event(), [], None)
    theirs.sendall(b'{"id":7,"values":{}}\n')
    try:
        assert not client.silent()
        mine.recv(4096)  # (read, and nothing came: that is silence)
        assert client.silent()
    finally:
        mine.close()
        theirs.close()


def test_a_stranger_s_garbage_is_refused_quietly(server: coord.Server,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Anything may connect to the store's port (a port scanner, another program): a line of
    JSON that is no object was an AttributeError out of the handler, a traceback in node 0's
    log each time. Refused like any stranger; the store serves on."""
    for line in (b"null\n", b"[1]\n", b'"x"\n'):
        with socket.create_connection(("127.0.0.1", server.port)) as stranger:
            stranger.sendall(line)
            stranger.settimeout(2)
            assert stranger.recv(100) == b""
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert coord.Client("127.0.0.1", server.port, KEY, 1).connect(time.monotonic() + 1)


def test_a_run_whose_spec_has_no_key_stays_on_the_files(tmp_path: Path) -> None:
    """A spec written before the store has no key, and a store of that key lets in anyone
    who says the same nothing: another such job's launchers on a port both derived (job ids
    5,000 apart give one's store the other's rendezvous port; 10,000 apart, the same store
    port), or any user of the cluster, who would push a fault, a decision or a fence into
    this job. Its launchers keep to the files, the protocol they were written for."""
    from dataclasses import replace

    from tests.unit.test_launch_races import make_supervisor

    keyless = coord.Server("", 0, "127.0.0.1").start()
    try:
        sup = make_supervisor(tmp_path / "run", owner="", node_rank=1, nnodes=2)
        sup.spec.coord_key = ""
        sup.node = replace(sup.node, coord_port=keyless.port)
        sup._open()
        assert sup.chan.store is None and not keyless.conns
    finally:
        keyless.close()


def test_a_cycle_decided_in_the_store_is_over_for_its_ranks_at_one_read_of_the_ledger(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank that fails asks `launchers.over` (thousands at once after a fault on a big
    job, the ledger on shared storage): the decision in node 0's store, the decider's fault
    record says the cycle is over; the ledger was read twice for it (that, then `moved_on`)."""
    from hpcshard.rundir import events, ledger

    reads = []
    read = ledger.read

    def counted(run_dir: Path) -> list[dict[str, Any]]:
        reads.append(run_dir)
        return read(run_dir)

    monkeypatch.setattr(ledger, "read", counted)
    assert not launchers.over(tmp_path, 0, 1) and len(reads) == 1
    ledger.append(tmp_path, events.Start(attempt=0, cycle=1, nodes=1, world=1, host="h"))
    assert launchers.over(tmp_path, 0, 0) and not launchers.over(tmp_path, 0, 1)
    reads.clear()
    ledger.append(tmp_path, events.Fault(
        attempt=0, cycle=1, cause="x", declared=None, culprit=None, reached=0, action="restart", code=0,
        reason="", end="", active=[0], spares=[], bad=[], replaced={}, lost=[], committed=0, host="h",
        port=1, restart=True, lost_steps=0, detect_s=0.2, collectives=[]))
    assert launchers.over(tmp_path, 0, 1) and not launchers.over(tmp_path, 1, 1) and len(reads) == 2


def test_launchers_late_to_a_store_served_anew_are_heard_through_the_files_meanwhile(
        tmp_path: Path, server: coord.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decider serves a new store and joins it at once; the others learn of it from the
    decision's file, as late as NFS's lookup cache shows it (30-60 s), beating in the files
    meanwhile. The new cycle's leader heard them in its store only: silent for LOST_S there
    (at once: its last look at a node that said it was down was before the recovery), a
    healthy node was declared lost; a launcher that joined first took its late leader for
    lost the same way."""
    from hpcshard.launch.liveness import LOST_S

    leader = coord.Channel(tmp_path, 1, first_cycle=1)
    assert leader.open("127.0.0.1", server.port, KEY, attempt=0, serve=False)
    peers = Peers(began=0.0, heard_since=0.0)
    now = time.monotonic()
    peers.observe({2: {"pid": 9, "seq": 40}}, now=now - 30)  # (its last look, before the recovery)
    launchers.beat(tmp_path, 0, 2, {"pid": 9, "seq": 57})  # (node 2, still waiting on the files)
    assert peers.lost([2], leader.beats(0, 3, [2]), now=now) == []
    late = channel(tmp_path, server, 2)
    late.beat(0, 2, {"pid": 9, "seq": 58})
    leader.beat(0, 1, {"pid": 8, "seq": 1})
    until(lambda: leader.beats(0, 3, [2]).get(2, {}).get("seq") == 58)  # (joined: the store's)
    # A launcher that never joins is judged by the store once the others had time to find it.
    monkeypatch.setattr(coord, "JOIN_S", 0.0)
    launchers.beat(tmp_path, 0, 0, {"pid": 7, "seq": 99})
    assert 0 not in leader.beats(0, 3, [0, 2])
    assert peers.lost([0], leader.beats(0, 3, [0]), now=now + LOST_S + 1) == [0]


def test_a_push_right_behind_the_hello_s_answer_is_kept(tmp_path: Path) -> None:
    """The store writes what it pushes to every connection the moment it is set, so a fault
    or a decision can follow the answer to a launcher's hello in the same read: the hello
    was read through a buffered file of its own, dropped with what it had read ahead."""
    listening = socket.create_server(("127.0.0.1", 0))

    def store() -> None:
        conn, _ = listening.accept()
        conn.recv(4096)
        conn.sendall(b'{"id":0,"instance":"i","pushed":{}}\n{"push":"fault/0/0","value":{"cause":"x"}}\n')
        time.sleep(60)  # (then nothing more, until long after the test looked)
        conn.close()

    threading.Thread(target=store, daemon=True).start()
    chan = coord.Channel(tmp_path, 1)
    try:
        assert chan.open("127.0.0.1", listening.getsockname()[1], KEY, attempt=0, serve=False)
        until(lambda: chan.fault(0, 0) is not None, 30)  # (the push, not anything after the close)
    finally:
        chan.close()
        listening.close()


def test_node_0_stays_when_a_few_peers_gave_its_store_up_and_leaves_when_most_did(tmp_path: Path) -> None:
    """The same count seen from both sides: a minority that gave the store up is the side
    cut off (it leaves by itself: `_isolated`), so node 0 goes on with the others; once most
    did, node 0 is the one gone and leaves. Exactly one side goes on."""
    from hpcshard.launch.supervise import Fenced

    sup, served = serving_supervisor(tmp_path / "run", nnodes=5)
    try:
        peers = [channel(tmp_path / "run", served, n) for n in (1, 2, 3, 4)]
        peers[0]._give_up("the store went silent")
        peers[1]._give_up("the store went silent")
        until(lambda: {1, 2} <= served.left())
        sup.beaten = 0.0
        sup.beat()  # 2 of 4: not most of them; node 0 goes on
        peers[2]._give_up("the store went silent")
        until(lambda: 3 in served.left())
        sup.beaten = 0.0
        with pytest.raises(Fenced, match=r"node\(s\) \[1, 2, 3\] gave its store up"):
            sup.beat()
    finally:
        sup.chan.close()


def test_a_pushed_fault_or_decision_wakes_a_launcher_between_its_looks(tmp_path: Path,
                                                                       server: coord.Server) -> None:
    """A launcher looks at its board every POLL_S, and acts on a fault the store pushes at
    once: at 128 nodes the last of them to act after a declaration waited about a whole
    look (0.2 s on 16 cores), at 2 nodes a twentieth of it. Without the store, it sleeps."""
    leader, follower = channel(tmp_path, server, 0), channel(tmp_path, server, 1)
    try:
        follower.wait(0)  # (what the hello brought)
        woke: list[float] = []

        def look() -> None:
            began = time.monotonic()
            follower.wait(60.0)
            woke.append(time.monotonic() - began)

        waiting = threading.Thread(target=look)
        waiting.start()
        time.sleep(0.2)
        leader.declare_fault(0, 0, {"cause": "rank 3 died"})
        waiting.join(90)
        assert woke and woke[0] < 30.0, woke  # (woken by the push: not the whole 60 s interval)
        assert follower.fault(0, 0) is not None
        began = time.monotonic()
        follower.wait(0.3)  # nothing new since: the whole interval
        assert time.monotonic() - began >= 0.25
    finally:
        leader.close()
        follower.close()
    files = coord.Channel(tmp_path, 2)
    began = time.monotonic()
    files.wait(0.2)
    assert time.monotonic() - began >= 0.15


def test_node_0_thawed_counts_the_peers_that_left_its_store_as_the_running_one_does(tmp_path: Path) -> None:
    """A node 0 that stood still past LOST_S: a few peers that gave its store up meanwhile
    are the ones cut off (they leave by themselves), so it goes on; once most did, they go on
    without it through the files and it is fenced. One count for the thawed node 0, the
    running one (`_still_serving`) and the peer that fell back (`_isolated`)."""
    sup, served = serving_supervisor(tmp_path / "run", nnodes=5)
    try:
        peers = [channel(tmp_path / "run", served, n) for n in (1, 2, 3, 4)]
        peers[0]._give_up("the store went silent")
        peers[1]._give_up("the store went silent")
        until(lambda: {1, 2} <= served.quit)
        assert not sup._store_left(coord.LOST_S + 5)  # 2 of 4: not most
        assert not sup._store_left(coord.LOST_S - 1)  # (not stood still long enough to be lost)
        peers[3].beat(0, 4, {"pid": 14, "seq": 1, "done": 0})  # node 4 ended: it counts for nobody
        until(lambda: 4 in served.ended)
        assert sup._store_left(coord.LOST_S + 5)  # 2 of 3
        assert not sup._store_left(coord.LOST_S - 1)
    finally:
        for peer in peers:
            peer.close()
        sup.chan.close()


def test_node_0_thawed_does_not_count_a_peer_whose_launcher_died_as_one_that_left_it(
        tmp_path: Path) -> None:
    """Node 0 stood still past LOST_S while a peer's launcher was killed (SIGKILL, the OOM
    killer: its connection closed without a word). That peer went on nowhere: counted as
    one that left the store, a 2-node job's node 0 was fenced and nobody was left to
    decide (the job ended, exit 0, nothing recorded); at 3 nodes, node 1 that did give it
    up counts the dead node 2 against itself (`_isolated`: not in the files) and leaves
    too. Only a peer that said it gave the store up counts, as `_still_serving` counts."""
    sup, served = serving_supervisor(tmp_path / "run", nnodes=2)
    try:
        killed = channel(tmp_path / "run", served, 1)
        assert killed.client is not None
        killed.client.close()  # (what the kernel does for a killed launcher)
        until(lambda: 1 in served.left())
        assert not sup._store_left(coord.LOST_S + 5)  # node 1 is lost: for node 0 to declare
    finally:
        sup.chan.close()
    sup, served = serving_supervisor(tmp_path / "run3", nnodes=3)
    try:
        gave_up, killed = channel(tmp_path / "run3", served, 1), channel(tmp_path / "run3", served, 2)
        gave_up._give_up("the store went silent")
        assert killed.client is not None
        killed.client.close()
        until(lambda: {1, 2} <= served.left())
        assert not sup._store_left(coord.LOST_S + 5)  # 1 of 2 gave it up: node 1 leaves by itself
        killed = channel(tmp_path / "run3", served, 2)  # (a launcher of node 2 that gave it up)
        killed._give_up("the store went silent")
        until(lambda: 2 in served.quit)
        assert sup._store_left(coord.LOST_S + 5)
    finally:
        sup.chan.close()


def test_node_0_cut_off_from_most_of_its_peers_leaves_instead_of_blaming_them(tmp_path: Path) -> None:
    """Node 0's network fails, not theirs: their word that they gave its store up cannot
    reach it, only their silence. Most of the peers it had heard, silent at once: it is the
    one gone, and leaves (they take it for lost through the files); one silent peer of
    three is that peer's trouble, judged as ever."""
    from hpcshard.launch.supervise import Fenced

    sup, served = serving_supervisor(tmp_path / "run", nnodes=4)
    try:
        peers = [channel(tmp_path / "run", served, n) for n in (1, 2, 3)]
        for n, peer in zip((1, 2, 3), peers, strict=True):
            peer.beat(0, n, {"pid": 10 + n, "seq": 1})
        until(lambda: len(sup.chan.beats(0, 4, [1, 2, 3])) == 3)
        sup.peers.observe(sup.chan.beats(0, 4, [1, 2, 3]))

        def silent_since(nodes: list[int], seconds: float) -> None:
            for n in nodes:
                mark, at = sup.peers.seen[n]
                sup.peers.seen[n] = (mark, at - seconds)
            sup.peers.heard_since -= seconds

        silent_since([1], coord.LOST_S + 1)
        sup.beaten = 0.0
        sup.beat()  # one of three: not it
        silent_since([2, 3], coord.LOST_S + 1)
        sup.beaten = 0.0
        with pytest.raises(Fenced, match=r"node\(s\) \[1, 2, 3\] fell silent at once"):
            sup.beat()
    finally:
        sup.chan.close()


def test_a_launcher_in_a_store_served_anew_still_beats_in_the_files_for_those_not_there_yet(
        tmp_path: Path) -> None:
    """After node 0's store was lost the decider serves a new one; a launcher still on the
    files learns of it as late as NFS shows the decision. Those already in the new store
    keep beating in the files for JOIN_S, or the late one hears nobody and takes itself for
    the one cut off (the chaos soak: the spare left and the run was requeued without it)."""
    served = coord.Server(KEY, 0, "127.0.0.1").start()
    try:
        joined = coord.Channel(tmp_path, 1, first_cycle=2, host_node=1)
        assert joined.open("127.0.0.1", served.port, KEY, attempt=0, serve=False)
        joined.beat(0, 1, {"pid": 11, "seq": 57})
        assert launchers.beats(tmp_path, 0, 2)[1]["seq"] == 57  # (the late ones read this)
        joined.opened -= coord.JOIN_S + 1
        joined.beat(0, 1, {"pid": 11, "seq": 58})
        assert launchers.beats(tmp_path, 0, 2)[1]["seq"] == 57  # (then the store alone)
        first = channel(tmp_path / "other", served, 0)  # (node 0's first store: no files)
        first.beat(0, 0, {"pid": 10, "seq": 5})
        assert 0 not in launchers.beats(tmp_path / "other", 0, 1) or launchers.beats(
            tmp_path / "other", 0, 1)[0]["seq"] == 0
        joined.close()
        first.close()
    finally:
        served.close()


@pytest.mark.parametrize("first", ["store", "files"])
def test_a_job_cut_in_two_keeps_one_decision_for_a_cycle(tmp_path: Path, server: coord.Server,
                                                         first: str) -> None:
    """Two launchers that cannot reach each other but both reach the storage: node 0 on its
    store, node 1 fallen back to the files. Each decides the same cycle, blaming the other;
    the file server's exclusive create takes exactly one, and both go by it."""
    on_store = channel(tmp_path, server, 0)
    on_files = coord.Channel(tmp_path, 1)
    on_files.fell_back = True
    blames_1 = {"action": "restart", "reason": "node 1 lost", "active": [0], "lost": [1]}
    blames_0 = {"action": "restart", "reason": "node 0 lost", "active": [1], "lost": [0]}
    try:
        if first == "store":
            won = on_store.decide(0, 2, blames_1)
            assert on_files.decide(0, 2, blames_0) == won == blames_1
        else:
            won = on_files.decide(0, 2, blames_0)
            assert on_store.decide(0, 2, blames_1) == won == blames_0
        assert on_store.decision(0, 2) == on_files.decision(0, 2) == won
    finally:
        on_store.close()


def test_the_store_decides_alone_when_the_storage_refuses_the_file(tmp_path: Path, server: coord.Server,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A full or read-only run directory stops no recovery on the store."""
    chan = channel(tmp_path, server, 0)

    def full(*_: object) -> bool:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(launchers, "_create", full)
    try:
        decided = {"action": "stop", "reason": "the run directory is full"}
        assert chan.decide(0, 0, decided) == decided == chan.decision(0, 0)
    finally:
        chan.close()


def test_the_decider_blames_before_the_launchers_on_its_store_learn_its_decision(tmp_path: Path) -> None:
    """A requeue: the first launcher to act on it sends the job on, excluding the run's bad
    nodes in Slurm as the ledger names them (`launch.slurm._continue`), and marks the lost
    ones DOWN (`_down_lost`). The launchers on node 0's store act on the decision the
    moment it is pushed, so the decider's bad-node records must be in the ledger by then
    (recorded after, the requeued job could land on the lost node again)."""
    from hpcshard.launch.supervise import Watch
    from hpcshard.rundir import ledger

    run = tmp_path / "run"
    sup, served = serving_supervisor(run, nnodes=2)
    bad_when_pushed: list[list[int]] = []
    call = sup.chan._call

    def spied(op: str, **fields: Any) -> dict[str, Any] | None:
        if op == "create" and str(fields.get("key", "")).startswith("next/"):
            bad_when_pushed.append([int(r["node"]) for r in ledger.bad_nodes(run, 0)])
        return call(op, **fields)

    sup.chan._call = spied  # type: ignore[method-assign]
    try:
        sup.peers.began -= coord.UNHEARD_S + coord.LOST_S + 1  # node 1 never heard of since: lost
        sup.peers.heard_since -= coord.UNHEARD_S + coord.LOST_S + 1
        sup.chan.mark_down(0, 0, 0, {"dead": [], "reached": 7})
        decided = sup.decide(0, Watch(code=1, fault={"cause": "node(s) [1] lost: silent for 8 s"}))
        assert decided.lost == (1,) and decided.bad == (1,)
        assert bad_when_pushed == [[1]]
    finally:
        sup.chan.close()


def test_two_threads_that_give_the_store_up_at_once_both_go_on_through_the_files(
        tmp_path: Path, server: coord.Server) -> None:
    """The decision is shared on a thread while the launcher beats on its own (`_try`):
    both find the store silent at once and give it up. The one whose leave waited (it
    takes the connection's lock for up to 0.5 s) must not find the client gone under it
    (an AttributeError there ended the supervision: its ranks killed, exit 1)."""
    chan = channel(tmp_path, server, 1)
    client = chan.client
    assert client is not None
    leave, first_in, go_on = client.leave, threading.Event(), threading.Event()

    def slow_leave() -> None:
        if not first_in.is_set():
            first_in.set()
            go_on.wait(5)
        leave()

    client.leave = slow_leave  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def give_up() -> None:
        try:
            chan._give_up("the store went silent")
        except BaseException as err:  # noqa: BLE001 (what the test looks for)
            failed.append(err)

    first = threading.Thread(target=give_up)
    first.start()
    assert first_in.wait(5)
    give_up()  # (the other thread, meanwhile)
    go_on.set()
    first.join(5)
    assert not failed and chan.client is None and chan.fell_back and client.closed


def test_node_0_on_its_store_whose_decision_lost_to_the_files_blames_nobody(tmp_path: Path) -> None:
    """A 2-node job cut in two: node 1, fallen back to the files, decided first that node 0
    is lost. Node 0, on its store, takes node 1 for lost: the run directory says node 1's
    decision stands, node 0 pushes that one to its store and marks nobody bad."""
    from hpcshard.launch.policy import Decision
    from hpcshard.launch.supervise import Watch
    from hpcshard.rundir import ledger

    run = tmp_path / "run"
    sup, _ = serving_supervisor(run, nnodes=2)
    try:
        sup.peers.began -= coord.UNHEARD_S + coord.LOST_S + 1
        sup.peers.heard_since -= coord.UNHEARD_S + coord.LOST_S + 1
        theirs = {"action": "requeue", "code": 3, "reason": "node(s) [0] lost", "end": "fault",
                  "lost": [0], "bad": [0]}
        launchers.decide(run, 0, 0, theirs)
        sup.chan.mark_down(0, 0, 0, {"dead": [], "reached": 7})
        decided = sup.decide(0, Watch(code=1, fault={"cause": "node(s) [1] lost: silent for 8 s"}))
        assert decided == Decision.from_dict(sup.chan.decision(0, 0) or {}) == Decision.from_dict(theirs)
        assert not ledger.bad_nodes(run) and not [r for r in ledger.read(run) if r["event"] == "fault"]
    finally:
        sup.chan.close()


def freeze(server: coord.Server, seconds: float) -> None:
    """Node 0's host stands still: its store's loop answers nothing for `seconds` (the
    connections stay up, as a frozen host's do)."""
    server.loop.call_soon_threadsafe(time.sleep, seconds)


@contextlib.contextmanager
def frozen(server: coord.Server) -> Iterator[None]:
    """`freeze` until the test thaws it (leaving the block), not for a number of seconds: a
    test that must do its part while the store stands still had 3 s for it, which a loaded
    machine can take before the test has begun."""
    thaw = threading.Event()
    server.loop.call_soon_threadsafe(thaw.wait, 300)
    try:
        yield
    finally:
        thaw.set()


def test_a_silent_store_is_left_for_the_standby_and_the_recovery_under_way_goes_on_there(
        tmp_path: Path, server: coord.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 serves the standby from the start and says where in node 0's store. A fault
    was declared and node 2 said it is down when node 0 froze: each launcher, finding the
    store silent, moves to the standby with what it knew, so the decider there sees the
    fault and node 2's down record without anyone saying them again, and none of it waits
    for a file to show through NFS's lookup cache (the chaos soak's 72 s node-0 loss)."""
    monkeypatch.setattr(coord, "LOST_S", 0.3)
    one, two = channel(tmp_path, server, 1), channel(tmp_path, server, 2)
    try:
        assert one.stand_by("127.0.0.1") and one.standby is not None
        until(lambda: "standby/0/0" in two.client.pushed)  # type: ignore[union-attr]
        assert one.declare_fault(0, 4, {"cause": "rank 3 died"})
        until(lambda: two.fault(0, 4) is not None)
        two.mark_down(0, 4, 2, {"dead": [], "reached": 9})
        with frozen(server):
            began = time.monotonic()
            assert two.nodes_down(0, 4, 3) == [2]  # (asked of node 0's store, answered by the standby)
            # (node 0's store is frozen until the block's end: only the standby can have
            # answered; the bound tells it from a file seen through NFS's 30-60 s lookup cache)
            assert time.monotonic() - began < 20 and two.host_node == 1 and two.gave_up == {0}
            assert two.store is not None and two.store.port == one.standby.port and not two.lost_why
            assert two.fault(0, 4) == {"cause": "rank 3 died", "time": two.fault(0, 4)["time"]}  # type: ignore[index]
            one.mark_down(0, 4, 1, {"dead": [{"rank": 3}], "reached": 9})  # (node 1 moves to its own)
            assert one.server is not None and one.standby is None and one.host_node == 1
            assert one.nodes_down(0, 4, 3) == [1, 2]
            decided = {"action": "restart", "reason": "rank 3 died", "active": [1, 2]}
            assert one.decide(0, 4, decided) == decided
            until(lambda: two.decision(0, 4) == decided)
            assert one.store is not None and two.store is not None  # (the standby is not silent)
            files = [p.name for p in (tmp_path / launchers.LAUNCH).iterdir()]
            assert not [f for f in files if f.startswith(("fault-", "down-"))], files
            assert server.quit == set()  # (it stands still: their word waits for it to thaw)
        until(lambda: server.quit == {1, 2}, 30)
    finally:
        one.close()
        two.close()


def test_a_store_whose_launcher_died_is_left_for_the_standby_at_once(
        tmp_path: Path, server: coord.Server) -> None:
    """Node 0's launcher killed: its connections close, and nobody waits LOST_S."""
    one, two = channel(tmp_path, server, 1), channel(tmp_path, server, 2)
    try:
        assert one.stand_by("127.0.0.1")
        until(lambda: "standby/0/0" in two.client.pushed)  # type: ignore[union-attr]
        server.close()
        until(lambda: two.client is not None and two.client.closed)
        began = time.monotonic()
        assert two.declare_fault(0, 0, {"cause": "node 0 lost"})
        assert time.monotonic() - began < coord.LOST_S / 2 and two.host_node == 1  # (no wait for LOST_S)
        assert one.fault(0, 0) is not None and one.server is not None  # (node 1 moved too)
    finally:
        one.close()
        two.close()


def test_a_standby_lost_with_its_store_leaves_the_files(tmp_path: Path, server: coord.Server,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes 0 and 1 lost together: the standby does not answer either, and the launcher
    goes on through the run directory's files, as before the standby."""
    monkeypatch.setattr(coord, "LOST_S", 0.3)
    one, two = channel(tmp_path, server, 1), channel(tmp_path, server, 2)
    try:
        assert one.stand_by("127.0.0.1") and one.standby is not None
        until(lambda: "standby/0/0" in two.client.pushed)  # type: ignore[union-attr]
        freeze(server, 6)
        freeze(one.standby, 6)
        began = time.monotonic()
        assert two.declare_fault(0, 0, {"cause": "nodes 0 and 1 lost"})
        assert time.monotonic() - began < coord.STANDBY_CONNECT_S + coord.CONNECT_TRY_S + 1.5
        assert two.store is None and two.lost_why and two.gave_up == {0}
        assert launchers.fault(tmp_path, 0, 0)["cause"] == "nodes 0 and 1 lost"  # type: ignore[index]
    finally:
        one.close()
        two.close()


def test_the_lowest_launcher_but_the_stores_host_serves_the_standby(tmp_path: Path) -> None:
    """Node 1 for node 0's store; node 2 serves none. After a restart that moved the store
    to node 1, node 2 serves the standby for node 1's (`Supervisor._stand_by`)."""
    from tests.unit.test_launch_races import make_supervisor

    run = tmp_path / "run"
    served = coord.Server(KEY, 0, "127.0.0.1").start()
    sups = [make_supervisor(run, owner="", node_rank=n, nnodes=3) for n in (1, 2)]
    try:
        for sup in sups:
            sup.chan = channel(run, served, sup.me)
            sup._stand_by()
        assert sups[0].chan.standby is not None and sups[1].chan.standby is None
        where = {"host": "127.0.0.1", "port": sups[0].chan.standby.port, "node": 1}
        assert served.data["standby/0/0"] == where
        sups[1].chan.host_node = 1  # (the store moved to node 1's standby)
        sups[1].roster = type(sups[1].roster)((1, 2), ())
        sups[1]._stand_by()
        assert sups[1].chan.standby is not None and served.data["standby/0/1"]["node"] == 2
    finally:
        for sup in sups:
            sup.chan.close()
        served.close()


def later(sup: Any, seconds: float) -> None:
    """`seconds` pass for this supervisor's view of its peers."""
    sup.peers.seen = {n: (mark, at - seconds) for n, (mark, at) in sup.peers.seen.items()}
    sup.peers.heard_since -= seconds
    sup.peers.began -= seconds


def test_node_1_serving_the_standby_goes_on_when_node_0_and_another_are_lost(tmp_path: Path) -> None:
    """4 nodes; nodes 0 and 2 die together (one switch, one PDU). Node 1 moved to the
    standby it serves, so its store's checks run on it now: node 0, whose store it gave up,
    is lost to it, not a peer fallen silent; 1 of its 2 peers silent is not it cut off. It
    goes on and decides (counted with node 0, it fenced itself and every launcher left:
    the run lost; found by review)."""
    from tests.unit.test_launch_races import make_supervisor

    run = tmp_path / "run"
    (run / launchers.LAUNCH).mkdir(parents=True)
    zero = coord.Server(KEY, 0, "127.0.0.1").start()
    sup = make_supervisor(run, owner="", node_rank=1, nnodes=4)
    sup.chan = channel(run, zero, 1)
    three = channel(run, zero, 3)
    try:
        assert sup.chan.stand_by("127.0.0.1")
        until(lambda: "standby/0/0" in three.client.pushed)  # type: ignore[union-attr]
        sup.peers.observe({n: {"pid": 100 + n, "seq": 5} for n in (0, 2, 3)})
        zero.close()  # (node 2 dies too: it never shows up anywhere)
        until(lambda: sup.chan.client is not None and sup.chan.client.closed)
        assert sup.chan.store is not None and sup.chan.server is not None  # (its own standby)
        assert three.store is not None and three.host_node == 1
        sup._isolated()  # (the grace, 2 * LOST_S, for nodes 2 and 3)
        later(sup, 2 * coord.LOST_S + 1)
        three.beat(0, 3, {"pid": 103, "seq": 7})
        sup.chan.asked.clear()
        until(lambda: sup.chan.beats(0, 4, [3]).get(3, {}).get("seq") == 7)
        sup._isolated()
        sup._still_serving()
        assert sup.lost([0, 2, 3]) == [0, 2]
    finally:
        sup.chan.close()
        three.close()


def test_the_launcher_serving_the_store_never_moves_to_the_standby(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0's own call to its store timed out (its host starved): moving to node 1's
    standby, it would serve its peers a store while it listened to another (faults declared
    on its own never reached it; found by review). It gives the store up for good and
    leaves the run at its next beat."""
    from hpcshard.launch.supervise import Fenced

    monkeypatch.setattr(coord, "LOST_S", 0.3)
    run = tmp_path / "run"
    (run / launchers.LAUNCH).mkdir(parents=True)
    sup, zero = serving_supervisor(run, nnodes=3)
    one = channel(run, zero, 1)
    try:
        assert one.stand_by("127.0.0.1")
        until(lambda: "standby/0/0" in sup.chan.client.pushed)  # type: ignore[union-attr]
        freeze(zero, 1.0)
        sup.chan.nodes_down(0, 0, 3)
        assert sup.chan.host_node == 0 and sup.chan.lost_why and sup.chan.store is None
        with pytest.raises(Fenced, match="its own store stopped answering it"):
            sup._still_serving()
    finally:
        sup.chan.close()
        one.close()
        zero.close()


def test_a_launcher_that_missed_the_standby_is_heard_through_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 dies while node 1's standby is busy for a moment: node 2 finds no answer in
    STANDBY_CONNECT_S and goes to the files, node 3 reaches the standby a moment later.
    For JOIN_S after the move those on the standby and node 2 hear each other through the
    files: its down record and heartbeat reach the decider, theirs reach it (unheard, the
    decider took a healthy node for lost and drained it; found by review)."""
    monkeypatch.setattr(coord, "STANDBY_CONNECT_S", 1.5)
    run = tmp_path / "run"
    (run / launchers.LAUNCH).mkdir(parents=True)
    zero = coord.Server(KEY, 0, "127.0.0.1").start()
    one, two, three = (channel(run, zero, n) for n in (1, 2, 3))
    try:
        assert one.stand_by("127.0.0.1") and one.standby is not None
        until(lambda: all("standby/0/0" in c.client.pushed for c in (two, three)))  # type: ignore[union-attr]
        freeze(one.standby, 2.6)
        zero.close()
        until(lambda: two.client is not None and two.client.closed)
        assert two.store is None and two.lost_why  # (the files)
        assert three.store is not None and three.host_node == 1  # (the standby)
        assert one.store is not None and one.server is not None
        two.mark_down(0, 0, 2, {"dead": [], "reached": 3})
        two.beat(0, 2, {"pid": 102, "seq": 9})
        three.mark_down(0, 0, 3, {"dead": [], "reached": 3})
        assert one.nodes_down(0, 0, 4) == [2, 3]
        assert [d["node"] for d in one.downs(0, 0, 4)] == [2, 3]
        assert one.beats(0, 4, [2, 3])[2]["seq"] == 9
        three.beat(0, 3, {"pid": 103, "seq": 10})
        assert two.beats(0, 4, [3])[3]["seq"] == 10
        one.opened -= coord.JOIN_S + 1  # (then the store alone: no file is read any more)
        assert one.nodes_down(0, 0, 4) == [3]
    finally:
        for chan in (one, two, three):
            chan.close()


def test_two_threads_that_find_the_store_silent_at_once_move_to_the_standby_once(
        tmp_path: Path, server: coord.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision shared on a thread while the launcher beats on its own: one move, and
    the decision lands on the standby, not in the files."""
    monkeypatch.setattr(coord, "LOST_S", 0.3)
    one, two = channel(tmp_path, server, 1), channel(tmp_path, server, 2)
    try:
        assert one.stand_by("127.0.0.1")
        until(lambda: "standby/0/0" in two.client.pushed)  # type: ignore[union-attr]
        with frozen(server):  # (until both threads are done: not 3 s)
            got: list[dict[str, Any]] = []
            sharing = threading.Thread(target=lambda: got.append(two.share(0, 0, {"d": 1})))
            sharing.start()
            for seq in range(15):
                two.beat(0, 2, {"pid": 1, "seq": seq})
                time.sleep(0.05)  # (a beat every 50 ms, as the supervisor's own thread beats)
            sharing.join(60)
            assert got == [{"d": 1}] and two.moves == 1 and not two.lost_why and two.host_node == 1
            assert not list((tmp_path / launchers.LAUNCH).glob("next-*"))  # (shared on the standby)
    finally:
        one.close()
        two.close()


def moved_but_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[Path, coord.Server, list[coord.Channel]]:
    """Nodes 1-3 on node 0's store, node 1 serving the standby; node 0 dies while the
    standby's loop is busy for 2.6 s: node 2 finds it silent first and goes to the files."""
    monkeypatch.setattr(coord, "STANDBY_CONNECT_S", 1.5)
    run = tmp_path / "run"
    (run / launchers.LAUNCH).mkdir(parents=True)
    zero = coord.Server(KEY, 0, "127.0.0.1").start()
    chans = [channel(run, zero, n) for n in (1, 2, 3)]
    one, two, _ = chans
    assert one.stand_by("127.0.0.1") and one.standby is not None
    until(lambda: all("standby/0/0" in c.client.pushed for c in chans[1:]))  # type: ignore[union-attr]
    two.beat(0, 2, {"pid": 102, "seq": 5})
    until(lambda: one.beats(0, 4, [2]).get(2, {}).get("seq") == 5)  # (node 1 watches node 2)
    freeze(one.standby, 2.6)
    zero.close()
    until(lambda: two.client is not None and two.client.closed)
    assert two.store is None and two.lost_why
    return run, zero, chans


def test_node_1_waits_for_its_own_standby_and_one_on_the_files_is_heard_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1's own standby busy with the crowd moving in: node 1 waits for it (missing it,
    the decider was alone on the files, deciding nobody else was down). A node heard on
    node 0's store is heard anew through the files on the standby (its last beat there hid
    its heartbeat file: it would have been blamed). Found by review."""
    run, zero, (one, two, three) = moved_but_two(tmp_path, monkeypatch)
    try:
        assert one.store is not None and one.server is not None and one.host_node == 1
        assert three.store is not None and three.host_node == 1
        for seq in (9, 10, 11):
            two.beat(0, 2, {"pid": 102, "seq": seq})
        assert one.beats(0, 4, [2])[2]["seq"] == 11
    finally:
        for chan in (one, two, three):
            chan.close()


def test_one_that_went_to_the_files_joins_the_standby_once_it_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It tries the standby again every FOLLOW_S: a fault declared there reaches it, with no
    restart needed to name the standby (found by review)."""
    monkeypatch.setattr(coord, "FOLLOW_S", 0.2)
    run, zero, (one, two, three) = moved_but_two(tmp_path, monkeypatch)
    try:
        assert one.store is not None
        assert one.declare_fault(0, 0, {"cause": "rank 7 died"})
        until(lambda: two.store is not None, 10)
        assert two.host_node == 1 and not two.lost_why and two.moves == 2
        until(lambda: two.fault(0, 0) is not None, 10)  # (pushed: on a busy machine, later)
        assert two.fault(0, 0)["cause"] == "rank 7 died"  # type: ignore[index]
    finally:
        for chan in (one, two, three):
            chan.close()


def test_on_the_standby_a_launcher_asks_who_is_there_not_every_heartbeat(tmp_path: Path,
                                                                         server: coord.Server) -> None:
    """`_isolated` on the standby asks the store who is connected (every peer's heartbeat
    each second, from every launcher, was a megabyte a second per launcher at 1,000 nodes
    from the standby's one loop; found by review). All there: the move is over, and nothing
    more is written to the files. Most missing after the grace: it is the one cut off."""
    from hpcshard.launch.supervise import Fenced
    from tests.unit.test_launch_races import make_supervisor

    run = tmp_path / "run"
    (run / launchers.LAUNCH).mkdir(parents=True)
    sup = make_supervisor(run, owner="", node_rank=2, nnodes=4)
    sup.chan = channel(run, server, 2)
    sup.chan.fell_back, sup.chan.gave_up, sup.chan.moves, sup.chan.host_node = True, {0}, 1, 1
    others = [channel(run, server, n) for n in (1, 3)]
    try:
        sup._isolated()
        assert not sup.chan.fell_back and sup.chan.settled and not sup.chan._bridging()
        assert sup.chan.watched == set()  # (no heartbeat asked for)
        others.pop().close()
        until(lambda: 3 not in server.conns)
        sup.chan.fell_back, sup.chan.moves, sup.chan.settled = True, 2, False
        sup._isolated()  # (a grace: node 3 may be on its way)
        assert sup.chan.fell_back
        sup.grace_ends = sup.asked_who = 0.0
        sup._isolated()  # (1 of 2 missing: the move is over, node 3 heard on the files a while)
        assert not sup.chan.fell_back and not sup.chan.settled and sup.chan._bridging()
        others.pop().close()
        until(lambda: 1 not in server.conns)
        sup.chan.fell_back, sup.chan.moves = True, 3
        sup._isolated()
        sup.grace_ends = sup.asked_who = 0.0
        with pytest.raises(Fenced, match="2 of its 2 other peers did not: it is the one cut off"):
            sup._isolated()
    finally:
        sup.chan.close()
