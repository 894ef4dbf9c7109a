"""The launchers of one job coordinate through a small store that node 0's launcher
serves, not through the run directory.

Why not files: on NFS a file one host creates can stay invisible to the others for the
directory's lookup cache (30-60 s by default), and a thousand launchers stating a fault
file five times a second and rewriting a heartbeat every second are the metadata load
parallel file system admins forbid. Measured on the local Slurm with NFS-like per-node
views (30 s lookups): a crash was decided 31 s after its declaration and trained again
after 66 s, against 6.6 s on a coherent disk.

Why not torch's c10d TCPStore, which torchrun's own rendezvous uses: a launcher would
have to import torch (1.2 s and 225 MB resident per launcher, measured here, against 14 MB
for a launcher; the launchers' import contract keeps torch in the warm agent's processes),
and TCPStore only answers questions: every launcher would poll it for a fault five times a
second (O(N) requests per poll at node 0) where this one pushes the fault and the decision
to every launcher once. The protocol is a line of JSON each way over one TCP connection per
launcher (asyncio on the server, one reader thread per client); about 300 lines. The store
listens where the launchers are told to reach it (`ports.listen`), and a connection costs it
little until its hello gives the job's key: one short line (HELLO_LIMIT), said within HELLO_S,
with a cap on how many may wait to say it (STRANGERS).

What goes through it (keys; the attempt A and the cycle C as in `rundir.launchers`):
    fault/A/C     the cycle's fault, first declarer wins; pushed to every launcher
    down/A/C/N    node N's ranks are dead, and what it saw
    next/A/C      the decision; first decider wins; pushed to every launcher
    alive/A/N     node N's heartbeat (a sequence number the readers time on their own
                  monotonic clock: `launch.liveness`), sent every second; the reply brings
                  the heartbeats the sender watches
    fenced/A      a launcher found the run taken over: every launcher leaves; pushed
    standby/A/H   where the standby for node H's store listens (host, port, node); pushed

The store lives as long as node 0's launcher. A launcher whose requests go unanswered for
LOST_S (node 0 died, froze, or fell off the network) takes node 0 for lost and closes its
connection. It goes on through the **standby store**: the lowest other launcher of the job
(node 1) serves one from the start and says where in node 0's store (`standby/A/0`), so
every launcher knows it before it is needed, and no file need show through NFS's lookup
cache for the recovery from node 0's loss (measured in the chaos soak on NFS-like views:
72 s through the files, against 15 s on a coherent disk). Moving, a launcher carries to
the standby what it knew of node 0's (the faults and decisions pushed to it, its own down
records), so a recovery under way goes on where it was. The policy then decides as for
any lost node (a spare takes its place, or the job is requeued); after a restart the next
lowest launcher serves the standby for the new host's store. Where the standby cannot be
reached either (its host lost too), the launchers coordinate through the run directory's
files for the rest of the attempt (`rundir.launchers`, which stay the protocol when no
store can be had at all). A node 0 that thaws after most of its peers gave its store up
finds their word that they did (`Server.quit`) and leaves the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import itertools
import json
import math
import os
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hpcshard.launch import ports
from hpcshard.launch.liveness import LOST_S, UNHEARD_S, newer
from hpcshard.rundir import launchers

CONNECT_TRY_S = 1.0
"""One try to connect (node 0's launcher may start a few seconds after this one)."""
LINE_LIMIT = 64 << 20
"""The longest message once a connection's hello checked (every heartbeat of 10,000 nodes
is about 2 MB; a node's down record, its ranks' flight records naming each group's members,
about 4 MB for 8 ranks of 80,000)."""
HELLO_LIMIT = 4 << 10
"""The longest hello, the line a connection says first, read before its key is checked (a
launcher's is about 150 bytes: its node, attempt and key, the prefixes it watches). It also
bounds what the store reads ahead of any connection it has not yet read a line from (twice
this, and one read of the socket, HELLO_LIMIT too until the key checks: `_admit`); a longer
line closes the connection."""
HELLO_S = 10.0
"""How long a connection may take to say its hello (a launcher says it as it connects,
and gives up on the answer after CONNECT_TRY_S)."""
STRANGERS = 64
"""How many connections may wait to say their hello beyond two per launcher of the job
(`Server.nodes`: a launcher's try that it gave up may still be open beside its next).
Past that the oldest of them is closed: whatever connects to the port, a launcher that
connects after it is let in, and a launcher closed so connects again (`Client.connect`)."""
READ_CHUNK = 1 << 20
"""The most one read takes from a connection's reader (all it holds: twice HELLO_LIMIT and
one read of the socket, 256 KB once the key checked)."""
WATCHED = ("fault/", "next/", "fenced/", "standby/")
"""What the store pushes to every launcher the moment it is set."""
CARRIED = ("fault/", "next/", "fenced/")
"""What a launcher moving to the standby store tells it of the store it left (with its own
down records): the recovery under way goes on where it was."""
STANDBY_CONNECT_S = 4.0
"""How long a launcher tries to reach the standby store once its store went silent; then the
files (the standby's host is lost too, or cannot be reached from here). One that went to the
files meanwhile is still heard by those on the standby (`Channel._bridging`), and tries the
standby again every FOLLOW_S for JOIN_S (`Channel._follow`)."""
FOLLOW_S = 2.0
"""How often a launcher that went to the files tries the standby again."""
WATCH_KEEP_S = 3.0
"""A node's heartbeat is brought back with this launcher's own while it was asked for
within this long (the leader asks for every node's each second; the others for the
leader's)."""
JOIN_S = 120.0
"""How long the launchers may take to join a store served anew (`Supervisor._serve_anew`):
the decision naming it reaches them through the files, as late as the file system shows
it (NFS's lookup cache: 30-60 s). Until they join, they are heard through their heartbeat
files; one that has not joined by then is judged by the store alone."""
MODES = ("store", "files")
"""HPCSHARD_COORD: the store served by node 0's launcher (default), or the run directory's
files only (the protocol before the store; kept for comparison and as a way out)."""


def mode() -> str:
    """How this job's launchers coordinate (HPCSHARD_COORD; one clear error for a typo)."""
    found = os.environ.get("HPCSHARD_COORD", "store") or "store"
    if found not in MODES:
        raise ValueError(f"HPCSHARD_COORD={found!r} is not one of {', '.join(MODES)}; unset it for the store")
    return found


class Unreachable(OSError):
    """The store did not answer (node 0's launcher is gone, frozen or cut off)."""


# -- the server (node 0's launcher) -------------------------------------------------------
class Server:
    """A key-value store for one job's launchers: create (first writer wins), set, get,
    scan by prefix, and pushes of WATCHED keys to every connected launcher. Runs on an
    asyncio loop in a daemon thread of node 0's launcher."""

    running: dict[int, Server] = {}
    """The stores this process serves, by port (`serving`)."""

    @classmethod
    def serving(cls, port: int) -> Server | None:
        """The store this process serves on `port`, if it does."""
        return cls.running.get(port)

    def __init__(self, key: str, port: int, host: str = "", attempt: int = 0, nodes: int = 0) -> None:
        self.key, self.host, self.port, self.attempt = key, host, port, attempt
        """`host`: the name or address the launchers are told to reach this store by; it
        listens there alone (`ports.listen`; "": every interface)."""
        self.nodes = nodes
        """The job's launchers (spares included): room for them all to connect at once."""
        self.data: dict[str, Any] = {}
        self.conns: dict[int, tuple[asyncio.StreamWriter, tuple[str, ...]]] = {}
        self.unproven: dict[asyncio.StreamWriter, None] = {}
        """The connections yet to say their hello, oldest first (`_admit`)."""
        self.gone: set[int] = set()
        """Nodes whose connection closed before they said they ended (`left`)."""
        self.ended: set[int] = set()
        """Nodes whose heartbeat said they ended ("done")."""
        self.quit: set[int] = set()
        """Nodes that said they gave this store up (`Channel._give_up`): it was silent to
        them for LOST_S, they took its host for lost and went on through the files."""
        self.instance = uuid.uuid4().hex
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self.thread: threading.Thread | None = None
        self.servers: list[asyncio.base_events.Server] = []
        self.bound: list[str] = []
        """The addresses it listens on ("::" or "0.0.0.0": every interface)."""

    def start(self) -> Server:
        """Listen (an OSError when the port is taken: the caller falls back to files)."""
        ports.raise_fd_limit()
        socks = ports.listen(self.host, self.port)
        # (a thousand launchers connect within a second or two: the kernel caps the backlog at
        # net.core.somaxconn; asyncio's default, 100, dropped the rest for a SYN retry each.
        # The reader's limit is the hello's: a connection's lines after it are `_Lines`')
        for sock in socks:
            self.servers.append(self.loop.run_until_complete(asyncio.start_server(
                self._serve, sock=sock, limit=HELLO_LIMIT, backlog=4096)))
        self.port = int(socks[0].getsockname()[1])
        self.bound = [str(sock.getsockname()[0]) for sock in socks]
        self.thread = threading.Thread(target=self.loop.run_forever, name="hpcshard-coord", daemon=True)
        self.thread.start()
        Server.running[self.port] = self
        return self

    def close(self) -> None:
        if self.thread is None:
            return
        Server.running.pop(self.port, None)

        async def stop() -> None:
            for server in self.servers:
                server.close()
            for writer in [*(w for w, _ in self.conns.values()), *self.unproven]:
                writer.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(2)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(2)
        self.thread = None

    def left(self) -> set[int]:
        """The nodes that connected and then closed their connection without saying they
        ended, or said they gave the store up. (Only the second kind took this store's host
        for lost: a launcher killed closes its connection without a word.)"""
        return self.gone | self.quit

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node: int | None = None
        _no_delay(writer)
        self._admit(writer)
        try:
            # (HELLO_LIMIT and HELLO_S bound what a stranger costs: anyone on the network may
            # connect to the port, and four connections' long lines, read up to LINE_LIMIT
            # before the key was checked, grew node 0's launcher from 23 to 265 MB)
            hello = json.loads(await asyncio.wait_for(reader.readline(), HELLO_S))
            if (hello.get("op") != "hello" or not hmac.compare_digest(str(hello.get("key", "")), self.key)
                    or hello.get("attempt") != self.attempt or int(hello["node"]) in self.conns):
                # (a stranger; another job's launcher, or an older attempt's thawed one, on
                # a port reused; a second launcher saying it is a node already here: the
                # first one keeps its place)
                return
            if writer not in self.unproven:
                return  # (closed meanwhile, the oldest of too many: `_admit`)
            del self.unproven[writer]
            vars(writer.transport).pop("max_size", None)  # (asyncio's own again: `_admit`)
            node = int(hello["node"])
            watch = tuple(str(w) for w in hello.get("watch", WATCHED))
            self.conns[node] = (writer, watch)
            pushed = {k: v for k, v in self.data.items() if k.startswith(watch)}
            self._write(writer, {"id": hello.get("id"), "instance": self.instance, "pushed": pushed})
            lines = _Lines(reader, LINE_LIMIT)
            while line := await lines.next():
                self.requests += 1
                request = json.loads(line)
                if request.get("op") == "leave":
                    self.quit.add(node)
                    continue
                self._write(writer, {"id": request.get("id"), **self._answer(request)})
                await writer.drain()
        except (TimeoutError, OSError, ValueError, KeyError, TypeError, AttributeError,
                asyncio.LimitOverrunError):
            pass  # (a stranger, or a line that is no JSON object: refused, no traceback)
        finally:
            self.unproven.pop(writer, None)
            if node is not None and self.conns.get(node, (None,))[0] is writer:
                del self.conns[node]
                if node not in self.ended:
                    self.gone.add(node)
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Count a connection among those yet to say their hello; past the cap (STRANGERS
        and two per launcher), close the oldest of them. The oldest, not the newest: idle
        connections held open would otherwise keep a launcher out until they time out."""
        while self.unproven and len(self.unproven) >= STRANGERS + 2 * self.nodes:
            oldest = next(iter(self.unproven))
            del self.unproven[oldest]
            oldest.close()
        self.unproven[writer] = None
        # One read of its socket takes HELLO_LIMIT at most until the key checks, not asyncio's
        # 256 KB (`_SelectorSocketTransport.max_size`, read at each read): the cap is counted
        # in connections, two per launcher, and a thousand launchers' worth of strangers that
        # each sent 256 KB at once grew node 0's launcher from 39 to 284 MB.
        writer.transport.max_size = HELLO_LIMIT  # type: ignore[attr-defined]

    @staticmethod
    def _write(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "create":
            key = str(request["key"])
            won = key not in self.data
            if won:
                self._set(key, request["value"])
            return {"won": won, "value": self.data[key]}
        if op == "exchange":  # set some keys, get others: a heartbeat and the ones watched
            for key, value in dict(request.get("set", {})).items():
                if key.startswith("alive/") and isinstance(value, dict) and "done" in value:
                    self.ended.add(_node_of(key))
                self._set(str(key), value)
            return {"values": {k: self.data.get(k) for k in request.get("get", [])}}
        if op == "who":  # the nodes connected now, or that said they ended here
            return {"nodes": sorted(set(self.conns) | self.ended)}
        if op == "scan":  # ("keys": the names alone, each value null)
            prefix, bare = str(request["prefix"]), bool(request.get("keys"))
            return {"values": {k: None if bare else v for k, v in self.data.items() if k.startswith(prefix)}}
        return {"error": f"unknown operation {op!r}"}

    def _set(self, key: str, value: Any) -> None:
        self.data[key] = value
        if key.startswith(WATCHED):
            line = json.dumps({"push": key, "value": value}, separators=(",", ":")).encode() + b"\n"
            for writer, watch in list(self.conns.values()):
                if key.startswith(watch):
                    with contextlib.suppress(Exception):
                        writer.write(line)


def _no_delay(writer: asyncio.StreamWriter) -> None:
    """Each line goes out as it is written. asyncio sets TCP_NODELAY only on a socket whose
    proto says TCP, and one accepted from `socket.create_server`'s says 0: a push written
    right behind an answer waited for the launcher's delayed ACK (Nagle; 40 ms on Linux),
    measured between a decision set and every launcher hearing it (`bench.coord_scale`)."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Lines:
    """The lines of a connection let in, each up to `limit` bytes. (Its reader's own limit
    is the hello's: it also bounds what is read ahead of a connection not yet let in.)"""

    def __init__(self, reader: asyncio.StreamReader, limit: int) -> None:
        self.reader, self.limit = reader, limit
        self.pending = bytearray()
        self.looked = 0
        """How far `pending` is known to hold no end of line."""

    async def next(self) -> bytes:
        """The next line, with its end; b"" once the connection closed. A ValueError for a
        line over the limit."""
        while (end := self.pending.find(b"\n", self.looked)) < 0:
            self.looked = len(self.pending)
            if self.looked > self.limit:
                raise ValueError(f"a line over {self.limit} bytes")
            chunk = await self.reader.read(READ_CHUNK)
            if not chunk:
                return b""
            self.pending += chunk
        line = bytes(self.pending[:end + 1])
        del self.pending[:end + 1]
        self.looked = 0
        return line


# -- a launcher's connection ---------------------------------------------------------------
class Client:
    """One launcher's connection to the store: requests with ids, answered in any order,
    and the pushes it keeps (`pushed`). `silent()` says the store went quiet: a request
    has waited LOST_S with nothing heard from the store since it was sent."""

    def __init__(self, host: str, port: int, key: str, node: int, attempt: int = 0) -> None:
        self.host, self.port, self.key, self.node, self.attempt = host, port, key, node, attempt
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.pending: dict[int, tuple[float, threading.Event, list[dict[str, Any]],
                                      Callable[[dict[str, Any]], None] | None]] = {}
        self.pushed: dict[str, Any] = {}
        self.heard = time.monotonic()
        self.closed = False
        self.instance = ""
        self.sent = 0
        self.news = threading.Event()
        """Set when a push lands or the store's end closes (`Channel.wait` wakes on it)."""

    def connect(self, deadline: float, waiting: Callable[[], None] | None = None) -> bool:
        """Connect and say hello, trying until `deadline` (monotonic); `waiting` is called
        between tries."""
        while not self.closed:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TRY_S)
                sock.settimeout(CONNECT_TRY_S)
                sock.sendall(json.dumps({"op": "hello", "id": 0, "node": self.node, "key": self.key,
                                         "attempt": self.attempt, "watch": list(WATCHED)}).encode() + b"\n")
                # (one buffered reader for the hello and all after: what it reads ahead, a
                # push right behind the answer, is the reader thread's)
                stream = sock.makefile("rb")
                reply = json.loads(stream.readline(LINE_LIMIT) or b"null")
                if not isinstance(reply, dict) or "instance" not in reply:
                    raise ConnectionError("the store refused this launcher (another job's port, or its key)")
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock, self.instance, self.heard = sock, str(reply["instance"]), time.monotonic()
                self.pushed.update(reply.get("pushed", {}))
                threading.Thread(target=self._read, args=(stream,), name="hpcshard-coord-client",
                                 daemon=True).start()
                return True
            except (OSError, ValueError):
                if time.monotonic() >= deadline:
                    return False
                if waiting is not None:
                    waiting()
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return False

    def leave(self) -> None:
        """Say this launcher gives the store up, before closing: never blocking (the store's
        host may stand still); one frozen reads it when it thaws, before the close."""
        if self.sock is None or self.closed or not self.lock.acquire(timeout=0.5):
            return
        try:
            with contextlib.suppress(OSError):
                self.sock.send(b'{"op":"leave","id":0}\n', socket.MSG_DONTWAIT)
        finally:
            self.lock.release()

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

    def _read(self, stream: io.BufferedReader) -> None:
        try:
            while line := stream.readline(LINE_LIMIT):
                self.heard = time.monotonic()
                message = json.loads(line)
                if "push" in message:
                    self.pushed[str(message["push"])] = message["value"]
                    self.news.set()
                    continue
                waiting = self.pending.pop(int(message.get("id") or 0), None)
                if waiting is not None:
                    _, done, box, then = waiting
                    box.append(message)
                    if then is not None:
                        then(message)
                    done.set()
        except (OSError, ValueError):
            pass
        self.closed = True  # (the store's end closed: its launcher is gone)
        for _, done, _, _ in list(self.pending.values()):
            done.set()
        self.news.set()

    def send(self, op: str, then: Callable[[dict[str, Any]], None] | None = None,
             **fields: Any) -> tuple[threading.Event, list[dict[str, Any]]]:
        """Send a request; the answer lands in the returned box (and goes to `then`)."""
        if self.closed or self.sock is None:
            raise Unreachable(f"the store on {self.host}:{self.port} closed")
        rid = next(self.ids)
        done, box = threading.Event(), list[dict[str, Any]]()
        self.pending[rid] = (time.monotonic(), done, box, then)
        line = json.dumps({"op": op, "id": rid, **fields}, separators=(",", ":")).encode() + b"\n"
        try:
            with self.lock:
                self.sock.sendall(line)
                self.sent += 1
        except OSError as err:
            self.pending.pop(rid, None)
            raise Unreachable(f"the store on {self.host}:{self.port}: {err}") from err
        return done, box

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """A request and its answer; Unreachable once the store is silent (`silent`)."""
        done, box = self.send(op, **fields)
        while not done.wait(0.1):
            if self.silent():
                raise Unreachable(f"the store on {self.host}:{self.port} did not answer for {LOST_S:.0f} s")
        if not box:
            raise Unreachable(f"the store on {self.host}:{self.port} closed")
        return box[0]

    def silent(self, now: float | None = None) -> bool:
        """Gone quiet: closed, or a request sent LOST_S ago with nothing heard since it
        was sent (a store slow to answer is heard sooner or later; one on a node that froze
        or died is not)."""
        now = time.monotonic() if now is None else now
        if self.closed:
            return True
        waiting = [sent for sent, _, _, _ in list(self.pending.values())]
        if not any(now - sent > LOST_S and self.heard < sent for sent in waiting):
            return False
        # Answers waiting to be read are no silence: this launcher stood still (its node
        # frozen, starved of the CPU) and the thread asking ran before its reader thread
        # (and before `woke`).
        with contextlib.suppress(OSError, ValueError):
            if self.sock is not None and select.select([self.sock], [], [], 0)[0]:
                return False
        return True

    def woke(self) -> None:
        """This launcher stood still: what it sent waited with it (not the store's fault)."""
        now = time.monotonic()
        for rid, (_, done, box, then) in list(self.pending.items()):
            if rid in self.pending:
                self.pending[rid] = (now, done, box, then)


# -- what the supervisor uses ----------------------------------------------------------------
def _key(*parts: object) -> str:
    return "/".join(str(p) for p in parts)


def _node_of(key: str) -> int:
    """The node a per-node key names (`alive/A/N`, `down/A/C/N`)."""
    return int(key.rsplit("/", 1)[1])


class Channel:
    """What the launchers of one attempt say to each other: through the store while it
    answers, through the run directory's files before it is had (`open`) and once it is
    lost (for the rest of the attempt). The same calls as `rundir.launchers`, the run
    directory given once."""

    def __init__(self, run_dir: Path, node: int, first_cycle: int = 0, host_node: int = 0) -> None:
        self.run_dir, self.node, self.first_cycle, self.host_node = run_dir, node, first_cycle, host_node
        """`first_cycle`: the first cycle this store saw (one served anew after node 0's
        was lost); the faults and decisions of those before are in the files."""
        self.client: Client | None = None
        self.server: Server | None = None
        self.lost_why = ""
        """Why the store was given up (empty while it is used, or never was)."""
        self.fell_back = False
        """The store was used, then given up: the others move to the files too, or it is
        this launcher that was cut off (`Supervisor._isolated`)."""
        self.beats_seen: dict[int, dict[str, Any]] = {}
        self.watched: set[int] = set()
        """The nodes whose heartbeats each of this launcher's heartbeats brings back."""
        self.asked: dict[int, float] = {}
        """When (monotonic) each node's heartbeat was last asked for."""
        self.opened = 0.0
        """When (monotonic) the store was joined."""
        self.standby: Server | None = None
        """The standby store this launcher serves for the store's host (`stand_by`)."""
        self.gave_up: set[int] = set()
        """The nodes whose store this launcher gave up (they are lost to it)."""
        self.moves = 0
        """How often it moved (to a standby, or to the files): each move gives the peers a
        fresh grace to show up where it went (`Supervisor._isolated`)."""
        self.mine: dict[str, Any] = {}
        """What it set on the store (its down record of the latest cycle): carried to the
        standby."""
        self.on_store: set[int] = set()
        """The nodes heard through the store in use (since it was joined or moved to)."""
        self.settled = False
        """Every peer showed up on the standby it moved to (`Supervisor._isolated`): nobody
        is on the files to be heard there (`_bridging`)."""
        self.closed = False
        self.attempt, self.key, self.nodes = 0, "", 0
        """`nodes`: the job's launchers (`Server.nodes`), once `open` was told them."""
        self.moving = threading.RLock()
        """Held while it moves: another thread's call waits for the standby, not the files."""

    # -- the store's life ------------------------------------------------------------
    def open(self, host: str, port: int, key: str, attempt: int, serve: bool,
             where: dict[str, Any] | None = None, waiting: Callable[[], None] | None = None,
             nodes: int = 0) -> bool:
        """Connect to the job's store at host:port (node 0, `serve`, starts it first, there
        alone: `host` is the name every launcher is told, `Server.host`).
        Until it is connected, and if it cannot be within UNHEARD_S, the files serve.
        Each launcher first writes its heartbeat file once: should the store be lost, its
        peers find that name already there (a name first looked up after it was created
        on another host is not hidden by NFS's negative lookup cache). `where`: the node,
        as its heartbeats say it (host, Slurm node). `waiting`: called between tries to
        connect (the launcher's heartbeat, into the files until it is connected: node 0 may
        be on them already, having failed to serve, and would take a launcher silent for
        LOST_S while it tries for lost)."""
        with contextlib.suppress(OSError):
            (self.run_dir / launchers.LAUNCH).mkdir(exist_ok=True)
            launchers.beat(self.run_dir, attempt, self.node, {**(where or {}), "pid": os.getpid(), "seq": 0})
        self.attempt, self.key, self.nodes = attempt, key, nodes
        if serve:
            try:
                self.server = Server(key, port, host, attempt, nodes).start()
            except OSError as err:
                self._give_up(f"node 0 could not serve the store on port {port} ({err.strerror})")
                return False
        client = Client(host, port, key, self.node, attempt)
        if not client.connect(time.monotonic() + UNHEARD_S, waiting):
            self._give_up(f"no store answered on {host}:{port} within {UNHEARD_S:g} s")
            return False
        self.client, self.opened = client, time.monotonic()
        return True

    @property
    def store(self) -> Client | None:
        """The store while it is used; None once it went silent and no standby answered
        (then the files serve). The launcher that serves it never gives its own up for
        silence (a starved process is slow to answer itself, and it is not cut off from
        itself)."""
        client = self.client
        if client is not None and client.silent() and (self.server is None or client.closed):
            self._give_up(f"the store on {client.host}:{client.port} (node {self.host_node}'s launcher) "
                          "went silent", client)
        elif client is None and self.fell_back and not self.lost_why:
            with self.moving:  # (another thread is moving to the standby: its answer, not the files)
                pass
        return self.client

    def stand_by(self, host: str) -> bool:
        """Serve the standby for the store's host, and say where in the store (`standby/`):
        every launcher knows it before it is needed. `host`: this launcher's host, as the
        others reach it (it listens there alone). False: no store in use, or no port could be
        had (the files stay the way out)."""
        if self.store is None or self.standby is not None:
            return False
        try:
            standby = Server(self.key, 0, host, self.attempt, self.nodes).start()
        except OSError:
            return False
        where = {"host": host, "port": standby.port, "node": self.node}
        if self._call("exchange", set={_key("standby", self.attempt, self.host_node): where}) is None:
            standby.close()
            return False
        self.standby = standby
        return True

    def _give_up(self, why: str, silent: Client | None = None) -> None:
        """Leave the store: for the standby where one answers, else the files. `silent`:
        the client found silent; another thread that moved on meanwhile leaves the new one
        alone. Two threads may give a silent store up at once (the decision is shared on one
        while the launcher beats on the other); the second waits for the first's move."""
        with self.moving:
            client = self.client
            if client is not None and silent is not None and client is not silent:
                return  # (another thread moved on already)
            self.client = None
            if client is not None:
                self.fell_back = True
                self.gave_up.add(self.host_node)
                self.moves += 1
                client.leave()  # (its host hears it at once if it still runs: `Server.quit`)
                client.close()
                # (the launcher that serves the store never moves away from it: its own
                # store silent to itself is its host starved or cut off, and it leaves the
                # run, `Supervisor._still_serving`; moving, it would serve its peers while
                # it listened elsewhere)
                if self.server is None and self._to_standby(client, why):
                    return
                following = self.server is None and bool(
                    client.pushed.get(_key("standby", self.attempt, self.host_node)))
                if following:
                    threading.Thread(target=self._follow, args=(client, why), name="hpcshard-follow",
                                     daemon=True).start()
                    why += " and so did its standby"
            if not self.lost_why:
                self.lost_why = why
                print(f"hpcshard: node {self.node}: {why}; the launchers coordinate through the run "
                      "directory's files for the rest of this attempt", file=sys.stderr, flush=True)

    def _to_standby(self, left: Client, why: str, wait: float = 0.0) -> bool:
        """Move to the standby of the store just left, carrying what this launcher knew of
        it (its pushes, its own down records). False: none was named, or it does not answer
        within STANDBY_CONNECT_S."""
        found = left.pushed.get(_key("standby", self.attempt, self.host_node))
        if not isinstance(found, dict) or int(found.get("node", self.host_node)) in self.gave_up:
            return False
        host, port, node = str(found["host"]), int(found["port"]), int(found["node"])
        own = self.standby is not None and node == self.node
        client = Client(host, port, self.key, self.node, self.attempt)
        # (its own standby it waits for as long as a silent store: its loop may be busy with
        # the crowd moving in, and missing it, the decider would be alone on the files)
        if not client.connect(time.monotonic() + (LOST_S if own else wait or STANDBY_CONNECT_S)):
            client.close()
            return False
        try:
            for key, value in list(left.pushed.items()):
                if key.startswith(CARRIED):
                    client.pushed.setdefault(key, client.call("create", key=key, value=value)["value"])
            if self.mine:
                client.call("exchange", set=self.mine)
        except Unreachable:
            client.close()
            return False
        self.client, self.host_node, self.opened = client, node, time.monotonic()
        # (heard anew there; a peer's last heartbeat through the store left is kept, for
        # where it ran, but does not hide a newer one in its heartbeat file, should it be
        # on the files: `beats`)
        self.on_store, self.asked, self.watched = set(), {}, set()
        if own:  # (it serves the store now)
            self.server, self.standby = self.standby, None
        print(f"hpcshard: node {self.node}: {why}; the launchers coordinate through the standby "
              f"store on node {node} ({host}:{port})", file=sys.stderr, flush=True)
        return True

    def _follow(self, left: Client, why: str) -> None:
        """A launcher that went to the files when the standby did not answer in time tries
        it again every FOLLOW_S for JOIN_S: its peers are there, and a fault declared there
        reaches it only through its own ranks otherwise."""
        until = time.monotonic() + JOIN_S
        while time.monotonic() < until:
            time.sleep(FOLLOW_S)
            with self.moving:
                if self.closed or self.client is not None:
                    return
                if self._to_standby(left, f"{why} (the standby answered later)", wait=CONNECT_TRY_S):
                    self.lost_why = ""
                    self.moves += 1
                    return

    def present(self) -> set[int] | None:
        """The nodes on the store now, or that ended there; None without one."""
        found = self._call("who")
        return None if found is None else {int(n) for n in found.get("nodes", [])}

    def settle(self, everyone: bool) -> None:
        """The move is over: most peers showed up on the standby (`everyone`: all of them,
        and nobody is to be heard through the files)."""
        self.fell_back = False
        self.settled = self.settled or everyone

    def close(self) -> None:
        self.closed = True
        if self.client is not None:
            self.client.close()
        if self.standby is not None:
            self.standby.close()
        if self.server is not None:
            # (linger: a peer still waiting for the last pushes gets them, then EOF)
            self.server.close()

    def woke(self) -> None:
        if self.client is not None:
            self.client.woke()

    def wait(self, seconds: float, on_store: float | None = None) -> None:
        """Sleep `seconds` between two looks, woken at once by a push (a fault, a decision,
        a fencing) while the store is used: the launchers act on a fault as soon as it is
        pushed, not at their next look (with a look every 0.2 s, the last of N launchers
        to act waited about 0.2 s at 128 nodes, a twentieth of it at 2). `on_store`: the
        interval while the store is used, for a look at what it does not push (the
        downs: only the decider looks, for the few tenths of a second a fault lasts)."""
        client = self.client
        if client is None:
            time.sleep(seconds)
            return
        client.news.wait(seconds if on_store is None else on_store)
        client.news.clear()

    def _call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """An answer from the store, or None: it is not used (the caller asks the files)."""
        while (store := self.store) is not None:
            try:
                return store.call(op, **fields)
            except Unreachable as err:
                self._give_up(str(err), store)  # (then asked again: of the standby, if one took over)
        return None

    # -- the protocol ------------------------------------------------------------------
    def declare_fault(self, attempt: int, cycle: int, record: dict[str, Any]) -> bool:
        record = {"time": time.time(), **record}
        found = self._call("create", key=_key("fault", attempt, cycle), value=record)
        if found is None:
            return launchers.declare_fault(self.run_dir, attempt, cycle, record)
        self._pushed(_key("fault", attempt, cycle), found["value"])
        return bool(found["won"])

    def fault(self, attempt: int, cycle: int) -> dict[str, Any] | None:
        return self._cycle_record("fault", attempt, cycle, launchers.fault)

    def mark_down(self, attempt: int, cycle: int, node: int, record: dict[str, Any]) -> None:
        value = {"time": time.time(), "node": node, **record}
        key = _key("down", attempt, cycle, node)
        self.mine = {key: value}
        if self._call("exchange", set={key: value}) is None:
            launchers.mark_down(self.run_dir, attempt, cycle, node, record)

    def downs(self, attempt: int, cycle: int, nodes: int) -> list[dict[str, Any]]:
        found = self._call("scan", prefix=_key("down", attempt, cycle, ""))
        if found is None:
            return launchers.downs(self.run_dir, attempt, cycle, nodes)
        by_node = {_node_of(key): dict(value) for key, value in found["values"].items()}
        for down in self._bridged_downs(attempt, cycle, nodes, set(by_node)):
            by_node.setdefault(int(down["node"]), down)
        return [by_node[n] for n in sorted(by_node)]

    def nodes_down(self, attempt: int, cycle: int, nodes: int) -> list[int]:
        """Which nodes said they are down: the keys alone (the decider asks 20 times a
        second while it waits, and each down record carries its node's ranks and flight
        records)."""
        found = self._call("scan", prefix=_key("down", attempt, cycle, ""), keys=True)
        if found is None:
            return [int(d["node"]) for d in launchers.downs(self.run_dir, attempt, cycle, nodes)]
        down = {_node_of(key) for key in found["values"]}
        down |= {int(d["node"]) for d in self._bridged_downs(attempt, cycle, nodes, down)}
        return sorted(down)

    def _bridging(self) -> bool:
        """For JOIN_S after the launchers moved to a standby or joined a store served anew,
        those on it and those still on the files hear each other through the files: their
        heartbeats, their down records. (One that missed the standby, its host busy for a
        moment, goes to the files; unheard there, the standby's decider would take it for
        lost and drain a healthy node.)"""
        return (bool(self.first_cycle or self.gave_up) and not self.settled
                and time.monotonic() - self.opened < JOIN_S)

    def _bridged_downs(self, attempt: int, cycle: int, nodes: int, known: set[int]) -> list[dict[str, Any]]:
        """While bridging, the down records in the files of the nodes not heard through the
        store (one name looked up each: the decider asks 20 times a second)."""
        if not self._bridging():
            return []
        late = [n for n in range(nodes) if n not in known and n not in self.on_store and n != self.node]
        with contextlib.suppress(OSError, ValueError):
            return launchers.downs(self.run_dir, attempt, cycle, nodes, of=late) if late else []
        return []

    def decide(self, attempt: int, cycle: int, decided: dict[str, Any]) -> dict[str, Any]:
        """Share this decider's decision; the one that stands (another decider's, if it came
        first): `arbitrate`, then `share`."""
        return self.share(attempt, cycle, self.arbitrate(attempt, cycle, decided) or decided)

    def arbitrate(self, attempt: int, cycle: int, decided: dict[str, Any]) -> dict[str, Any] | None:
        """Through the store, the run directory's exclusive create says first whose decision
        stands, before the store's launchers learn it (`share`): two launchers that cannot
        reach each other but both reach the storage (a 2-node job cut in two, node 0 on its
        store, node 1 on the files) each decide the same cycle, each blaming the other, and
        the file server takes exactly one of them. One file a decision, at an event. None:
        the store is not used (the file `share` creates says it, and shares it at once),
        or the storage refused the file (the store's create says it: a full disk stops no
        recovery)."""
        if self.store is None:
            return None
        with contextlib.suppress(OSError):
            return launchers.decide(self.run_dir, attempt, cycle, decided)
        return None

    def share(self, attempt: int, cycle: int, decided: dict[str, Any]) -> dict[str, Any]:
        """Tell every launcher the decision (`arbitrate`'s, where it said one); the one that
        stands (another decider's, if the store or the files had one first)."""
        found = self._call("create", key=_key("next", attempt, cycle), value=decided)
        if found is None:
            return launchers.decide(self.run_dir, attempt, cycle, decided)
        self._pushed(_key("next", attempt, cycle), found["value"])
        return dict(found["value"])

    def decision(self, attempt: int, cycle: int) -> dict[str, Any] | None:
        return self._cycle_record("next", attempt, cycle, launchers.decision)

    def _cycle_record(self, kind: str, attempt: int, cycle: int,
                      from_files: Callable[[Path, int, int], dict[str, Any] | None]) -> dict[str, Any] | None:
        """A cycle's pushed record (`kind`: fault, next); from the files without the store,
        or for a cycle before the store served anew."""
        store = self.store
        if store is None or cycle < self.first_cycle:
            return from_files(self.run_dir, attempt, cycle)
        found = store.pushed.get(_key(kind, attempt, cycle))
        return dict(found) if found is not None else None

    def fence(self, attempt: int, why: str) -> None:
        """Every launcher of this job leaves (the run was taken over): pushed to them all."""
        self._call("create", key=_key("fenced", attempt), value=why)

    def fenced(self, attempt: int) -> str:
        store = self.store
        return str(store.pushed.get(_key("fenced", attempt)) or "") if store is not None else ""

    def beat(self, attempt: int, node: int, record: dict[str, Any]) -> None:
        """This launcher's heartbeat. To the store it is sent without waiting (the answer,
        the heartbeats it watches, lands when it comes: a slow store never holds up the
        supervision); to the files it is written whole."""
        store = self.store
        if store is None:
            launchers.beat(self.run_dir, attempt, node, record)
            return
        try:
            store.send("exchange", then=self._heard,
                       set={_key("alive", attempt, node): {"node": node, **record}},
                       get=[_key("alive", attempt, n) for n in sorted(self.watched)])
        except Unreachable as err:
            self._give_up(str(err), store)
            if self.store is not None:  # (moved to the standby: the next beat goes there)
                return
            launchers.beat(self.run_dir, attempt, node, record)
            return
        if self._bridging():
            # A store served anew (or a standby moved to): the launchers not in it yet
            # learn of it through the files, as late as NFS shows the decision, and hear
            # this one there meanwhile (a spare that stopped hearing the decider took
            # itself for the one cut off and left: the chaos soak on NFS-like views).
            with contextlib.suppress(OSError):
                launchers.beat(self.run_dir, attempt, node, record)

    def beats(self, attempt: int, nodes: int, of: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
        """The newest heartbeats of `of` (default every node), by node. Through the store:
        those the last heartbeat's answer brought; a node not watched before is asked for
        at once, and watched from then on. A node not yet in a store served anew is heard
        through its heartbeat file for JOIN_S (it learns of the store through the files)."""
        wanted = set(range(nodes) if of is None else of) - {self.node}
        if self.store is None:
            return launchers.beats(self.run_dir, attempt, nodes)
        now = time.monotonic()
        new = {n for n in wanted if now - self.asked.get(n, -math.inf) > WATCH_KEEP_S}
        self.asked.update({n: now for n in wanted})
        # (watched: asked for lately; a launcher that looked at every node below it to
        # find the decider must not fetch them all every second from then on)
        self.watched = {n for n, at in self.asked.items() if now - at <= WATCH_KEEP_S}
        if new:
            found = self._call("exchange", get=[_key("alive", attempt, n) for n in sorted(new)])
            if found is None:
                return launchers.beats(self.run_dir, attempt, nodes)
            self._heard(found)
        # (a copy first: the reader thread adds the nodes it first hears of as this reads;
        # copying a dict is one step under the GIL, iterating it is not)
        seen = self.beats_seen.copy()
        heard = {n: b for n, b in seen.items() if n in wanted}
        late = wanted - self.on_store
        if late and self._bridging():
            for n, beat in launchers.beats(self.run_dir, attempt, nodes, of=late).items():
                if n not in heard or newer(heard[n], beat):
                    heard[n] = beat
        return heard

    def _heard(self, answer: dict[str, Any]) -> None:
        """The heartbeats an exchange brought back (on the reader thread for a heartbeat's,
        on this one for a node asked for at once)."""
        for key, value in answer.get("values", {}).items():
            if value is not None:
                self.beats_seen[_node_of(key)] = value
                self.on_store.add(_node_of(key))

    def _pushed(self, key: str, value: Any) -> None:
        if self.client is not None:
            self.client.pushed.setdefault(key, value)
