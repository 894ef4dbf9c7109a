"""Launchers see each other through heartbeats: each writes its own every BEAT_S, with a
sequence number that grows by one each time; a reader times the changes it sees with its
own monotonic clock. Nothing compares two hosts' clocks (a heartbeat that carried the
writer's wall time made a healthy node "lost" at once under 9 s of skew, and 3-7 s
silently shrank the tolerance)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

BEAT_S = 1.0
"""How often a launcher says it is alive (a small file in the run directory)."""
LOST_S = 8.0
"""A node whose heartbeat has not moved for this long is lost (dead, frozen, cut off):
eight missed heartbeats, so a launcher slowed by a loaded host is not taken for one."""
UNHEARD_S = 30.0
"""...and one never heard of is lost this long after this launcher began (launchers of one
job start seconds apart)."""


@dataclass
class Peers:
    """The other launchers' heartbeats as this one has seen them: per node, the last
    sequence number read and when (this launcher's monotonic clock) it last changed."""

    began: float = field(default_factory=time.monotonic)
    heard_since: float = field(default_factory=time.monotonic)
    """Since when this launcher's own heartbeats land: a peer's silence counts from then
    (on a full or hung disk nobody's beats land, and nobody is lost for it); inf while
    its own cannot be written."""
    seen: dict[int, tuple[Any, float]] = field(default_factory=dict)

    def observe(self, beats: dict[int, dict[str, Any]], now: float | None = None) -> None:
        """Take note of the heartbeats just read (`coord.Channel.beats`)."""
        now = time.monotonic() if now is None else now
        for node, beat in beats.items():
            mark = _mark(beat)
            if node not in self.seen or _moved(self.seen[node][0], mark):
                self.seen[node] = (mark, now)

    def lost(self, nodes: list[int] | tuple[int, ...], beats: dict[int, dict[str, Any]],
             now: float | None = None, after: float = LOST_S) -> list[int]:
        """Which of `nodes` are lost: a heartbeat that has not moved for LOST_S (never seen:
        UNHEARD_S after this launcher began), or for `after` where a longer silence is asked
        for (graces and the never seen lengthened as much). One that said it ended ("done")
        is not."""
        now = time.monotonic() if now is None else now
        self.observe(beats, now)
        unheard = self.began + UNHEARD_S - LOST_S
        return [n for n in nodes if "done" not in beats.get(n, {})
                and now - max(self.seen.get(n, (None, unheard))[1], self.heard_since) > after]

    def cannot_beat(self) -> None:
        """This launcher's own heartbeat could not be written."""
        self.heard_since = math.inf

    def beat_landed(self, now: float | None = None) -> None:
        """This launcher's own heartbeat was written: after a spell of none, its peers'
        silence counts from now."""
        if self.heard_since == math.inf:
            self.heard_since = time.monotonic() if now is None else now

    def grace(self, nodes: list[int] | tuple[int, ...] | set[int], seconds: float = LOST_S,
              now: float | None = None) -> None:
        """These nodes are lost only once silent for `seconds` from now, those never seen
        too (a fresh start for them: the launchers moved from node 0's store to the files,
        where each shows up once it has moved too, as late as the file system shows it)."""
        now = time.monotonic() if now is None else now
        for n in nodes:
            mark = self.seen[n][0] if n in self.seen else (None, None, None)
            self.seen[n] = (mark, now + seconds - LOST_S)

    def woke(self, now: float | None = None) -> None:
        """This launcher stood still (its node frozen, starved): it heard nothing meanwhile,
        so its peers' silence counts from now."""
        if self.heard_since != math.inf:
            self.heard_since = time.monotonic() if now is None else now


def newer(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Heartbeat `now`, read later, moved on from `before` (`_moved`)."""
    return _moved(_mark(before), _mark(now))


def _mark(beat: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (beat.get("pid"), beat.get("seq"), beat.get("done"))


def _moved(before: tuple[Any, Any, Any], now: tuple[Any, Any, Any]) -> bool:
    """A heartbeat moved: another launcher (pid), a later sequence number, or its end. An
    older one read later is not movement (a launcher's first heartbeat file, read after its
    peers fell back to the files from the store: `launch.coord`)."""
    if now[0] != before[0] or now[2] != before[2]:
        return True
    try:
        return int(now[1]) > int(before[1])
    except (TypeError, ValueError):
        return now[1] != before[1]
