"""What is left of a job's time limit, as a duration (`slurm.cluster.time_left`: TimeLimit
less RunTime), and the deadline a launcher counts from it on its host's boot clock
(`launch.slurm.limit_ends`): never a time of day compared with the host's wall clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcshard.launch import slurm
from hpcshard.slurm import client, cluster

FIELDS = "JobId=77 JobState=RUNNING Restarts=0 NodeList=n1 EndTime=2026-01-01T10:10:00"


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake scontrol, first on PATH, that prints what the test writes to its file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    said = tmp_path / "said"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\ncat {said}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(client, "BACKOFF_S", 0.01)
    return said


@pytest.mark.parametrize("fields, left", [
    ("RunTime=00:01:00 TimeLimit=00:03:00", 120.0),
    ("RunTime=00:00:00 TimeLimit=1-00:00:00", 86400.0),  # (a RunTime of 0 is no "no limit")
    ("RunTime=1-02:00:00 TimeLimit=2-00:00:00", 79200.0),
    ("RunTime=00:03:20 TimeLimit=00:03:00", 0.0),  # past its limit (OverTimeLimit): nothing left
    # Asked on a node whose clock is 30 s behind, 10 s into the job: scontrol's RunTime (its
    # clock less the controller's StartTime) is -20 s, which Slurm's secs2time_str prints so.
    # The whole limit: 10 s too much, which the notice bounds.
    ("RunTime=INVALID TimeLimit=00:03:00", 180.0),
    ("RunTime=00:01:00 TimeLimit=UNLIMITED", None),
    ("RunTime=00:01:00 TimeLimit=Partition_Limit", None),
    ("RunTime=00:01:00", None),  # not said
])
def test_time_left_is_the_limit_less_the_run_time(scontrol: Path, fields: str, left: float | None) -> None:
    scontrol.write_text(f"{FIELDS} {fields}\n")
    assert cluster.time_left("77") == left


def test_no_answer_is_no_time_left(scontrol: Path) -> None:
    scontrol.write_text("")  # (scontrol printed nothing: no job fields)
    assert cluster.time_left("77") is None


def test_the_deadline_counts_from_when_slurm_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked at boot-clock 1000, scontrol took 20 s to say 600 s were left: its RunTime was
    read somewhere in those 20 s, so the deadline is counted from the moment it was asked
    (earlier, never later, than the truth)."""
    now = [1000.0]

    def answer(job: str) -> float:
        now[0] += 20
        return 600.0

    monkeypatch.setattr(slurm, "clock", lambda: now[0])
    monkeypatch.setattr(cluster, "time_left", answer)
    assert slurm.limit_ends("77") == 1600.0
    monkeypatch.setattr(cluster, "time_left", lambda job: None)
    assert slurm.limit_ends("77") is None


@pytest.mark.parametrize("noticed, left", [
    (None, 130.0),    # no notice yet: what the launcher was told, all it knows
    (1472.0, 92.0),   # the time limit's notice (8 s early): the notice plus the lead bounds it
    (1000.0, 130.0),  # a notice 10 minutes before the deadline: a preemption's, nothing of the limit
])
def test_an_own_loops_time_left_is_bounded_by_the_notice(monkeypatch: pytest.MonkeyPatch,
                                                         noticed: float | None, left: float) -> None:
    """A loop of the user's own plans its stop with `preemption.time_left()`. On a node whose
    clock is 30 s behind the controller's, the launcher's deadline (scontrol's RunTime is
    worked out on that clock) is 30 s late: boot-clock 1630 for a limit that ends at 1600.
    The notice (lead 120 s) came at 1472; at 1500 the truth is 100 s left, and what the
    loop hears must not be more than the notice plus its lead says (92 s): hpcshard's own
    loop plans so (`train.limit_end`), and an own loop that read 130 s saved across the
    limit and ended TIMEOUT, never requeued."""
    from hpcshard import preemption
    from hpcshard.rundir import rankenv

    monkeypatch.setattr(preemption, "clock", lambda: 1500.0)
    monkeypatch.setattr(preemption, "_received", [] if noticed is None else [noticed])
    monkeypatch.setenv("HPCSHARD_DEADLINE_BOOT", f"1630.000 {rankenv.boot_id()}")
    monkeypatch.setenv("HPCSHARD_NOTICE_LEAD", "120")
    assert preemption.time_left() == pytest.approx(left)
