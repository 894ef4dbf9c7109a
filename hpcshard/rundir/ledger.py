"""The attempts ledger: RUN_DIR/attempts.jsonl, one `start` and one `end` record per
attempt (a start without an end is an attempt that was killed), and the run's other events
between them. Every record is a typed event of `rundir.events`; `append` takes nothing
else. Stdlib only: the launcher reads it to decide on a requeue, and the CLI to show what
happened."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpcshard.rundir import events, paths
from hpcshard.rundir.files import append_held, locked, read_lines

LEDGER = paths.LEDGER
FLOAT_REPR_MAX = 24
"""The most characters a float's repr takes ('-1.2345678901234567e-100'): how much longer
the time stamped under the lock can make a line than the one measured before it."""


def append(run_dir: Path, event: events.Event) -> None:
    """Append one event, with the time it is written. A bare dict is refused: each kind of
    record has one shape, its class's. Launchers and ranks of several hosts append: under
    the ledger's lock, as O_APPEND writes of two NFS clients are not atomic (each appends at
    the end its own client last saw, and one record overwrites the other); the lock's
    holder opens the file afresh, which revalidates its size (close-to-open), and writes
    at that end (`files.append_held`). Its token says how long the line may be: should the
    holder stand still past files.LOCK_STALE_S with the line on its way, its breaker
    leaves it that much room."""
    fields = events.record(event)  # (TypeError for anything but an event: see there)
    path = run_dir / LEDGER
    # (stamped again under the lock; and a newline first after a line cut short: append_held)
    most = len(_line(fields).encode()) + FLOAT_REPR_MAX + 1
    with locked(path, writes=most) as held:
        append_held(path, _line(fields), held)


def _line(fields: dict[str, Any]) -> str:
    return json.dumps({"time": time.time(), **fields}) + "\n"


def read(run_dir: Path) -> list[dict[str, Any]]:
    return read_lines(run_dir / LEDGER)


def end_of(run_dir: Path, attempt: int) -> dict[str, Any] | None:
    """The `end` record of one attempt, or None if it never wrote one (it was killed)."""
    ends = [r for r in read(run_dir) if r.get("event") == "end" and r.get("attempt") == attempt]
    return ends[-1] if ends else None


def next_attempt(run_dir: Path) -> int:
    return 1 + max((int(r["attempt"]) for r in read(run_dir)), default=-1)


def finished(records: list[dict[str, Any]], since: int) -> dict[str, Any] | None:
    """The record that ended the run for good in an attempt from `since` on (a job's
    first: older attempts are other jobs'): its `end` with reason done, or a `gave_up`;
    None while it may go on (no end yet, or one the launchers restart, requeue or
    continue: the record after it says which). What `submit --follow` stops at: the job
    may stay RUNNING or COMPLETING a while after (a lost node's task, `launch.release`)."""
    last = None
    for r in records:
        if int(r.get("attempt", -1)) >= since and r.get("event") in (
                "start", "end", "requeue", "chain", "guard", "gave_up"):
            last = r
    if last is None:
        return None
    done = last["event"] == "end" and last.get("reason") == events.EndReason.DONE
    return last if done or last["event"] == "gave_up" else None


def moved_on(run_dir: Path, attempt: int, cycle: int, records: list[dict[str, Any]] | None = None) -> bool:
    """Has the run started again since this attempt's cycle (a restart, a requeue)? A
    process of an older one was stopped or cut off meanwhile (a frozen node, thawed):
    it has nothing more to say, and what it would say (a failure, a lost peer) is stale.
    `records`: the ledger, when the caller read it already."""
    return any(r["event"] == "start" and (int(r["attempt"]), int(r.get("cycle", 0))) > (attempt, cycle)
               for r in (read(run_dir) if records is None else records))


def bad_nodes(run_dir: Path, attempt: int | None = None, lost: bool = False) -> list[dict[str, Any]]:
    """The run's bad-node records (`bad_node_records` of its ledger)."""
    return bad_node_records(read(run_dir), attempt, lost)


def bad_node_records(records: list[dict[str, Any]], attempt: int | None = None,
                     lost: bool = False) -> list[dict[str, Any]]:
    """The bad-node records among `records` (those of one attempt; only nodes lost, i.e.
    silent, whose launchers never end by themselves)."""
    return [r for r in records if r.get("event") == "bad_node"
            and (attempt is None or r.get("attempt") == attempt)
            and (not lost or str(r.get("reason", "")).startswith("lost"))]


def bad_slurm_nodes(run_dir: Path) -> list[str]:
    """The Slurm nodes this run must never use again (its bad-node records)."""
    return sorted({r["slurm_node"] for r in bad_nodes(run_dir) if r.get("slurm_node")})


def failed_saves(records: list[dict[str, Any]], since: int) -> list[dict[str, Any]]:
    """The failed saves in a row among `records` for ranks that train on from the committed
    step `since` (-1: none): the `save_failed` records that followed that same checkpoint,
    in any attempt or cycle (a restart or a requeue resumes from it and fails the same
    way), since the run last stopped for its storage (the user's `resume` after such a
    stop gives the storage its tries again). A commit starts a new row: its saves follow
    a newer step."""
    row: list[dict[str, Any]] = []
    for r in records:
        if r.get("event") == "end" and r.get("reason") == events.EndReason.STORAGE:
            row = []
        elif r.get("event") == "save_failed" and r.get("since") == since:
            row.append(r)
    return row
