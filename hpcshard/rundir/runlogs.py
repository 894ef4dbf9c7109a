"""A run's rank logs as one stream (`hpcshard logs`): every attempt and restart cycle of
every rank, in order, each piece under a header line, filtered by rank, node or attempt.
Stdlib only: the ranks write the start line (`start_line`), the CLI reads.

Each rank appends to RUN_DIR/logs/rank-R.log across attempts and cycles; every (re)start
of a rank begins with a LOG_START line that says which attempt and cycle follow, and
(since this module) where it runs: "==== start of attempt 1 cycle 0 (pid 812, host n1,
node 0, job 4242)". Older logs' start lines stop after the pid: their pieces are still
told apart, only `--node` cannot place them. Lines above a rank's first start line (a
log older than the start line) belong to no attempt and come first, without a header.

Interleaving: hpcshard's runtime stamps each line with the time of day to the second
("12:03:04 [rank 1] INFO ..."); within one attempt and cycle the ranks' lines are merged
by that stamp, a rank's own lines never reordered (a line without a stamp, a traceback's
or faulthandler's, keeps the stamp of the line above it), and lines of one second come
rank by rank. A script's ranks print no stamps: their lines come rank by rank within
each piece (while following: as each poll finds them). The stamps carry no date: a rank
whose clock goes back by more than 12 hours has passed midnight.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG_START = "==== start of"
"""Begins the line every (re)start of a rank writes first into its log."""

_START = re.compile(re.escape(LOG_START) + r" attempt (\d+) cycle (\d+)(?: \((.*)\))?\s*$")
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d) \[rank \d+\] ")
_DAY = 86400.0

Piece = tuple[int, int]
"""An attempt and a restart cycle within it."""


def start_line(attempt: int, cycle: int, pid: int, host: str, node: int, job: str | None) -> str:
    """What a rank writes first into its log at each start (without its logger's prefix)."""
    where = f"pid {pid}, host {host}, node {node}" + (f", job {job}" if job else "")
    return f"{LOG_START} attempt {attempt} cycle {cycle} ({where})"


@dataclass(frozen=True)
class Start:
    """A rank's start line, parsed: which piece follows, and where the rank ran (None:
    an older log that does not say)."""

    piece: Piece
    host: str | None = None
    node: int | None = None
    job: str | None = None
    at: str | None = None
    """The time of day it was written (HH:MM:SS; None: a line without a stamp)."""

    def on(self, node: str) -> bool:
        """Did the rank run on `node` (a host name, or a node number) in this piece?"""
        return self.host == node or (node.isdigit() and self.node == int(node))


def parse_start(line: str) -> Start | None:
    """The start line in `line` (with or without its logger's prefix); None for any other."""
    found = _START.search(line)
    if found is None:
        return None
    fields = dict(part.partition(" ")[::2] for part in (found.group(3) or "").split(", ") if part)
    node, stamp = fields.get("node", ""), _STAMP.match(line)
    return Start(piece=(int(found.group(1)), int(found.group(2))), host=fields.get("host") or None,
                 node=int(node) if node.isdigit() else None, job=fields.get("job") or None,
                 at=line[:8] if stamp else None)


@dataclass(frozen=True)
class Line:
    """One line of a rank's log: its rank, its piece (None: above the rank's first start
    line), its time of day in seconds (None: no stamp yet in this piece) and its text."""

    rank: int
    piece: Piece | None
    t: float | None
    text: str


@dataclass
class RankLog:
    """What has been read of one rank's log, so that more can be read later: where the
    next read starts, an unfinished last line, and the piece and time the next line
    continues. Read as bytes and decoded across reads (a read that ends inside a UTF-8
    character finishes it with the next; a byte that is not UTF-8 shows as U+FFFD)."""

    rank: int
    path: Path
    pos: int = 0
    partial: str = ""
    piece: Piece | None = None
    t: float | None = None
    day: float = 0.0
    decode: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(
        errors="replace").decode)

    def read(self, final: bool, starts: dict[tuple[int, Piece], Start]) -> list[Line]:
        """The lines written since the last read (one stat, and a read only when it grew);
        `final`: the unfinished last line too. Start lines are noted in `starts` (by rank
        and piece), not returned."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return []
        if size < self.pos:  # (truncated or replaced by hand: read it again from the top)
            self.pos, self.partial = 0, ""
        text = ""
        if size > self.pos:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read(size - self.pos)
            self.pos += len(chunk)
            text = self.decode(chunk, final=final)
        elif final:
            text = self.decode(b"", final=True)
        text = self.partial + text
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        if final and lines and lines[-1] == "":
            lines.pop()
        return [line for line in (self._line(text, starts) for text in lines) if line is not None]

    def _line(self, text: str, starts: dict[tuple[int, Piece], Start]) -> Line | None:
        start = parse_start(text)
        if start is not None:
            self.piece, self.t, self.day = start.piece, None, 0.0
            starts[(self.rank, start.piece)] = start
        stamp = _STAMP.match(text)
        if stamp is not None:
            t = int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3]) + self.day
            if self.t is not None and t < self.t - _DAY / 2:  # past midnight
                self.day += _DAY
                t += _DAY
            self.t = t
        return None if start is not None else Line(self.rank, self.piece, self.t, text.rstrip("\r"))


def order(lines: Iterable[Line]) -> list[Line]:
    """Lines of several ranks (each rank's in the order written) as one stream: piece by
    piece (lines of no piece first), and within a piece merged by time (see the module)."""
    by_piece: dict[Piece | None, dict[int, list[Line]]] = {}
    for line in lines:
        by_piece.setdefault(line.piece, {}).setdefault(line.rank, []).append(line)
    out: list[Line] = []
    for piece in sorted(by_piece, key=lambda p: (-1, -1) if p is None else p):
        ranks = by_piece[piece]
        out += heapq.merge(*(ranks[r] for r in sorted(ranks)), key=lambda line: line.t or 0.0)
    return out


@dataclass(frozen=True)
class Where:
    """Where each rank of a piece ran, from the ranks' start lines."""

    hosts: Mapping[int, str]
    """Rank -> host."""
    nodes: Mapping[int, int]
    """Rank -> node number in the piece."""
    job: str | None = None
    """The Slurm job the ranks said they ran in (None: not Slurm, or an older log)."""
    at: str | None = None
    """The earliest start line's time of day (HH:MM:SS)."""

    @classmethod
    def of(cls, starts: Mapping[tuple[int, Piece], Start], piece: Piece) -> Where:
        mine = {rank: s for (rank, p), s in starts.items() if p == piece}
        return cls(hosts={r: s.host for r, s in mine.items() if s.host is not None},
                   nodes={r: s.node for r, s in mine.items() if s.node is not None},
                   job=next((s.job for s in mine.values() if s.job), None),
                   at=min((s.at for s in mine.values() if s.at), default=None))


@dataclass(frozen=True)
class Filter:
    """Which lines to show: of these ranks (None: all), on this node (a host or a node
    number, per piece: nodes change between attempts), of this attempt."""

    ranks: frozenset[int] | None = None
    node: str | None = None
    attempt: int | None = None

    def keeps(self, line: Line, starts: Mapping[tuple[int, Piece], Start]) -> bool:
        if self.ranks is not None and line.rank not in self.ranks:
            return False
        if self.attempt is not None and (line.piece is None or line.piece[0] != self.attempt):
            return False
        if self.node is not None:
            start = starts.get((line.rank, line.piece)) if line.piece is not None else None
            return start is not None and start.on(self.node)
        return True


def header(piece: Piece, where: Where, started: Mapping[str, Any] | None) -> str:
    """The line above a piece, from the ranks' start lines (`where`), and where they do not
    say (older logs, a script's) from `started`, the ledger's start record of the piece
    (None: not written yet, or a run killed before it was)."""
    attempt, cycle = piece
    parts: list[str] = []
    job = where.job or (started or {}).get("slurm_job")
    hosts = [where.hosts[r] for r in sorted(where.hosts, key=lambda r: (where.nodes.get(r, 0), r))]
    distinct = list(dict.fromkeys(hosts))
    nodes = len(set(where.nodes.values())) or int((started or {}).get("nodes") or 0)
    if job:
        parts.append(f"job {job}")
    if distinct and len(distinct) == nodes:
        parts.append(f"node{'s' if nodes > 1 else ''} {','.join(distinct)}")
    elif nodes:
        on = f" on {','.join(distinct)}" if distinct else ""
        parts.append(f"{nodes} node{'s' if nodes > 1 else ''}{on}")
    if where.hosts or where.nodes:
        ranks = sorted({*where.hosts, *where.nodes})
        run = len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} "
                     + (f"{ranks[0]}-{ranks[-1]}" if run else ",".join(map(str, ranks))))
    if where.at:  # the first rank's start (the ledger's is rank 0's, after loading)
        parts.append(f"started {where.at}")
    elif started and started.get("time"):  # (a script's lines have no stamps)
        parts.append("started " + time.strftime("%H:%M:%S", time.localtime(float(started["time"]))))
    return f"==> attempt {attempt} (restart {cycle}): {', '.join(parts) or 'no start line'} <=="


@dataclass
class Stream:
    """Turns ordered lines into the text shown: a header above each piece (again where
    lines of an earlier piece come late, while following), and "[rank R] " before a line
    that does not say its rank (a traceback's, a script's) where several ranks show."""

    several: bool
    shown: Piece | None = None
    begun: bool = False

    def render(self, lines: Iterable[Line], starts: Mapping[tuple[int, Piece], Start],
               ledger: Mapping[Piece, Mapping[str, Any]]) -> list[str]:
        out = []
        for line in lines:
            if line.piece is not None and (line.piece != self.shown or not self.begun):
                out.append(header(line.piece, Where.of(starts, line.piece), ledger.get(line.piece)))
            self.shown, self.begun = line.piece, True
            tag = self.several and not _STAMP.match(line.text)
            out.append(f"[rank {line.rank}] {line.text}" if tag else line.text)
        return out


def started(records: Iterable[Mapping[str, Any]]) -> dict[Piece, Mapping[str, Any]]:
    """The ledger's start record of each piece (the last, should one be written twice)."""
    return {(int(r["attempt"]), int(r.get("cycle", 0))): r for r in records if r.get("event") == "start"}


def rank_of(path: Path) -> int | None:
    """The rank of a log named rank-R.log; None for any other file."""
    found = re.fullmatch(r"rank-(\d+)\.log", path.name)
    return int(found.group(1)) if found else None


@dataclass
class RunLogs:
    """A run's rank logs, read as they grow: each `read` returns the lines written since
    the last one, ordered and filtered. The log folder is listed once a read (for ranks
    that begin to log) and each rank's log stat'ed once; nothing else is touched."""

    logs: Path
    keep: Filter = field(default_factory=Filter)
    ranks: dict[int, RankLog] = field(default_factory=dict)
    starts: dict[tuple[int, Piece], Start] = field(default_factory=dict)

    def read(self, final: bool = False) -> list[Line]:
        self._find()
        new = [line for log in self.ranks.values() for line in log.read(final, self.starts)]
        return [line for line in order(new) if self.keep.keeps(line, self.starts)]

    def _find(self) -> None:
        wanted = self.keep.ranks
        try:
            names = os.listdir(self.logs)
        except FileNotFoundError:
            return
        for name in names:
            rank = rank_of(Path(name))
            if rank is not None and rank not in self.ranks and (wanted is None or rank in wanted):
                self.ranks[rank] = RankLog(rank, self.logs / name)

    def nodes(self) -> list[str]:
        """Every node seen in the start lines read so far: hosts, and node numbers."""
        hosts = sorted({s.host for s in self.starts.values() if s.host})
        numbers = sorted({s.node for s in self.starts.values() if s.node is not None})
        return hosts + [str(n) for n in numbers]
