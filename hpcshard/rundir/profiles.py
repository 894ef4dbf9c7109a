"""Profiles of a run (RUN_DIR/profiles/): the asks `hpcshard profile` leaves there, the
mark rank 0 leaves when the ranks take one, and the files the ranks write (stdlib).

An ask is a small JSON file, `asks/ask-NNNNNN.json`, created whole and exclusively (two
commands asking at once get two numbers). Rank 0 alone reads asks, so a file becoming
visible to the other nodes within some bound decides nothing; the ranks agree on the ask
in the step boundary's all-reduce (`runtime.profile`). Taking one writes
`asks/ask-NNNNNN.taken` with the first step it records and the ranks that record it: a
later start of the run does not record it again, and the command that asked learns where
to look.

An ask is marked taken when its window starts (not when the ranks agree on it: one
queued behind another window may never start if the run ends first); a start that took
it and ended before its traces were whole leaves it to the next start, once (TRIES).

Each recorded window is `step-SSSSSSSS/` (S: its first step), holding per recording rank
`rank-R.pt.trace.json` (Chrome/Perfetto trace; TensorBoard's profiler plugin reads
`*.pt.trace.json` under `--logdir RUN_DIR/profiles`), with memory on CUDA
`rank-R.memory.pickle` (open at https://pytorch.org/memory_viz), and `rank-R.done.json`,
written last, that says what the rank wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcshard.rundir.files import create_exclusive, write_atomic
from hpcshard.rundir.paths import RunPaths

ASKS = "asks"
_ASK = re.compile(r"ask-(\d{6,})\.json")


@dataclass(frozen=True)
class Ask:
    """What to record: `steps` steps on `ranks` (None: every rank), a memory snapshot too."""

    id: int
    steps: int
    ranks: tuple[int, ...] | None
    memory: bool

    def text(self) -> str:
        return json.dumps({**asdict(self), "ranks": list(self.ranks) if self.ranks is not None else "all"})

    @classmethod
    def parse(cls, text: str) -> Ask:
        raw = json.loads(text)
        ranks = raw["ranks"]
        return cls(id=int(raw["id"]), steps=int(raw["steps"]), memory=bool(raw["memory"]),
                   ranks=None if ranks == "all" else tuple(int(r) for r in ranks))

    def records(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def asks_dir(run_dir: Path) -> Path:
    return RunPaths(run_dir).profiles / ASKS


def ask_path(run_dir: Path, number: int) -> Path:
    return asks_dir(run_dir) / f"ask-{number:06d}.json"


def taken_path(run_dir: Path, number: int) -> Path:
    return asks_dir(run_dir) / f"ask-{number:06d}.taken"


def _numbers(run_dir: Path) -> list[int]:
    try:
        names = [e.name for e in asks_dir(run_dir).iterdir()]
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ASK.fullmatch(n)))


def put(run_dir: Path, steps: int, ranks: tuple[int, ...] | None, memory: bool) -> Ask:
    """Leave an ask for the run (the next free number: of two commands at once, each gets
    its own)."""
    asks_dir(run_dir).mkdir(parents=True, exist_ok=True)
    for _ in range(1000):
        ask = Ask(id=max(_numbers(run_dir), default=0) + 1, steps=steps, ranks=ranks, memory=memory)
        if create_exclusive(ask_path(run_dir, ask.id), ask.text()):
            return ask
    raise OSError(f"could not number an ask in {asks_dir(run_dir)}")


TRIES = 2
"""Starts of a run that may record one ask: a start that took it and ended before its
traces were whole (a fault, a requeue) leaves it to the next start, once."""


def read(run_dir: Path, number: int) -> Ask | None:
    """Ask `number` (None: gone, or a file that does not parse: nothing a rank reads may
    crash it)."""
    try:
        return Ask.parse(ask_path(run_dir, number).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete(run_dir: Path, mark: dict[str, Any]) -> bool:
    """A taken ask's traces are all written (every rank its mark names has its done file)."""
    window = window_dir(run_dir, int(mark["step"]))
    return all(done(window, int(r)) is not None for r in mark.get("ranks", []))


def pending(run_dir: Path, skip: frozenset[int] | set[int] = frozenset(), start: str = "") -> Ask | None:
    """The oldest ask not in `skip` that is still to record: never taken, or taken by an
    earlier start (not `start`) that ended before its traces were whole, fewer than TRIES
    times. The oldest, not the next above a high-water mark: on NFS a newer ask may be seen
    before an older one."""
    for number in _numbers(run_dir):
        if number in skip:
            continue
        mark = taken(run_dir, number)
        if mark is not None and (mark.get("start") == start or int(mark.get("tries", 1)) >= TRIES
                                 or complete(run_dir, mark)):
            continue
        ask = read(run_dir, number)
        if ask is not None:
            return ask
    return None


def take(run_dir: Path, number: int, first: int, ranks: list[int], dropped: list[int], start: str) -> None:
    """Rank 0, when ask `number`'s window starts at step `first`: recorded on `ranks`
    (`dropped`: asked, but beyond the ranks the run has now), by the start `start`
    (attempt.cycle)."""
    before = taken(run_dir, number)
    write_atomic(taken_path(run_dir, number), json.dumps(
        {"step": first, "ranks": ranks, "dropped": dropped, "start": start,
         "tries": int(before.get("tries", 1)) + 1 if before else 1}))


def taken(run_dir: Path, number: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads(taken_path(run_dir, number).read_text()))
    except (OSError, ValueError):
        return None


def window_dir(run_dir: Path, first: int) -> Path:
    return RunPaths(run_dir).profiles / f"step-{first:08d}"


def trace_path(window: Path, rank: int) -> Path:
    return window / f"rank-{rank}.pt.trace.json"


def memory_path(window: Path, rank: int) -> Path:
    return window / f"rank-{rank}.memory.pickle"


def done_path(window: Path, rank: int) -> Path:
    return window / f"rank-{rank}.done.json"


def done(window: Path, rank: int) -> dict[str, Any] | None:
    """What a rank wrote for a window, once it is whole (None: not yet)."""
    try:
        return dict(json.loads(done_path(window, rank).read_text()))
    except (OSError, ValueError):
        return None


def oom_path(run_dir: Path, rank: int, step: int) -> Path:
    return RunPaths(run_dir).profiles / f"oom-rank-{rank}-step-{step:08d}.pickle"


def windows(run_dir: Path) -> list[Path]:
    """The recorded windows, oldest first."""
    try:
        return sorted(p for p in RunPaths(run_dir).profiles.iterdir() if p.name.startswith("step-"))
    except FileNotFoundError:
        return []
