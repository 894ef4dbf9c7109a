"""Where a step's time goes: the loop marks the end of each phase, and every metrics record
carries the mean seconds per step of each (`split_s`) beside the step's wall time (`step_s`).

A mark says "the time since the previous mark was spent in this phase". The window a
record covers is the host's wall time between its marks (perf_counter), less what
`skip` leaves out (evaluation, writing the record), over the steps trained in it: what
tokens_per_s is computed from. The split comes from the same marks:

- on CPU, from the host's clock, so the parts add up to the window exactly;
- on CUDA, from `torch.cuda.Event(enable_timing=True)` recorded on the current stream at
  each mark, so a phase is the device's time from one mark to the next in stream order
  (a forward the host queued in 2 ms and the GPU ran in 40 ms is 40 ms of forward). The
  events are read without waiting (`query`) as they complete, and at the logging step
  (which has already waited for the device, for the loss) with one `synchronize` of the
  newest event: no host sync is added per step. Events are reused from a pool, so their
  number stays that of the marks in flight, whatever log_every is. This branch is chosen
  from the rank's device (`DistEnv.device`); CI has no GPU to run it.
"""

from __future__ import annotations

import collections
import time

import torch

from hpcshard.rundir.metrics import SPLIT

NAMED = SPLIT[:-1]
"""The parts of the split a record names; "other" is the remainder, step_s less these.
A mark may name "other" too (the loop's own work between phases): on CPU the remainder
is exactly that, on CUDA it also holds what the device and host clocks disagree on."""
IN_FLIGHT = 1024
"""Events waiting to complete before the oldest is waited for. The loop waits for the
device at every step boundary (the agreement's flags), so this is never reached there."""


class StepClock:
    """The marks of one rank's training loop (see the module's text)."""

    def __init__(self, device: torch.device) -> None:
        self.sums = dict.fromkeys(SPLIT, 0.0)
        """Seconds per phase since the last `take`."""
        self.window = 0.0
        """Host seconds since the last `take`, less what was skipped."""
        self.last = time.perf_counter()
        self.events = _Events(device) if device.type == "cuda" else None

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in `phase`."""
        now = time.perf_counter()
        self.window += now - self.last
        if self.events is None:
            self.sums[phase] += now - self.last
        else:
            self.events.mark(phase, self.sums)
        self.last = now

    def restart(self) -> None:
        """Drop everything counted so far and begin a window here (the loop's start)."""
        self.take(1)
        self.skip()

    def skip(self) -> None:
        """The time since the previous mark is not training (an evaluation, writing the
        record): neither the window's nor any phase's."""
        self.last = time.perf_counter()
        if self.events is not None:
            self.events.mark(None, self.sums)

    def take(self, steps: int) -> tuple[float, dict[str, float]]:
        """`step_s` and `split_s` over the `steps` trained since the last take (means per
        step), then start counting again. "other" is step_s less the named parts."""
        if self.events is not None:
            self.events.drain(self.sums)
        steps = max(1, steps)
        step_s = self.window / steps
        split = {k: self.sums[k] / steps for k in NAMED}
        split["other"] = step_s - sum(split.values())
        self.sums, self.window = dict.fromkeys(SPLIT, 0.0), 0.0
        return step_s, split


class _Events:
    """CUDA events at the marks, in stream order: each interval is its end mark's phase
    (None: skipped). Folded into the sums once complete; then the interval's start event
    goes back to the pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: list[torch.cuda.Event] = []
        self.pending: collections.deque[tuple[str | None, torch.cuda.Event]] = collections.deque()
        self.base: torch.cuda.Event | None = None
        """The newest folded (complete) event: where the next interval starts."""

    def mark(self, phase: str | None, sums: dict[str, float]) -> None:
        event = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self.pending.append((phase, event))
        if len(self.pending) > IN_FLIGHT:  # never in the loop (see IN_FLIGHT)
            self.pending[0][1].synchronize()
        self._fold(sums)

    def drain(self, sums: dict[str, float]) -> None:
        """Fold every pending interval: one wait, for the newest event (at a logging step
        the device has just been waited for, so it is done or nearly)."""
        if self.pending:
            self.pending[-1][1].synchronize()
        self._fold(sums)

    def _fold(self, sums: dict[str, float]) -> None:
        while self.pending and self.pending[0][1].query():  # query() does not wait
            phase, event = self.pending.popleft()
            if self.base is not None:
                if phase is not None:
                    sums[phase] += self.base.elapsed_time(event) / 1e3  # (milliseconds)
                self.pool.append(self.base)
            self.base = event
