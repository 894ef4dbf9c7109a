"""One owner per run directory (rundir.lease): who may take a run, and what a command
that finds it owned says."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.rundir import lease
from hpcshard.rundir.spec import RunSpec

pytestmark = pytest.mark.unit


def never(job: str) -> bool | None:
    raise AssertionError(f"Slurm was asked about job {job}")


def test_a_live_process_keeps_the_run_and_a_dead_one_whose_pid_was_reused_does_not(tmp_path: Path) -> None:
    mine = lease.take(tmp_path, lease.Owner.of_process("hpcshard submit"), never)
    assert mine.epoch == 1 and lease.owns(tmp_path, mine.token)
    with pytest.raises(lease.Busy, match="hpcshard submit .* still owns it"):
        lease.take(tmp_path, lease.Owner.of_job("5"), never)
    # The owner died and its pid is now another process (this one, started at another time).
    assert mine.process is not None
    ghost = replace(mine.process, pid=os.getpid(), start=1)
    lease.path(tmp_path).write_text(lease.Owner(kind="process", process=ghost, epoch=4).to_json())
    job = lease.take(tmp_path, lease.Owner.of_job("5"), lambda j: False)
    assert (job.job, job.epoch) == ("5", 5)
    assert not lease.owns(tmp_path, mine.token)


@pytest.mark.parametrize("alive,taken,said", [
    (True, False, "Slurm job 7 still owns it"),
    (None, False, "Slurm did not answer whether job 7"),  # never taken for "over"
    (False, True, ""),
])
def test_a_job_owner_is_judged_by_slurm_and_no_answer_is_not_over(tmp_path: Path, alive: bool | None,
                                                                 taken: bool, said: str) -> None:
    lease.take(tmp_path, lease.Owner.of_job("7"), never)
    if taken:
        assert lease.take(tmp_path, lease.Owner.of_process("hpcshard resume"), lambda j: alive).epoch == 2
    else:
        with pytest.raises(lease.Busy, match=said):
            lease.take(tmp_path, lease.Owner.of_process("hpcshard resume"), lambda j: alive)
        assert lease.read(tmp_path).job == "7"  # type: ignore[union-attr]


def test_the_same_job_taking_again_keeps_its_epoch(tmp_path: Path) -> None:
    """Every launcher of a job (and a requeue of it) takes the run: one lease, one epoch."""
    first = lease.take(tmp_path, lease.Owner.of_job("7"), never)
    assert lease.take(tmp_path, lease.Owner.of_job("7"), never) == first


def test_a_process_on_another_host_is_judged_by_its_beat_on_the_readers_clock(tmp_path: Path) -> None:
    other = lease.Process(host="login2", pid=1, start=1, boot="x")
    owner = lease.Owner(kind="process", process=other, epoch=3, what="a local run")
    lease.path(tmp_path).write_text(owner.to_json())
    token = lease.read(tmp_path).token  # type: ignore[union-attr]
    beating = threading.Event()

    def renew() -> None:
        while not beating.is_set():
            lease.renew(tmp_path, token)
            time.sleep(0.2)

    t = threading.Thread(target=renew)
    t.start()
    try:
        with pytest.raises(lease.Busy, match="renews the lease"):
            lease.take(tmp_path, lease.Owner.of_job("9"), never, watch_s=2)
    finally:
        beating.set()
        t.join()
    assert lease.take(tmp_path, lease.Owner.of_job("9"), never, watch_s=1.5).epoch == 4  # still: over


def test_an_owner_that_was_taken_over_cannot_renew_hand_over_or_release(tmp_path: Path) -> None:
    old = lease.take(tmp_path, lease.Owner.of_job("7"), never)
    new = lease.take(tmp_path, lease.Owner.of_job("8"), lambda j: False)
    assert not lease.renew(tmp_path, old.token) and lease.renew(tmp_path, new.token)
    assert lease.hand_over(tmp_path, old, lease.Owner.of_job("10")) is None
    lease.release(tmp_path, old)
    assert lease.read(tmp_path).job == "8"  # type: ignore[union-attr]
    assert lease.hand_over(tmp_path, new, lease.Owner.of_job("10")).epoch == 3  # type: ignore[union-attr]
    lease.release(tmp_path, lease.read(tmp_path))  # type: ignore[arg-type]
    assert lease.read(tmp_path) is None


def _fake_slurm(bin_dir: Path, scontrol: str) -> Path:
    """scontrol as given, sacct absent (no accounting), sbatch that records being called."""
    bin_dir.mkdir()
    calls = bin_dir / "calls"
    for name, body in (("scontrol", scontrol), ("sbatch", f"echo sbatch >> {calls}; echo 99"),
                       ("sinfo", "echo 'debug*|2|gpu:2|infinite'")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return calls


@pytest.mark.parametrize("scontrol,said", [
    ("sleep 30", "Slurm did not answer whether job 41"),  # defect 5: a hung controller
    ("echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1",
     "Slurm did not answer whether job 41"),
    ("echo 'JobId=41 JobState=RUNNING'", "Slurm job 41 still owns it"),
])
def test_resume_of_a_slurm_run_never_takes_no_answer_for_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              scontrol: str, said: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    RunSpec(job="x.py", sets={}, nodes=1, gpus=1, backend="slurm", name="x", jobs=["41"]).write(run)
    lease.take(run, lease.Owner.of_job("41"), never)
    calls = _fake_slurm(tmp_path / "bin", scontrol)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    from hpcshard.slurm import client

    monkeypatch.setattr(client, "TIMEOUT_S", 1.0)  # (a hung scontrol: 1 s, not 30)
    result = CliRunner().invoke(main, ["resume", str(run)])
    assert result.exit_code == 2, result.output
    assert said in result.output and len(result.output.strip().splitlines()) == 1
    assert not calls.exists()  # nothing submitted
    assert lease.read(run).job == "41"  # type: ignore[union-attr]


@contextlib.contextmanager
def held(run_dir: Path, what: str) -> Iterator[subprocess.Popen[str]]:
    """Another process of this host owns the run (`what` it does), for as long as the block
    runs."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from hpcshard.rundir import lease; "
        f"lease.take(Path({str(run_dir)!r}), lease.Owner.of_process({what!r}), None); "
        "print('ok', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_resume_of_a_local_run_is_refused_while_the_first_owns_it(tmp_path: Path) -> None:
    """The first command owns the run from before its preflight to the run's end; the
    second is one line, exit 2, and writes nothing."""
    RunSpec(job="x.py", sets={}, nodes=1, gpus=1, backend="local", name="x").write(tmp_path)
    with held(tmp_path, "hpcshard resume"):
        before = (tmp_path / "spec.json").read_text()
        result = CliRunner().invoke(main, ["resume", str(tmp_path), "--nodes", "2"])
        assert result.exit_code == 2 and "hpcshard resume (process" in result.output
        assert (tmp_path / "spec.json").read_text() == before
