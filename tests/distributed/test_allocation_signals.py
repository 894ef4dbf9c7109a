"""What `hpcshard run` (`launch.allocation.run_held`) sends its step, against a stand-in
srun that records the signals it is forwarded: Ctrl-C is the notice and a second one
stops now; the allocation's end sends the notice `lead` seconds before; a run over while a
frozen node holds the step ends that step. (The real step,
on the local Slurm: tests/slurm/test_allocation.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import allocation
from hpcshard.rundir import events, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.rankenv import REQUEUE_EXIT
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm import cluster, steps
from hpcshard.slurm.states import JobState
from tests.conftest import wait_for

SRUN = """#!/bin/bash
# a step that takes the notice (USR2: exit 75 once its "ranks" saved, after SAVE_S) and TERM
save_s={save}
echo "$@" > "{log}.argv"
trap 'echo USR2 >> "{log}"; date +%s.%N > "{log}.at"; [ "$save_s" = 0 ] && exit 75' USR2
trap 'echo TERM >> "{log}"; exit 143' TERM
mkdir -p "{run}/launch"  # (each launcher's pid file, once it has its handler)
for k in 0 1; do echo "{{\\"pid\\": $$, \\"k\\": $k}}" > "{run}/launch/node-$k.pid"; done
for i in $(seq 600); do sleep 0.1; done
exit 9
"""


def fake_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: int) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "signals"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.format(log=log, save=save, run=tmp_path / "run"))
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log


def spec_in(tmp_path: Path) -> tuple[RunSpec, Path]:
    run = tmp_path / "run"
    run.mkdir()
    spec = RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=1, backend="allocation", name="r")
    spec.write(run)
    return spec, run


SALLOC = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]"}


def taken(sig: int) -> bool:
    """run_held has its handler for `sig` (it sets it just after it starts srun): a signal
    sent to this process before that is the default's (Ctrl-C: KeyboardInterrupt)."""
    return getattr(signal.getsignal(sig), "__name__", "") == "on_signal"


def test_ctrl_c_is_the_notice_and_a_second_one_stops_now(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    log = fake_srun(tmp_path, monkeypatch, save=1)  # (the notice alone does not end it)
    monkeypatch.setattr(cluster, "time_left", lambda job: None)
    spec, run = spec_in(tmp_path)

    def press() -> None:
        # The first press once run_held has its handler and srun runs; the second once the
        # first went out (the notice is in srun's log): two before it are "stop now" alone.
        # (Not 0.5 s after each: a loaded machine may take longer than that to get there.)
        for ready in (lambda: taken(signal.SIGINT) and log.with_suffix(".argv").exists(),
                      lambda: log.exists() and "USR2" in log.read_text()):
            wait_for(ready, 120, "the press's moment")
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press, daemon=True).start()
    code = allocation.run_held(spec, run, "auto", "", lead=120, environ=SALLOC)
    assert log.read_text().split() == ["USR2", "TERM"] and code == 143
    assert RunSpec.read(run).jobs == ["41"]  # the allocation, recorded for status
    argv = log.with_suffix(".argv").read_text().split()
    assert "--nodes=2" in argv and argv[-1] == str(run)


def test_the_allocations_end_sends_the_notice_lead_seconds_before(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log = fake_srun(tmp_path, monkeypatch, save=0)
    monkeypatch.setattr(cluster, "time_left", lambda job: 20.0)  # (a duration: no clock of Slurm's)
    spec, run = spec_in(tmp_path)
    end = time.time() + 20
    code = allocation.run_held(spec, run, "auto", "", lead=15, environ=SALLOC)
    assert log.read_text().split() == ["USR2"] and code == REQUEUE_EXIT
    at = float(log.with_suffix(".at").read_text())
    # Not at once, and before the end: a lead of 15 s (it was 3) leaves a loaded machine's
    # command 15 s past its 1 s poll to send it, in a test that still waits about 5 s.
    assert end - 15 <= at < end


LATE = """#!/bin/bash
# a step whose launchers take {up} s to start (imports on a loaded host): until each has
# its handler (and wrote its pid file, as `launch.node` does just after) a notice kills it
echo "$@" > "{log}.argv"
sleep {up}
trap 'echo USR2 >> "{log}"; exit 75' USR2
mkdir -p "{run}/launch"
for k in 0 1; do echo "{{\\"pid\\": $$, \\"k\\": $k}}" > "{run}/launch/node-$k.pid"; done
for i in $(seq 600); do sleep 0.1; done
exit 9
"""


def late_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Path, up: float) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "signals"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(LATE.format(log=log, run=run, up=up))
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log


def test_a_notice_due_while_the_launchers_start_waits_for_them(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocation ends within the lead already (a run started in its last minutes): the
    notice is due at once, but the step's launchers have no handler yet (a notice then
    kills them, or srun forwards it to no task). It goes when they are up, not before; a
    previous step's pid files (a launcher killed with -9) do not count."""
    spec, run = spec_in(tmp_path)
    (run / "launch").mkdir()
    for k in (0, 1):  # an earlier attempt's, left behind
        (run / "launch" / f"node-{k}.pid").write_text('{"pid": 1}\n')
    log = late_srun(tmp_path, monkeypatch, run, up=1.5)
    monkeypatch.setattr(cluster, "time_left", lambda job: 60.0)
    code = allocation.run_held(spec, run, "auto", "", lead=120, environ=SALLOC)
    assert log.exists() and log.read_text().split() == ["USR2"] and code == REQUEUE_EXIT


class _Gone:
    """stderr once the user's ssh dropped: the terminal answers every write with EIO."""

    def write(self, _text: str) -> int:
        raise OSError(5, "Input/output error")

    def flush(self) -> None:
        raise OSError(5, "Input/output error")


def test_a_hangup_with_the_terminal_gone_is_still_the_notice(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """ssh drops: the command gets SIGHUP, and its terminal is gone (every write: EIO). The
    notice still goes to the step, and the command waits for the step's end."""
    spec, run = spec_in(tmp_path)
    log = late_srun(tmp_path, monkeypatch, run, up=0)
    monkeypatch.setattr(cluster, "time_left", lambda job: None)

    def hang_up() -> None:
        # once run_held has its handler and the launchers theirs (their pid files)
        wait_for(lambda: taken(signal.SIGHUP) and (run / "launch" / "node-1.pid").exists(), 120,
                 "the launchers' pid files")
        monkeypatch.setattr("sys.stderr", _Gone())
        os.kill(os.getpid(), signal.SIGHUP)

    threading.Thread(target=hang_up, daemon=True).start()
    code = allocation.run_held(spec, run, "auto", "", lead=120, environ=SALLOC)
    assert log.exists() and log.read_text().split() == ["USR2"] and code == REQUEUE_EXIT


HUNG = """#!/bin/bash
# a step of 3 launchers whose node 1 froze: once the run is over, the kept ones (0, 2)
# exit, and srun waits for the frozen one's task until the step is cancelled (TERM)
echo $$ > "{log}.pid"
trap 'echo TERM >> "{log}"; exit 0' TERM
mkdir -p "{run}/launch"
for k in 0 1 2; do echo "{{\\"pid\\": $$, \\"k\\": $k}}" > "{run}/launch/node-$k.pid"; done
for i in $(seq 600); do sleep 0.1; done
exit 9
"""


def test_a_run_over_with_a_frozen_node_ends_its_step_not_the_allocation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run ended on its spare after node 1 (n2) froze: the command cancels its own step
    (found by its name) once the kept launchers have exited, never the allocation, and
    returns the ledger's code; srun alone would wait for the frozen task (SlurmdTimeout)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "signals"
    bin_dir.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    spec = RunSpec(job="jobs/charlm.py", sets={}, nodes=2, spares=1, gpus=1, backend="allocation", name="r")
    spec.write(run)
    (bin_dir / "srun").write_text(HUNG.format(log=log, run=run))
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(cluster, "time_left", lambda job: None)
    monkeypatch.setattr(steps, "run_steps", lambda job, name, timeout=None: [f"{job}.0"])
    monkeypatch.setattr(cluster, "show_job", lambda job, timeout=None: cluster.JobInfo(
        job=job, state=JobState.RUNNING, state_text="RUNNING", nodes="n[1-3]"))
    cancelled: list[tuple[str, ...]] = []

    def scancel(*args: str) -> None:  # (Slurm's: TERM to the step's tasks; srun then exits)
        cancelled.append(args)
        os.kill(int(log.with_suffix(".pid").read_text()), signal.SIGTERM)

    monkeypatch.setattr(cluster, "scancel", scancel)
    watching: list[allocation.StepEnd] = []

    class Watched(allocation.StepEnd):  # (the command's own, seen by the test)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            watching.append(self)

    monkeypatch.setattr(allocation, "StepEnd", Watched)
    ended: list[float] = []

    def launchers() -> None:  # what the launchers write: the loss, the end on the spare
        # The run trains on until the command has seen every launcher's pid file (one it
        # never saw says nothing of its launcher), not for 1.5 s of its 1 s polls.
        wait_for(lambda: watching and watching[0].seen == {0, 1, 2}, 120, "the command to see the pid files")
        ledger.append(run, events.BadNode(attempt=0, cycle=0, node=1, slurm_node="n2", reason="lost: silent"))
        ledger.append(run, events.End(attempt=0, reason=EndReason.DONE, saved_step=8, saved="step-8"))
        ended.append(time.monotonic())
        time.sleep(1.0)  # (the kept launchers' last words: their exit a moment after the end, as in a run)
        for k in (0, 2):
            (run / "launch" / f"node-{k}.pid").unlink()

    threading.Thread(target=launchers, daemon=True).start()
    code = allocation.run_held(spec, run, "auto", "", lead=None,
                               environ={"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-3]"})
    returned = time.monotonic()
    print(f"the run's end -> hpcshard run returned: {returned - ended[0]:.1f} s")
    assert cancelled == [("41.0",)] and log.read_text().split() == ["TERM"] and code == 0
    (said,) = [r for r in ledger.read(run) if r["event"] == "cancel"]
    assert said["job"] == "41.0" and "n2" in said["reason"] and "hpcshard run" in said["reason"]
