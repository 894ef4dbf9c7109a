"""When a stop notice takes effect: at once for a preemption, near the deadline for the
time limit's own notice (`runtime.train.stop_time`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcshard.runtime.train import NOTICE_SLACK_S, STOP_MARGIN_S, stop_time

NOW = 1_000_000.0


def test_the_time_limits_notice_trains_on_until_the_save_fits_before_the_deadline() -> None:
    # The notice came 120 s before the deadline (the lead): saves took up to 4 s, steps 0.5 s.
    at = stop_time(NOW, deadline=NOW + 120, lead=120, saves=[3.0, 4.0, 2.0], steps=[0.5, 0.4, 0.6])
    assert at == pytest.approx(NOW + 120 - (2 * 4.0 + 2 * 0.5 + STOP_MARGIN_S))


def test_slurm_sending_the_notice_early_is_still_the_time_limit() -> None:
    early = NOW + 120 + NOTICE_SLACK_S - 1
    assert stop_time(NOW, deadline=early, lead=120, saves=[1.0], steps=[0.1]) > NOW


@pytest.mark.parametrize("deadline, lead, saves", [
    (NOW + 3600, 120, [1.0]),   # far from the deadline: a preemption, the job dies soon
    (None, 120, [1.0]),         # no time limit known
    (NOW + 120, None, [1.0]),   # no lead known
    (NOW + 120, 120, []),       # no save measured yet: nothing to plan with
    (NOW + 15, 120, [10.0]),    # too late to train on: the save itself barely fits
])
def test_every_other_notice_stops_at_once(deadline: float | None, lead: int | None,
                                          saves: list[float]) -> None:
    assert stop_time(NOW, deadline=deadline, lead=lead, saves=saves, steps=[0.5]) == NOW


def test_a_slower_save_after_the_notice_brings_the_stop_forward_and_nothing_moves_it_later() -> None:
    """Planned at the first boundary after the notice from 1 s saves, the stop left room for
    2 s of saving; a save after the notice that took 10 s must count, or the stop's own save
    crosses the deadline (TIMEOUT, never requeued)."""
    deadline, steps = NOW + 120, [0.5]
    first = stop_time(NOW, deadline=deadline, lead=120, saves=[1.0], steps=steps)
    slower = stop_time(NOW, deadline=deadline, lead=120, saves=[1.0, 10.0], steps=steps, before=first)
    assert slower == pytest.approx(deadline - (2 * 10.0 + 2 * 0.5 + STOP_MARGIN_S))
    assert slower < first
    # Faster saves or steps later on never push a planned stop towards the deadline.
    assert stop_time(NOW, deadline=deadline, lead=120, saves=[1.0, 10.0, 0.1, 0.1, 0.1], steps=[0.01],
                     before=slower) == slower


LEAD, SAVE, STEP = 120, 4.0, 0.5
NEEDS = 2 * SAVE + 2 * STEP + STOP_MARGIN_S
"""What a time-limit stop keeps before the limit: the save twice over, two steps, the margin."""


@pytest.mark.parametrize("behind, early", [
    (0, 0),      # clocks agree, the notice on time: no second of the allocation wasted
    (0, 8),      # Slurm sent it 8 s early (as measured on the local cluster)
    (0, 45),
    (30, 0),     # the node's clock 30 s behind the controller's
    (30, 8),
    (45, 0),
    (60, 0),
    (50, 15),    # more than the slack in all: taken for a preemption, it stops at once
    (-30, 8),    # ahead
    (-60, 0),
])
def test_a_node_whose_clock_is_off_still_stops_before_the_limit(behind: float, early: float) -> None:
    """The controller ends the job at END (true time: the host's boot clock counts the same
    seconds, only its wall clock is off). Its notice comes LEAD s before END, or `early`
    s sooner. The launcher's deadline is the controller's time left, TimeLimit less a
    RunTime that scontrol works out on the node's own wall clock: `behind` s behind, it
    says that much too much is left. The stop must leave the save (twice), two steps and
    the margin before END all the same: a save that crosses it ends the job TIMEOUT, never
    requeued."""
    end = NOW + 1000
    noticed = end - LEAD - early
    at = stop_time(noticed, deadline=end + behind, lead=LEAD, saves=[SAVE], steps=[STEP])
    assert noticed <= at <= end - NEEDS
    if behind <= 0 and early == 0:
        assert at == pytest.approx(end - NEEDS + min(behind, 0))  # (no later than a correct clock)
    if behind + early <= NOTICE_SLACK_S:
        assert at > noticed  # the time limit's notice: it trains on


WARM_RANK = """
import os, signal, sys, types
from hpcshard import entry
from hpcshard.runtime.stop import StopRequest

def runtime_main(argv, early=None, start=None, early_at=None):
    # The rank is past its imports (warm: the zygote's) and in its rendezvous, or building
    # the job, when the notice comes; the runtime takes the signals over only after that.
    os.kill(os.getpid(), signal.SIGUSR2)
    stop = StopRequest("USR2").install(early, early_at)  # (as runtime.main passes them on)
    print(stop.received, stop.at == entry.EARLY_AT[0], flush=True)
    return 0

sys.modules["hpcshard.runtime.main"] = types.SimpleNamespace(main=runtime_main)
entry.rank(sys.argv[1])
"""


def test_a_notice_during_a_warm_ranks_start_keeps_its_arrival_time(tmp_path: Path) -> None:
    """A warm rank (forked by the zygote, torch already loaded) spends its start in the
    rendezvous and the job's build, before the runtime installs its handlers; a notice then
    is the entry point's (EARLY, EARLY_AT). Its time is what the time-limit stop is planned
    from (the notice plus the lead: `train.limit_end`), so it must be the time it came, not
    the moment the runtime took it over: the entry point passed the first arrival as it
    stood when the runtime was called, none for a warm rank, whose import is instant."""
    env = {**os.environ, "HPCSHARD_STOP_SIGNAL": "USR2"}
    proc = subprocess.run([sys.executable, "-c", WARM_RANK, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SIGUSR2", "True"], proc.stdout + proc.stderr
