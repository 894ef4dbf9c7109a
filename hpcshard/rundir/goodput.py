"""Where a run's wall time went: training that advanced it (the goodput), and the rest.

The run's timeline, from its submission to its last record, is cut at every mark the run
directory holds: each start of the ranks (when their interpreter began, when their model
and checkpoint were ready), each metrics record of training, each fault and each end.
Every piece between two marks gets one category, so the categories add up to the wall
time by construction:

    queue+launch submission -> the first start of the ranks, a stop -> the next: Slurm's
                 queue, the launchers, torch's import, the rendezvous
    start-up     a start -> model built and checkpoint loaded
    training     steps trained for the first time (less saves and evaluations in them)
    recomputed   steps trained again after a fault (lost since the last checkpoint)
    checkpoint   saves during training, and the final save of a run that ends
    evaluation   held-out evaluations
    detection    the last record before a fault -> the fault declared
    recovery     a fault declared -> the next start (kill, decide, restart)

Effective training time is training / wall. Stdlib: `hpcshard status --goodput` reads it
on a login node.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcshard.rundir import ledger
from hpcshard.rundir.metrics import read_metrics

CATEGORIES = ("training", "recomputed", "checkpoint", "evaluation", "start-up", "queue+launch",
              "detection", "recovery")


@dataclass
class Goodput:
    wall: float
    seconds: dict[str, float] = field(default_factory=dict)
    faults: int = 0
    starts: int = 0

    @property
    def effective(self) -> float:
        """Training that advanced the run, as a share of the wall time."""
        return self.seconds.get("training", 0.0) / self.wall if self.wall > 0 else 0.0

    def lines(self, width: int = 30) -> list[str]:
        out = [f"wall time {self.wall:.1f} s from submission; {self.starts} start(s) of the ranks, "
               f"{self.faults} fault(s); effective training time {100 * self.effective:.1f}%"]
        for name in CATEGORIES:
            s = self.seconds.get(name, 0.0)
            share = s / self.wall if self.wall > 0 else 0.0
            out.append(f"  {name:<12} {s:9.1f} s {100 * share:5.1f}%  {'#' * round(width * share)}")
        return out


Piece = tuple[float, float, dict[str, float]]
"""A stretch of the timeline (start, end) and its seconds by category (they add up to it,
but for a step record whose save and evaluation times exceed the stretch)."""


def timeline(run_dir: Path, created: float, now: float | None = None) -> tuple[list[Piece], int, int]:
    """The run's wall time, cut at its marks and classified (see the module's text):
    the pieces in order, the faults and the starts of the ranks. `created`: when it was
    submitted (RunSpec.created)."""
    marks: list[tuple[float, str, dict[str, Any]]] = [(created, "submit", {})]
    for r in read_metrics(run_dir):
        if r.get("event") == "start":
            up = r.get("startup", {})
            entry, loaded = up.get("entry", r["time"]), up.get("loaded", r["time"])
            marks.append((entry, "entry", {}))
            marks.append((loaded, "loaded", {"first": int(r.get("first_step", 1))}))
        elif "loss" in r and "event" not in r:
            marks.append((r["time"], "step", r))
    faults = 0
    for r in ledger.read(run_dir):
        if r["event"] == "fault":
            faults += 1
            marks.append((r.get("declared") or r["time"], "fault", r))
        elif r["event"] == "end":
            marks.append((r["time"], "end", r))
    marks.sort(key=lambda m: m[0])
    last = marks[-1][0] if now is None else max(now, marks[-1][0])
    pieces: list[Piece] = []
    done = 0  # the furthest step trained so far
    before = 0  # the step the previous mark of this start stood at
    faulted = False  # since the last start: the ranks died of a fault
    for (t0, kind0, _), (t1, kind1, r1) in zip(marks, [*marks[1:], (last, "now", {})], strict=True):
        span = max(0.0, t1 - t0)
        out: dict[str, float] = {}
        if kind1 == "entry":
            out["recovery" if faulted else "queue+launch"] = span
            faulted = False
        elif kind1 == "loaded":
            out["start-up"] = span
            before = r1["first"] - 1
        elif kind1 == "step":
            paused = {"checkpoint": float(r1.get("save_s", 0)), "evaluation": float(r1.get("eval_s", 0))}
            out = {k: min(v, span) for k, v in paused.items()}
            rest = max(0.0, span - sum(out.values()))
            step = int(r1["step"])
            covered = max(1, step - before)
            new = max(0, step - max(before, done))
            out["training"] = rest * new / covered
            out["recomputed"] = rest * (covered - new) / covered
            done, before = max(done, step), step
        elif kind1 == "fault":
            out["recovery" if kind0 == "fault" else "detection"] = span
            faulted = True
        elif faulted or kind0 == "fault":
            out["recovery"] = span  # an end record written while the ranks died
        elif kind1 == "end" and r1.get("reason") == "error":
            out["detection"] = span
        elif kind0 == "end" or kind0 == "submit":
            out["queue+launch"] = span  # stopped, waiting for the next start (or still queued)
        else:
            out["checkpoint"] = span  # the last step -> its end: the final (or stop) save
        pieces.append((t0, max(t0, t1), out))
    return pieces, faults, sum(1 for m in marks if m[1] == "entry")


def between(pieces: list[Piece], start: float, end: float) -> dict[str, float]:
    """Seconds by category from `start` to `end` (a piece cut by either counts in
    proportion: e.g. the cost of one fault, up to the next)."""
    out: dict[str, float] = defaultdict(float)
    for t0, t1, seconds in pieces:
        inside = min(t1, end) - max(t0, start)
        if inside <= 0:
            continue
        share = inside / (t1 - t0) if t1 > t0 else 0.0
        for name, s in seconds.items():
            out[name] += s * share
    return dict(out)


def account(run_dir: Path, created: float, now: float | None = None) -> Goodput:
    """The run's wall time, cut and classified (see the module's text). `created`: when it
    was submitted (RunSpec.created)."""
    pieces, faults, starts = timeline(run_dir, created, now)
    out: dict[str, float] = defaultdict(float)
    for _, _, seconds in pieces:
        for name, s in seconds.items():
            out[name] += s
    last = pieces[-1][1] if pieces else created
    return Goodput(wall=last - created, seconds=dict(out), faults=faults, starts=starts)
