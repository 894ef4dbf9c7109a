"""The step clock (runtime.timing): what each mark, skip and take makes of the time between
them, on the host's clock (CPU) and from CUDA events (faked: no GPU here), whose number
stays bounded however long between records."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from hpcshard.rundir.metrics import SPLIT, split_text
from hpcshard.runtime import timing
from hpcshard.runtime.timing import StepClock

CPU = torch.device("cpu")


def clock_at(monkeypatch: pytest.MonkeyPatch, times: list[float], device: torch.device = CPU) -> StepClock:
    """A clock whose perf_counter returns `times` in turn (the first: its construction)."""
    ticks = iter(times)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    return StepClock(device)


# (what the loop does at which time, steps, step_s, seconds per part in all); the clock starts at 0
CASES = [
    ("one step", [("data", 1), ("forward", 3), ("backward", 7), ("checkpoint", 7), ("optimizer", 8),
                  ("comm", 10)],
     1, 10.0, {"data": 1, "forward": 2, "backward": 4, "optimizer": 1, "comm": 2}),
    ("two steps, means", [("other", 1), ("data", 2), ("forward", 4), ("backward", 8), ("optimizer", 10),
                          ("other", 11), ("data", 12), ("forward", 14), ("backward", 18), ("optimizer", 20)],
     2, 10.0, {"other": 2, "data": 2, "forward": 4, "backward": 8, "optimizer": 4}),
    ("evaluation skipped", [("forward", 2), ("backward", 4), ("skip", 104), ("comm", 105)],
     1, 5.0, {"forward": 2, "backward": 2, "comm": 1}),
    ("accumulation adds", [("data", 1), ("forward", 2), ("backward", 4), ("forward", 5), ("backward", 7),
                           ("optimizer", 8)],
     1, 8.0, {"data": 1, "forward": 2, "backward": 4, "optimizer": 1}),
    ("a save at the boundary", [("comm", 1), ("checkpoint", 31), ("data", 32), ("forward", 33),
                                ("backward", 35), ("optimizer", 36)],
     1, 36.0, {"comm": 1, "checkpoint": 30, "data": 1, "forward": 1, "backward": 2, "optimizer": 1}),
]


@pytest.mark.parametrize("marks,steps,step_s,parts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_marks_split_the_window_and_the_parts_add_up(monkeypatch: pytest.MonkeyPatch,
                                                     marks: list[tuple[str, float]], steps: int,
                                                     step_s: float, parts: dict[str, float]) -> None:
    clock = clock_at(monkeypatch, [0.0] + [float(t) for _, t in marks])
    for phase, _ in marks:
        clock.skip() if phase == "skip" else clock.mark(phase)
    got_step, split = clock.take(steps)
    assert got_step == step_s
    assert list(split) == list(SPLIT)
    assert split == {k: pytest.approx(parts.get(k, 0.0) / steps) for k in SPLIT}
    assert sum(split.values()) == pytest.approx(step_s)  # on CPU "other" is what was marked so


def test_take_starts_a_new_window_and_restart_drops_what_came_before(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = clock_at(monkeypatch, [0.0, 5.0, 6.0, 7.0, 10.0])
    clock.mark("forward")  # 0 -> 5
    clock.restart()  # the loop begins here (6): the 5 s before and the 1 s to it are dropped
    clock.mark("backward")  # 6 -> 7
    assert clock.take(1) == (1.0, {**dict.fromkeys(SPLIT, 0.0), "backward": 1.0})
    clock.mark("data")  # 7 -> 10 (take reads no clock)
    assert clock.take(3) == (1.0, {**dict.fromkeys(SPLIT, 0.0), "data": 1.0})


class FakeEvent:
    """torch.cuda.Event's interface on a fake device: events complete in the order they
    were recorded (one stream), as far as `FakeEvent.reached` (a count of recorded
    events), each at the device time it was recorded with."""

    made = recorded = reached = waits = 0
    device_time = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        FakeEvent.made += 1
        self.at, self.seq = 0.0, 0

    def record(self, stream: Any = None) -> None:
        FakeEvent.recorded += 1
        self.at, self.seq = FakeEvent.device_time, FakeEvent.recorded

    def query(self) -> bool:
        return self.seq <= FakeEvent.reached

    def synchronize(self) -> None:
        FakeEvent.waits += 1
        FakeEvent.reached = max(FakeEvent.reached, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query()
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


@pytest.fixture
def cuda_events(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    FakeEvent.made = FakeEvent.recorded = FakeEvent.reached = FakeEvent.waits = 0
    FakeEvent.device_time = 0.0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return FakeEvent


def test_on_cuda_the_split_is_the_devices_time_and_read_without_waiting(
        monkeypatch: pytest.MonkeyPatch, cuda_events: type[FakeEvent]) -> None:
    """The host queues a step in 1 ms; the device runs its forward in 3 s and backward in
    6 s: the split is the device's. Only take waits, once, for the newest event."""
    host = itertools.count()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(host)) * 1e-3)
    clock = StepClock(torch.device("cuda", 0))
    assert clock.events is not None
    for phase, device_time in [(None, 0.0), ("data", 1.0), ("forward", 4.0), ("backward", 10.0),
                               ("optimizer", 11.0)]:
        cuda_events.device_time = device_time
        clock.skip() if phase is None else clock.mark(phase)
    assert len(clock.events.pending) == 5 and cuda_events.waits == 0  # nothing complete yet
    cuda_events.reached = 2  # the device got as far as the data mark
    cuda_events.device_time = 12.0
    clock.mark("comm")
    assert len(clock.events.pending) == 4 and clock.sums["data"] == 1.0 and cuda_events.waits == 0
    step_s, split = clock.take(1)
    assert cuda_events.waits == 1 and not clock.events.pending
    assert step_s == pytest.approx(5e-3)  # the host's wall time
    assert split == {"data": 1.0, "forward": 3.0, "backward": 6.0, "optimizer": 1.0, "checkpoint": 0.0,
                     "comm": 1.0, "other": pytest.approx(5e-3 - 12.0)}  # (the host ran ahead)


def test_cuda_events_are_reused_however_long_between_records(
        monkeypatch: pytest.MonkeyPatch, cuda_events: type[FakeEvent]) -> None:
    """Each step's events complete by the next (the boundary waits for the device): 10,000
    steps of 8 marks with one take at the end make a handful of events, not 80,000."""
    clock = StepClock(torch.device("cuda", 0))
    assert clock.events is not None
    clock.skip()
    for _ in range(10_000):
        for phase in ("other", "data", "forward", "backward", "checkpoint", "optimizer", "comm",
                      "checkpoint"):
            cuda_events.device_time += 1e-3
            clock.mark(phase)
        cuda_events.reached = cuda_events.recorded  # the boundary's sync: the device caught up
    assert cuda_events.made <= 10
    step_s, split = clock.take(10_000)
    assert split["forward"] == pytest.approx(1e-3) and split["checkpoint"] == pytest.approx(2e-3)


def test_events_the_device_never_completes_are_waited_for_beyond_a_bound(
        monkeypatch: pytest.MonkeyPatch, cuda_events: type[FakeEvent]) -> None:
    clock = StepClock(torch.device("cuda", 0))
    assert clock.events is not None
    for _ in range(3 * timing.IN_FLIGHT):
        clock.mark("forward")
    assert len(clock.events.pending) <= timing.IN_FLIGHT + 1
    assert cuda_events.made <= timing.IN_FLIGHT + 3


@pytest.mark.parametrize("record,text", [
    ({"step_s": 0.412, "split_s": {"data": 0.000412, "forward": 0.1277, "backward": 0.2266,
                                   "optimizer": 0.0371, "checkpoint": 0.0, "comm": 0.0082, "other": 0.0124}},
     "step time 0.412 s: data 0.1%, forward 31%, backward 55%, optimizer 9%, checkpoint 0%, comm 2%, "
     "other 3%"),
    ({"step_s": 0.5, "loss": 2.0}, ""),  # a record written before the split was
    ({"loss": 2.0}, ""),
])
def test_the_split_as_status_shows_it(record: dict[str, Any], text: str) -> None:
    assert split_text(record) == text
