"""Hang detection from a node's progress board: a rank that overruns its phase is hung.

The step limit is learned, not configured: a multiple of the median time between step
starts seen on this node in this cycle, with a floor (`watchdog_factor`,
`watchdog_floor_s`). The first `watchdog_warmup_steps` steps of a cycle (a cold start, a
`torch.compile` warm-up) and every other phase (setup, load, save, eval) get the outer
limit `watchdog_phase_s` instead: a slow save or a long evaluation is never taken for a
hang. Joining the process group has its own, `watchdog_join_s`: every rank has started by
then, and a rank stuck connecting to the store (seen: rarely, after a hard requeue) would
wait for torch's 30 minutes. A rank stopped by a signal, or still running while its peers
wait in a collective, is named as the culprit.

Every time here is on the host's boot clock (`rundir.proc.clock`), as the board's are: a
step of the wall clock (NTP, an admin's `date`) is neither a hang nor hides one.

A rank that is ready to run but gets no CPU (a host whose cores are oversubscribed: data
loader workers, a co-located process, a CI machine running three tests' ranks on two
cores) is starved, not hung. The time its main thread waited in the kernel's run queue
since the watchdog first saw its phase (`rundir.proc.runqueue_wait`) is not counted
against its limit, nor against the limit of the ranks of this node in the same step (they
wait for it in a collective, asleep), nor of those a step ahead. A rank stuck in a
collective waits for no CPU and is found at its limit, later only by what a rank of its
node at its step waited; one spinning in the job's code on oversubscribed cores waits as a
starved one does, so every rank is declared at STARVED_CAP times its limit at the latest
(and a phase's outer limit is never stretched). Not seen: the wait of a rank's other
threads (torch's intra-op pool, where OMP_NUM_THREADS > 1), and a starved rank's peers on
other nodes, whose launchers see them asleep in a collective and declare them at their
limit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcshard.rundir.proc import clock, runqueue_wait, started, stat_fields
from hpcshard.rundir.progress import Slot
from hpcshard.sections import SupervisionSection

__all__ = ["Limits", "Watchdog", "process_state", "stat_fields", "started"]

STARVED_CAP = 4.0
"""However long a rank waited for a CPU, it is declared at this many times its limit (20 s
at the 5 s floor), and never after `phase_s`: a spinning rank on oversubscribed cores is
found by then."""


WATCHDOG_KEYS = ("watchdog_factor", "watchdog_floor_s", "watchdog_warmup_steps", "watchdog_phase_s",
                 "watchdog_join_s")
"""The supervision section's keys the launcher's watchdog reads (`Limits.of`)."""


@dataclass(frozen=True)
class Limits:
    factor: float = 3.0
    floor_s: float = 5.0
    warmup_steps: int = 3
    phase_s: float = 1800.0
    join_s: float = 120.0

    @classmethod
    def of(cls, section: SupervisionSection) -> Limits:
        return cls(factor=section.watchdog_factor, floor_s=section.watchdog_floor_s,
                   warmup_steps=section.watchdog_warmup_steps, phase_s=section.watchdog_phase_s,
                   join_s=section.watchdog_join_s)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Limits:
        """The limits a run's resolved config (spec.json's, flat) asks for, read as its typed
        supervision section: TrainConfig's defaults where it says nothing (a run resolved
        before a key existed, a script's run)."""
        # Its own keys only: another supervision key the launcher does not use, odd in a
        # hand-edited spec.json, never stops the launcher.
        own = {k: v for k, v in cfg.items() if k in WATCHDOG_KEYS}
        return cls.of(SupervisionSection.from_flat(own))


def process_state(pid: int) -> str:
    """R running, S sleeping (a rank waiting in a collective), T stopped, ... ("" if gone)."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


class Watchdog:
    """One cycle's view of a node's ranks: what a step takes, and who overran."""

    def __init__(self, limits: Limits, poll_s: float = 0.0,
                 waited: Callable[[int], float] = runqueue_wait) -> None:
        self.limits = limits
        self.poll_s = poll_s
        """How often `look` is called: a rank that would overrun its limit before the next
        look is declared at this one, so a hang is declared by its limit at the latest."""
        self.waited = waited
        """Seconds a pid has waited for a CPU so far (`rundir.proc.runqueue_wait`)."""
        self.queued: dict[int, tuple[int, float, float]] = {}
        """Per rank: its pid, the start of the phase it is in, and its run-queue wait when
        that phase was first seen."""
        self.seen: dict[int, Slot] = {}
        self.samples: list[float] = []
        self.steps: set[int] = set()
        """Steps this cycle has seen end (the warm-up counts steps, not ranks)."""

    def median(self) -> float:
        """The median step of the last 50 seen (0 before any)."""
        return statistics.median(self.samples[-50:]) if self.samples else 0.0

    def step_limit(self) -> float | None:
        """The learned limit of a step, None before warm-up."""
        if len(self.steps) < self.limits.warmup_steps:
            return None
        return max(self.limits.floor_s, self.limits.factor * self.median())

    def look(self, slots: list[Slot], now: float | None = None) -> dict[str, Any] | None:
        """Learn from the board; a hang record when a rank overran its phase, else None.
        `now` (default: now) is on the clock of the slots' `since`, `rundir.proc.clock`."""
        now = clock() if now is None else now
        for s in slots:
            before = self.seen.get(s.rank)
            if before is not None and before.phase == s.phase == "step" and s.step > before.step:
                # Steps faster than the look: the time between the two starts, per step.
                done = s.step - before.step
                self.samples.append((s.since - before.since) / done)
                self.steps.update(range(before.step, s.step))
            self.seen[s.rank] = s
            if self.queued.get(s.rank, (0, 0.0, 0.0))[:2] != (s.pid, s.since):
                self.queued[s.rank] = (s.pid, s.since, self.waited(s.pid))
        steady = self.step_limit()
        late = []
        for s in slots:
            if s.phase in ("done", "idle"):
                continue
            limit = (steady if s.phase == "step" and steady is not None else
                     self.limits.join_s if s.phase == "join" else self.limits.phase_s)
            if now - s.since + self.poll_s > limit:
                late.append((s, limit))
        own, starved = self._starved(slots) if late else ({}, {})
        if not any(now - s.since - starved[s.rank] + self.poll_s > limit
                   or now - s.since + self.poll_s > min(STARVED_CAP * limit, max(limit, self.limits.phase_s))
                   for s, limit in late):
            return None
        # Once one is overdue, every rank past its limit is a suspect (a starved rank given
        # more credit than a peer that waits for it may not be overdue yet).
        overdue = late
        states = {s.rank: process_state(s.pid) for s, _ in overdue}
        # A stopped rank first, then one still busy while its peers sleep in a collective,
        # then the one furthest behind, then the one that waited least for a CPU.
        s, limit = min(overdue, key=lambda o: ({"T": 0, "t": 0, "R": 1, "D": 1}.get(states[o[0].rank], 2),
                                               o[0].step, own[o[0].rank], o[0].rank))
        waited = f"; {starved[s.rank]:.1f} s of it a wait for a CPU" if starved[s.rank] >= 0.1 else ""
        return {"cause": f"rank {s.rank} made no progress in phase {s.phase} for "
                         f"{now - s.since:.1f} s (limit {limit:.1f} s{waited})",
                "rank": s.rank, "step": s.step, "phase": s.phase, "pid": s.pid,
                "state": states[s.rank], "limit": limit, "silent_s": round(now - s.since, 2),
                "starved_s": round(starved[s.rank], 2),
                "suspects": [{"rank": o.rank, "state": states[o.rank], "step": o.step}
                             for o, _ in overdue]}

    def _starved(self, slots: list[Slot]) -> tuple[dict[int, float], dict[int, float]]:
        """Per rank: how long it waited for a CPU since the watchdog first saw its phase, and
        its credit: the longest such wait of any rank of this board at its step or an
        earlier one (a rank waits in a collective for those behind it: one that left a
        step's last collective and started the next waits for one starved before that)."""
        own = {}
        for s in slots:
            base = self.queued[s.rank][2]  # (for this pid and phase: set by this look)
            own[s.rank] = max(0.0, self.waited(s.pid) - base)
        active = [t for t in slots if t.phase not in ("done", "idle")]
        return own, {s.rank: max([own[s.rank], *(own[t.rank] for t in active if t.step <= s.step)])
                     for s in slots}
