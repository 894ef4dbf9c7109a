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

    def install(self, early: list[int] | tuple[int, ...] = (),
                at: list[float] | tuple[float, ...] = ()) -> StopRequest:
        """Take the signals from now on; `early`: ones that came before, while the rank
        started (a notice during torch's import, the rendezvous, the job's build), `at`:
        when each came (boot clock). The entry point's own lists, read only once this
        process's handlers are in: a notice that comes meanwhile is in them, and one that
        comes later is the handler's, after the early one (which stays the first)."""
        for sig in self.signals:
            signal.signal(sig, self._handle)
        first = next((signum for signum in early if signum in self.signals), None)
        if first is not None:
            self.received, self.at = signal.Signals(first).name, min([*at, self.at or clock()])
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
