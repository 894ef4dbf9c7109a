"""Stop requests: a signal on any rank becomes a decision every rank takes together.

The handler only sets a flag (signal handlers must not run collectives). At each step
boundary the ranks all-reduce the flag, so a notice delivered to one rank, or to some
nodes only, stops all of them at the same step.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

from hpcshard.config import signal_names
from hpcshard.rundir.proc import clock

log = logging.getLogger("hpcshard")


class StopRequest:
    def __init__(self, names: str) -> None:
        self.signals = [getattr(signal, n) for n in signal_names(names)]
        self.received: str | None = None
        self.at = 0.0
        """When the first one came, on this host's boot clock (`rundir.proc.clock`): what a
        time-limit stop is planned from (`train.stop_time`), never the wall clock."""

    def install(self, early: list[int] | tuple[int, ...] = (), at: float | None = None) -> StopRequest:
        """Take the signals from now on; `early`: ones that came before (a notice while
        torch was still loading, which the entry point kept), the first of them `at` (boot
        clock; None: now)."""
        for signum in early:  # (first: a notice now must not count as the first)
            if signum in self.signals and self.received is None:
                self._handle(signum, None)
                self.at = self.at if at is None else min(at, self.at)
        for sig in self.signals:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.at = signal.Signals(signum).name, clock()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def ignore_from_now(self) -> None:
        """The work is over: a late notice means nothing now. Ignore it rather than keep a
        Python handler, because CPython resets those to the default action (terminate)
        while the interpreter shuts down, and a notice in that window kills the rank."""
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
