"""A run's Slurm job ends FAILED only when the run ended other than done, and ended there:
each launcher's task exit (`launch.slurm.task_exit`; srun exits with its tasks' highest, the
batch script with srun's) and what it does on the way out (a guard job dropped), with the
launcher's surroundings stood in for (no Slurm, no ranks)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from hpcshard.launch import slurm
from hpcshard.rundir import events, launchers, lease, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.launchers import LAUNCH
from hpcshard.rundir.rankenv import BUG_EXIT, REQUEUE_EXIT, STORAGE_EXIT
from hpcshard.rundir.spec import RunSpec


@pytest.mark.parametrize("job,code,sent_on,expected", [
    (0, 0, False, 0),  # done
    (1, 0, False, 0),  # fenced off or left out: the ledger's "error" is a restarted cycle's
    (1, 1, False, 1),  # the run's error, ended here
    (1, BUG_EXIT, False, 1),
    (1, STORAGE_EXIT, False, 1),
    (0, 1, False, 0),  # its own failure, the end not in the ledger it read: another says
    (1, REQUEUE_EXIT, False, 0),  # stopped: another launcher sends the job on (a bare stop read)
    (0, REQUEUE_EXIT, True, 0),  # requeued or continued by this one
    (1, REQUEUE_EXIT, True, 1),  # given up by this one
    (None, 0, False, 0),  # the ledger unreadable: its own outcome
    (None, REQUEUE_EXIT, False, 0),
    (None, REQUEUE_EXIT, True, 0),
    (None, 1, False, 1),
])
def test_a_task_fails_only_when_the_run_ended_there(job: int | None, code: int, sent_on: bool,
                                                    expected: int) -> None:
    assert slurm.task_exit(job, code, sent_on) == expected


def launcher_exit(run: Path, monkeypatch: pytest.MonkeyPatch, records: list[events.Event], code: int,
                  claimed: tuple[str, ...] = (), refused: bool = False,
                  node: int = 1) -> tuple[int | str, list[str]]:
    """Node 1's launcher (or `node`'s) of job 7 (2 nodes, --no-kill: guarded by job 8) once
    its ranks ended with `code`, the ledger holding `records` and `claimed` claimed by node
    0's launcher already: its task's exit ("exit N" where it left through SystemExit, else
    node_main's return) and the jobs it cancelled. The continuation it sends on where it
    wins the claim: a requeue, recorded. `refused`: the run directory refuses every new
    file from the launcher's start on (EACCES: a root-squash change, an expired ticket)."""
    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=1, backend="slurm", name="x", spares=1,
            jobs=["7"]).write(run)
    (run / LAUNCH).mkdir()
    for r in records:
        ledger.append(run, r)
    launchers.guard_file(run, "8").write_text("7\n")
    for name in ("guard-7", *claimed):
        assert launchers.claim(run, name)
    env = slurm.SlurmEnv(job_id="7", ref="7", nodes=["n1", "n2"], node_id=node, restart_count=0,
                         gpus_on_node=1, step_id="0")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # (node_main exports the ranks' variables)
    monkeypatch.setattr(slurm.SlurmEnv, "from_environ", classmethod(lambda cls: env))
    monkeypatch.setattr(slurm, "own_run", lambda run, ref: lease.Owner.of_job(ref))
    monkeypatch.setattr(slurm.hostside, "has_client", lambda action="requeue": True)
    monkeypatch.setattr(slurm.cluster, "time_left", lambda job: None)
    monkeypatch.setattr(slurm, "run_node", lambda *a, **k: code)
    monkeypatch.setattr(slurm, "_await_end", lambda *a: None)
    monkeypatch.setattr(slurm, "_continue", lambda run, env, attempt, *a, **k: ledger.append(
        run, events.Requeue(attempt=attempt, job=env.ref)))
    monkeypatch.setattr(slurm, "_down_lost", lambda *a: None)
    monkeypatch.setattr(slurm, "release", lambda *a, **k: None)
    cancelled: list[str] = []
    monkeypatch.setattr(slurm.cluster, "scancel", lambda *jobs: cancelled.extend(jobs))
    if refused:
        monkeypatch.setattr(launchers, "create_exclusive", refuse)
    try:
        return slurm.node_main(str(run), 1, 0, 3), cancelled
    except SystemExit as left:
        return f"exit {left.code}", cancelled


def refuse(path: Path, text: str) -> bool:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


START = events.Start(attempt=0, cycle=0, world=2, nodes=2, host="n1")


def test_a_launcher_whose_peer_sends_the_job_on_neither_fails_it_nor_drops_its_guard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop on 2 nodes: node 0's launcher won the claim to requeue and is still asking
    Slurm; node 1's reads the ledger before the requeue record (a bare stop). It used to
    exit 1 and cancel the guard job (the requeued job keeps its id: never guarded again)."""
    stopped = [START, events.End(attempt=0, reason=EndReason.STOP, cycle=0, step=5, saved_step=5)]
    assert launcher_exit(tmp_path, monkeypatch, stopped, REQUEUE_EXIT, ("continue-0",)) == (REQUEUE_EXIT, [])


def test_the_launcher_that_sends_the_job_on_says_whether_it_did(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    stopped = [START, events.End(attempt=0, reason=EndReason.STOP, cycle=0, step=5, saved_step=5)]
    assert launcher_exit(tmp_path, monkeypatch, stopped, REQUEUE_EXIT) == (REQUEUE_EXIT, [])
    assert [r["event"] for r in ledger.read(tmp_path)][-1] == "requeue"


def test_a_launcher_fenced_off_after_an_in_place_restart_neither_fails_the_job_nor_drops_its_guard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 froze; rank 0 died of it (its end record, error, cycle 0); the others restart
    on the spare. Thawed, node 1's launcher finds itself fenced off and returns 0. It used to
    read that end as the run's, exit 1 (the job FAILED however the run ends: srun reports
    its tasks' highest code) and cancel the guard of a job still training."""
    crashed = [START, events.End(attempt=0, reason=EndReason.ERROR, cycle=0, error="RuntimeError: peer died")]
    assert launcher_exit(tmp_path, monkeypatch, crashed, 0) == (0, [])
    ledger.append(tmp_path, events.Start(attempt=0, cycle=1, world=2, nodes=2, host="n1"))
    assert slurm.task_exit(slurm.job_exit(ledger.read(tmp_path)), 1, False) == 0  # (and once it restarted)


def test_a_run_that_ended_in_error_fails_its_job_and_drops_its_guard(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    failed = [START, events.End(attempt=0, reason=EndReason.BUG, cycle=1, error="ValueError: x")]
    assert launcher_exit(tmp_path, monkeypatch, failed, BUG_EXIT) == ("exit 1", ["8"])


def test_a_run_stopped_for_a_run_directory_that_refuses_writes_fails_its_job_without_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """EACCES on the run directory (a requeued attempt: the guard's claim is asked again)
    stopped the run for its storage (74). The claims of the way in and out (guard,
    unguard) raised PermissionError out of the task instead of its exit 1: the task's
    error came as a traceback after the storage's one line."""
    stopped = [START, events.End(attempt=0, reason=EndReason.STORAGE, cycle=0,
                                 how="the run directory x takes no write (EACCES: Permission denied)")]
    assert launcher_exit(tmp_path, monkeypatch, stopped, STORAGE_EXIT, refused=True) == ("exit 1", [])
    said = capsys.readouterr().err
    assert "unguard-7: the run directory refused its claim ([Errno 13] Permission denied" in said
    assert "no guard job ([Errno 13] Permission denied" in said


@pytest.mark.parametrize("node,sent_on", [(0, True), (1, False)])
def test_a_requeue_after_a_notice_ended_the_wait_for_the_storage_is_sent_on_by_node_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], node: int,
        sent_on: bool) -> None:
    """A notice ended the run's wait for a run directory that refuses writes (EACCES), and
    the decision was a requeue. The claim of who sends the job on was refused as well: it
    raised out of every launcher (a traceback), nobody requeued the job, and a time
    limit's job ended TIMEOUT, never requeued. Node 0's launcher sends it on alone."""
    stopped = [START, events.End(attempt=0, reason=EndReason.STOP, cycle=0, step=5, saved_step=5)]
    assert launcher_exit(tmp_path, monkeypatch, stopped, REQUEUE_EXIT, refused=True, node=node) == (
        REQUEUE_EXIT, [])
    assert ("requeue" in [r["event"] for r in ledger.read(tmp_path)]) is sent_on
    said = capsys.readouterr().err
    assert "continue-0: the run directory refused its claim ([Errno 13] Permission denied" in said
