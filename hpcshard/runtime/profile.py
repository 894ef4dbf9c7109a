"""torch.profiler traces and CUDA memory snapshots of a live run, on a schedule
(`profile_every`) or when asked (`hpcshard profile RUN`), and a snapshot on a CUDA OOM.

How an ask reaches the ranks, the way a stop does: rank 0 alone looks for an ask file (at
most every POLL_S seconds, one directory listing) and puts its number in the step
boundary's all-reduce, which every rank runs anyway (`Trainer._boundary`). When the agreed
number is new, rank 0 broadcasts the ask itself (a collective at the boundary, only then),
every rank queues the same window, and the window's steps are recorded by the ranks it
names. No restart, no collective outside the boundary, and no rank decides by a file that
another host wrote becoming visible to it. A signal would need no file, but the signals a
job can take are spoken for (USR2 is the stop notice, USR1 NCCL's, TERM, INT, HUP and QUIT
torchrun's) and one carries no steps or ranks.

A window never changes what is computed: a profiled run ends bitwise equal to an
unprofiled one (tests/distributed/test_profile.py).
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpcshard.config import profile_ranks
from hpcshard.rundir import profiles
from hpcshard.rundir.files import side_name, write_atomic
from hpcshard.runtime.device import DistEnv
from hpcshard.sections import ProfileSection

log = logging.getLogger("hpcshard")

POLL_S = 2.0
"""How often rank 0 looks for an ask (its own monotonic clock)."""
MEMORY_ENTRIES = 100_000
"""Allocation events a memory snapshot keeps (the newest)."""
NO_CUDA = "no CUDA device on this rank: a memory snapshot records CUDA's allocator"


class Events(Protocol):
    def event(self, name: str, **fields: Any) -> None: ...


@dataclass(frozen=True)
class Window:
    """Steps `first`..`first + steps - 1` recorded on `ranks` (None: all). `ask`: the ask's
    number (0: the schedule's)."""

    first: int
    steps: int
    ranks: tuple[int, ...] | None
    memory: bool
    ask: int = 0

    @property
    def last(self) -> int:
        return self.first + self.steps - 1


def scheduled(section: ProfileSection, step: int) -> Window | None:
    """The window the schedule starts after `step` (None: none)."""
    every = section.profile_every
    if not every or step <= 0 or step % every:
        return None
    return Window(first=step + 1, steps=section.profile_steps, ranks=profile_ranks(section.profile_ranks),
                  memory=section.profile_memory)


class Profiler:
    """One rank's profiles: asks agreed at boundaries, windows queued in the same order on
    every rank, recorded by the ranks they name.

    The trainer asks `starting`/`ending` before it calls `before`/`after` (the same answer
    on every rank: the queue is the same everywhere) and reports the `profile` phase to its
    launcher's watchdog first: stopping the profiler and writing a trace take seconds per
    recorded step on a GPU, and the ranks that do not record wait for those that do."""

    def __init__(self, section: ProfileSection, env: DistEnv, run_dir: Path | None, start: str = "") -> None:
        self.section, self.env, self.run_dir, self.start = section, env, run_dir, start
        self.queue: collections.deque[Window] = collections.deque()
        self.active: Window | None = None
        """The window being recorded (on every rank, recording or not: the queue stays the
        same everywhere)."""
        self.prof: torch.profiler.profile | None = None
        self.handled: set[int] = set()
        """The asks this process agreed on (queued or recorded)."""
        self.looked = float("-inf")
        self.found = 0
        """Rank 0: the oldest ask still to record that it found (0: none)."""
        self.wrote = False
        """A window ended at this step: the ranks' next wait (for the writers) is not
        communication (`Trainer._comm`)."""
        self.told: set[int] = set()
        """Ranks a scheduled window named that the run does not have (said once)."""

    # -- at the boundary -------------------------------------------------------------------

    def asked(self) -> float:
        """Rank 0's contribution to the boundary's all-reduce: the number of an ask waiting,
        or 0 (every other rank, and rank 0 between looks)."""
        if not self.env.is_main or self.run_dir is None:
            return 0.0
        now = time.monotonic()
        if not self.found and now - self.looked >= POLL_S:
            self.looked = now
            try:
                ask = profiles.pending(self.run_dir, skip=self.handled, start=self.start)
            except OSError as err:  # storage trouble: no profile, never a crash
                log.debug("profile asks not read: %s", err)
                ask = None
            self.found = ask.id if ask else 0
        return float(self.found)

    def agree(self, agreed: int, step: int, ending: bool) -> None:
        """After the boundary's all-reduce (every rank, same arguments): queue the
        schedule's window and a newly asked one. `ending`: the loop ends at this boundary,
        so an ask is left for the run's next start."""
        if ending:
            return
        window = scheduled(self.section, step)
        if window is not None:
            self.queue.append(window)
        if not agreed or agreed in self.handled:
            return
        ask: list[Any] = [None]
        if self.env.is_main and self.run_dir is not None:
            ask[0] = profiles.read(self.run_dir, agreed)
        dist.broadcast_object_list(ask, src=0)  # (only when an ask is new: rare)
        self.handled.add(agreed)
        self.found = 0
        if ask[0] is None:  # rank 0 saw it, then could not read it: the next start may
            return
        got: profiles.Ask = ask[0]
        # (behind the windows queued or recording: the queue starts them in order, each
        # from the step it actually starts at)
        self.queue.append(Window(first=step + 1, steps=got.steps, ranks=got.ranks, memory=got.memory,
                                 ask=got.id))

    # -- around the steps ------------------------------------------------------------------

    def starting(self, step: int) -> bool:
        """A window starts before step `step` (1-based)."""
        return self.active is None and bool(self.queue) and self.queue[0].first <= step

    def ending(self, step: int) -> bool:
        """The window being recorded ends after step `step`."""
        return self.active is not None and step >= self.active.last

    def before(self, step: int) -> bool:
        """Before step `step`: start the window that begins here (True: one began)."""
        if not self.starting(step):
            return False
        window = self.queue.popleft()
        self.active = window = replace(window, first=step)  # (later than queued: behind another)
        world = self.env.world
        ranks = list(range(world)) if window.ranks is None else [r for r in window.ranks if r < world]
        dropped = [] if window.ranks is None else [r for r in window.ranks if r >= world]
        if self.env.is_main and dropped and (window.ask or not set(dropped) <= self.told):
            self.told.update(dropped)
            log.warning("profile of steps %d-%d: rank(s) %s not recorded: this start of the run has "
                        "%d ranks", window.first, window.last, ",".join(map(str, dropped)), world)
        if self.env.is_main and window.ask and self.run_dir is not None:
            try:
                profiles.take(self.run_dir, window.ask, step, ranks, dropped, self.start)
            except OSError as err:
                log.warning("profile ask %d taken but not marked (%s): a later start may record it "
                            "again", window.ask, err)
            log.info("profile asked: steps %d-%d on rank(s) %s%s", window.first, window.last,
                     ",".join(map(str, ranks)) or "none", " with a memory snapshot" if window.memory else "")
        if self.env.rank in ranks and self.run_dir is not None:
            self._start(window)
        return True

    def after(self, step: int, metrics: Events) -> bool:
        """After step `step`: end the window that ends here (True: one ended, its files
        written)."""
        if not self.ending(step):
            return False
        self._finish(metrics, partial=False)
        return True

    def rewound(self, metrics: Events) -> None:
        """Training went back (a rollback after a non-finite step): a window being recorded
        ends here, cut short, and the schedule's queued windows go (the boundaries trained
        again queue them again); asked ones stay queued."""
        if self.active is not None:
            self._finish(metrics, partial=True)
        self.queue = collections.deque(w for w in self.queue if w.ask)

    def close(self, metrics: Events) -> None:
        """The loop ended: a window cut short is written with what it has. Asks still queued
        were never marked taken: the run's next start records them."""
        if self.active is not None:
            self._finish(metrics, partial=True)

    def _start(self, window: Window) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if window.memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True,
                                           profile_memory=window.memory, with_flops=True)
        self.prof.start()

    def _finish(self, metrics: Events, partial: bool) -> None:
        window, prof = self.active, self.prof
        assert window is not None
        self.active, self.prof, self.wrote = None, None, True
        if prof is None:  # this rank does not record the window
            return
        prof.stop()
        assert self.run_dir is not None
        rank, cuda = self.env.rank, self.env.device.type == "cuda"
        folder = profiles.window_dir(self.run_dir, window.first)
        written: dict[str, Any] = {"step": window.first, "steps": window.steps, "rank": rank,
                                   "ask": window.ask, "partial": partial}
        began = time.perf_counter()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            trace = profiles.trace_path(folder, rank)
            aside = side_name(trace)
            prof.export_chrome_trace(str(aside))
            if not aside.is_file() or not aside.stat().st_size:  # (the profiler says nothing)
                aside.unlink(missing_ok=True)
                raise OSError(errno.ENOSPC, "the profiler could not write the trace (disk full or over "
                              "quota?)")
            os.replace(aside, trace)
            written["trace"] = str(trace)
            if window.memory and cuda:
                snapshot = profiles.memory_path(folder, rank)
                torch.cuda.memory._dump_snapshot(str(snapshot))
                written["memory"] = str(snapshot)
            elif window.memory:
                written["memory"] = NO_CUDA
        except OSError as err:  # a full disk loses the profile, never the training
            written["error"] = str(err)
            log.warning("profile of steps %d-%d not written on rank %d: %s", window.first, window.last,
                        rank, err)
        finally:
            if window.memory and cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
        written["write_s"] = round(time.perf_counter() - began, 3)
        try:
            write_atomic(profiles.done_path(folder, rank), json.dumps(written))
        except OSError as err:
            log.warning("profile of steps %d-%d: its record not written (%s)", window.first, window.last,
                        err)
        if "trace" in written:
            log.info("profile of steps %d-%d written to %s%s", window.first, window.last, written["trace"],
                     f"; memory: {written['memory']}" if "memory" in written else "")
        if self.env.is_main:
            metrics.event("profile", **{k: v for k, v in written.items() if k != "write_s"})

    # -- out of memory ---------------------------------------------------------------------

    def oom(self, step: int) -> None:
        """A CUDA OOM in step `step`: leave the allocator's snapshot (with the allocation
        history when a memory window records it) and one line that points to it."""
        if self.env.device.type != "cuda" or self.run_dir is None:
            return
        path = profiles.oom_path(self.run_dir, self.env.rank, step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except (OSError, RuntimeError) as err:
            log.error("out of GPU memory at step %d on rank %d; no snapshot (%s)", step, self.env.rank, err)
            return
        log.error("out of GPU memory at step %d on rank %d; the allocator's snapshot: %s "
                  "(open it at https://pytorch.org/memory_viz)", step, self.env.rank, path)
