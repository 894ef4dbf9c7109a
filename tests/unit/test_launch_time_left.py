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
