"""A run that is over releases its allocation (`launch.release`), and `submit --follow`
stops at the run's end (`ledger.finished`), a lost node holding its job or not."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import release
from hpcshard.rundir import events, launchers, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.slurm import cluster
from hpcshard.slurm.env import SlurmEnv
from hpcshard.slurm.states import JobState
from tests.conftest import wait_for

pytestmark = pytest.mark.unit

NODES = ["n1", "n2", "n3"]


def lost(node: str, attempt: int = 0) -> dict[str, Any]:
    return {"event": "bad_node", "attempt": attempt, "slurm_node": node, "reason": "lost: silent for 8 s"}


def end(reason: str, attempt: int = 0) -> dict[str, Any]:
    return {"event": "end", "attempt": attempt, "reason": reason}


START = {"event": "start", "attempt": 0, "cycle": 0}
RESTART = {"event": "start", "attempt": 0, "cycle": 1}
FAULT_RESTART = {"event": "fault", "attempt": 0, "cycle": 1, "action": "restart", "end": None}


def crash(cycle: int) -> dict[str, Any]:
    """Rank 0's end as its exception leaves it (`runtime.main._failed`)."""
    return {"event": "end", "attempt": 0, "cycle": cycle, "reason": "error",
            "error": "DistBackendError: Connection closed by peer"}


@pytest.mark.parametrize("records,me,keep", [
    ([START, lost("n2"), RESTART, end("done")], "n1", ("n1", "n3")),  # done on the spare
    ([START, lost("n2"), RESTART, end("done")], "n3", ("n1", "n3")),  # (any launcher kept)
    ([START, lost("n2"), lost("n3"), RESTART, end("done")], "n1", ("n1",)),  # on fewer nodes
    ([START, lost("n2"), RESTART, end("error")], "n1", ("n1", "n3")),  # a bug after the restart
    ([START, lost("n2"), RESTART, end("gave_up")], "n1", ("n1", "n3")),
    ([START, lost("n2"), end("stop"), {"event": "chain", "attempt": 0, "job": "7", "next": "8"}],
     "n1", ("n1", "n3")),  # continued in another job: that one waits for this one's end
    ([START, lost("n2"), end("fault"), {"event": "gave_up", "attempt": 0, "reason": "cap"}],
     "n1", ("n1", "n3")),
    ([START, lost("n2"), RESTART, end("done")], "n2", None),  # the lost one, thawed: says nothing
    ([START, lost("n2"), end("stop"), {"event": "requeue", "attempt": 0, "job": "7"}],
     "n1", None),  # the same job goes on (`_down_lost`)
    ([START, lost("n2"), end("stop")], "n1", None),  # its continuation not decided yet
    ([START, lost("n2"), end("fault")], "n1", None),
    ([START, lost("n2"), RESTART], "n1", None),  # not closed: killed from outside
    ([START, lost("n2"), end("error"), RESTART], "n1", None),  # restarted after the error: not closed
    ([START, lost("n1"), RESTART, end("done")], "n2", None),  # the batch node lost: an orphan
    ([START, {**lost("n2"), "reason": "health check: bad"}, RESTART, end("done")], "n1", None),
    ([START, lost("n9"), RESTART, end("done")], "n1", None),  # not this job's node
    ([START, lost("n2", attempt=0), {**START, "attempt": 1}, end("done", attempt=1)], "n1", None),
    ([START, end("done")], "n1", None),  # nothing lost: the job ends by itself
], ids=["done-spare", "done-from-n3", "fewer", "error", "gave-up-end", "chain", "gave-up",
        "from-lost", "requeue", "stop-undecided", "fault-undecided", "unclosed", "error-restarted",
        "batch-lost",
        "health-check", "other-job", "other-attempt", "none-lost"])
def test_which_ended_attempts_release_their_lost_nodes(records: list[dict[str, Any]], me: str,
                                                       keep: tuple[str, ...] | None) -> None:
    decided = release.plan(records, 0, NODES, me)
    assert (decided.keep if decided else None) == keep
    if decided:
        assert set(decided.lost) == set(NODES) - set(keep or ())


@pytest.mark.parametrize("records,keep", [
    ([START, lost("n2"), RESTART, end("done")], ("n1", "n3")),  # done on the spare
    ([START, lost("n2"), end("stop")], ("n1", "n3")),  # Ctrl-C, the allocation's end: nothing requeues
    ([START, lost("n2"), end("fault")], ("n1", "n3")),  # the restarts spent: nothing requeues either
    ([START, lost("n1"), RESTART, end("done")], ("n2", "n3")),  # its first node: no batch script there
    ([START, lost("n2"), RESTART], None),  # not closed
    ([START, lost("n2"), end("error"), RESTART], None),  # restarted after the error
    ([START, {**lost("n2"), "reason": "health check: bad"}, RESTART, end("done")], None),
    ([START, lost("n9"), RESTART, end("done")], None),  # not the allocation's node
    ([START, end("stop")], None),  # nothing lost: the step ends by itself
    # A rank's report of its own crash (runtime.main's `_failed`: a peer's death, say) is not
    # the attempt's end: its launchers answer it with a restart, or with an end of their own.
    ([START, lost("n2"), RESTART, crash(1)], None),
    ([START, lost("n2"), RESTART, crash(1), FAULT_RESTART], None),  # restarting: ranks, load
    ([START, crash(0), lost("n2")], None),  # rank 0 saw the node die before its launcher did
    ([START, lost("n2"), RESTART, crash(1), {**end("bug"), "cycle": 1, "how": "again"}], ("n1", "n3")),
    ([START, lost("n2"), RESTART, {**crash(1), "user_error": True}], ("n1", "n3")),  # never restarted
    ([START, lost("n2"), RESTART, end("error")], ("n1", "n3")),  # a launcher's "exit N": over
], ids=["done-spare", "stop", "fault", "first-node", "unclosed", "error-restarted", "health-check",
        "other-job", "none-lost", "crash", "crash-restarting", "crash-first", "crash-then-bug",
        "user-error", "launcher-error"])
def test_inside_a_held_allocation_a_stop_or_fault_closes_the_attempt_too(
        records: list[dict[str, Any]], keep: tuple[str, ...] | None) -> None:
    """`hpcshard run` (held): no requeue or continuation follows a stop or a fault's end,
    and the command, not a batch script on the first node, ends the step."""
    decided = release.plan(records, 0, NODES, "", held=True)
    assert (decided.keep if decided else None) == keep


@pytest.mark.parametrize("records,since,reason", [
    ([START, end("done")], 0, "done"),
    ([START, end("error"), RESTART, end("done")], 0, "done"),
    ([START, end("error")], 0, None),  # (a rank's: the launchers may restart it)
    ([START, end("error"), RESTART], 0, None),
    ([START, end("stop")], 0, None),
    ([START, end("stop"), {"event": "requeue", "attempt": 0, "job": "7"}], 0, None),
    ([START, end("fault"), {"event": "gave_up", "attempt": 0, "reason": "cap"}], 0, "gave_up"),
    ([START, end("done")], 1, None),  # an older job's attempt: resumed, not started yet
    ([START, end("done"), {**START, "attempt": 1}], 1, None),
    ([START, end("done"), {**START, "attempt": 1}, end("done", attempt=1)], 1, "done"),
    ([START, end("done"), {"event": "cancel", "attempt": 0, "job": "7.0", "reason": "x"}], 0, "done"),
    ([], 0, None),
])
def test_the_run_has_finished_once_done_or_given_up(records: list[dict[str, Any]], since: int,
                                                    reason: str | None) -> None:
    found = ledger.finished(records, since)
    assert ((found["reason"] if found["event"] == "end" else found["event"]) if found else None) == reason


def job(tmp_path: Path, node_id: int = 0) -> tuple[Path, SlurmEnv]:
    run = tmp_path / "run"
    (run / "launch").mkdir(parents=True, exist_ok=True)
    for event in (events.BadNode(attempt=0, cycle=0, node=1, slurm_node="n2", reason="lost: silent"),
                  events.End(attempt=0, reason=EndReason.DONE, saved_step=8, saved="step-8")):
        ledger.append(run, event)
    return run, SlurmEnv(job_id="77", ref="77", nodes=NODES, node_id=node_id, restart_count=0,
                         gpus_on_node=1, step_id="0")


@pytest.mark.parametrize("down", [True, False])
def test_one_launcher_leaves_the_release_to_a_helper_once_the_others_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, down: bool) -> None:
    """Once the other kept launcher has ended (its pid file gone): recorded, then a helper
    left to set the lost node DOWN (bad_nodes = drain) or cancel the step; a second
    launcher does nothing. The record says what was asked, not that the node was set DOWN:
    the helper acts later, and may find another job there or be refused (issue 42: a
    `node_down` record was written before anything happened)."""
    run, env = job(tmp_path)
    did: list[str] = []
    other = launchers.pid_file(run, 2)
    other.write_text("{}\n")

    def sleep(seconds: float) -> None:  # (the other launcher ends meanwhile)
        did.append("wait")
        other.unlink(missing_ok=True)

    monkeypatch.setattr(release.time, "sleep", sleep)
    monkeypatch.setattr(release, "after_exit",
                        lambda job, step, nodes, why: did.append(f"{job}.{step} {nodes}"))
    release.release(run, env, 0, down=down)
    assert did == ["wait", "77.0 n2" if down else "77.0 "]
    records = ledger.read(run)
    (cancel,) = [r for r in records if r["event"] == "cancel"]
    assert cancel["job"] == "77.0" and "n2" in cancel["reason"] and "done" in cancel["reason"]
    assert ("is asked to set n2 DOWN" if down else "is asked to cancel step 77.0") in cancel["reason"]
    assert not [r for r in records if r["event"] == "node_down"]  # (nothing was set DOWN yet)
    release.release(run, SlurmEnv(**{**env.__dict__, "node_id": 2}), 0, down=down)  # (claimed already)
    assert len(did) == 2


def fake_slurm(tmp_path: Path, scontrol: str = "", squeue: str = "echo 77\n") -> tuple[dict[str, str], Path]:
    """scancel, scontrol and squeue first on PATH, each writing its arguments to CALLED
    (squeue: this job alone runs on the nodes asked of it)."""
    import os

    bin_dir, called = tmp_path / "bin", tmp_path / "called"
    bin_dir.mkdir()
    for name, body in (("scancel", ""), ("scontrol", scontrol), ("squeue", squeue)):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {called}\n{body}')
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, called


def test_the_helper_acts_only_after_the_launcher_has_exited(tmp_path: Path) -> None:
    """The helper waits for its parent's exit (end of file on its pipe), then acts: a
    cancel or a DOWN kills the step's tasks still running, and srun would report the
    launcher killed (137: the job FAILS)."""
    import subprocess
    import sys

    env, called = fake_slurm(tmp_path)
    # The launcher lives until the test closes its stdin (not for a while: on a loaded
    # machine the test looked after a launcher that had already exited), and says its helper.
    code = ("import sys; from hpcshard.launch import release; release.after_exit('77', '0', 'n2', 'why'); "
            "print(release._WAITING[0].pid, flush=True); sys.stdin.read()")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdin is not None and launcher.stdout is not None
    helper = int(launcher.stdout.readline())
    wait_for(lambda: reads_a_pipe(helper), 60, "the helper to wait on its pipe")
    assert not called.exists()  # (the launcher still runs)
    launcher.stdin.close()
    assert launcher.wait(timeout=30) == 0
    down = "scontrol update NodeName=n2 State=DOWN Reason=why"
    # (the helper first waits AFTER_EXIT_S, 10 s, past the launcher's exit)
    wait_for(lambda: called.exists() and down in called.read_text(), 60, "the helper's DOWN")
    acted = [c for c in called.read_text().splitlines() if not c.startswith("scontrol show job")]
    assert acted == [ALONE, down]  # (asked first: `holds`)


def reads_a_pipe(pid: int) -> bool:
    """The process waits in a read of a pipe (/proc/PID/wchan: pipe_read, anon_pipe_read on
    newer kernels): the helper has reached its wait for the launcher's exit."""
    try:
        return "pipe_read" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


ALONE = "squeue -h -t R,S,CG -w n2 -o %A"
"""Asked before a DOWN: which jobs run on the node (a DOWN ends every one of them)."""


@pytest.mark.parametrize("nodes,scontrol,squeue,calls", [
    ("", "", "", ["scancel 77.0"]),
    ("n2", 'echo "Access/permission denied" >&2; exit 1\n', "echo 77\n", [
        ALONE, "scontrol update NodeName=n2 State=DOWN Reason=why", "scancel 77.0"]),  # not an operator
    # Another job runs on the node too (no --exclusive): a DOWN would end it. Or Slurm does
    # not say: the same (the node is left to Slurm's SlurmdTimeout).
    ("n2", "", "echo 77; echo 88\n", [ALONE, "scancel 77.0"]),
    ("n2", "", "exit 1\n", [ALONE, "scancel 77.0"]),
], ids=["no-node", "refused", "shared", "no-answer"])
def test_a_step_is_cancelled_when_no_node_may_be_set_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: str, scontrol: str, squeue: str,
        calls: list[str]) -> None:
    import io

    env, called = fake_slurm(tmp_path, scontrol, squeue)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setattr(release, "AFTER_EXIT_S", 0)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert release.main(["77", "0", nodes, "why"]) == 0
    assert [c for c in called.read_text().splitlines() if not c.startswith("scontrol show job")] == calls


@pytest.mark.parametrize("state,reason,code,said", [
    (JobState.RUNNING, EndReason.DONE, 0, "job 77: RUNNING (the run is done; Slurm is still ending the job)"),
    (JobState.COMPLETED, EndReason.DONE, 0, "job 77: COMPLETED"),
    (JobState.RUNNING, EndReason.ERROR, None, ""),  # not finished: followed until the job ends
])
def test_follow_returns_at_the_runs_end_not_the_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        state: JobState, reason: EndReason, code: int | None, said: str) -> None:
    from hpcshard.cli import common, request

    ledger.append(tmp_path, events.End(attempt=0, reason=reason))
    info = cluster.JobInfo("77", state, state.value)
    monkeypatch.setattr(cluster, "query_job", lambda job, timeout=None: cluster.JobQuery(
        job, cluster.Said.KNOWN, info))
    monkeypatch.setattr(common.time, "sleep", lambda s: None)
    clock = [0.0]

    def tick() -> float:
        clock[0] += 1
        if clock[0] > 100:
            raise TimeoutError("followed past the run's end")
        return clock[0]

    monkeypatch.setattr(common.time, "monotonic", tick)
    if code is None:
        with pytest.raises(TimeoutError):
            request._follow(tmp_path, "77")
        return
    assert request._follow(tmp_path, "77") == code
    assert said in capsys.readouterr().out


@pytest.mark.parametrize("state, nodes, lost, acts", [
    ("RUNNING", "n[1-3]", ["n2"], True),  # a frozen node holds the job: give it up
    ("COMPLETING", "n[1-3]", ["n2"], True),
    ("COMPLETED", "n[1-3]", ["n2"], False),  # it ended by itself while the helper waited
    ("RUNNING", "n[1,3]", ["n2"], False),  # n2 left it: thawed, perhaps another job's now
    ("RUNNING", "", [], True),  # a step cancel: nothing to check but the state
    (None, "", ["n2"], True),  # Slurm did not answer: as before
])
def test_the_helper_acts_only_while_the_job_holds_what_it_gives_up(state: str | None, nodes: str,
                                                                    lost: list[str], acts: bool) -> None:
    info = None if state is None else cluster.JobInfo(job="7", state=JobState(state), state_text=state,
                                                       nodes=nodes)
    assert release.holds(info, lost) is acts


def test_the_helper_leaves_a_node_the_job_no_longer_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case the suite met: the job ended by itself (a killed node's slurmd answered),
    the test resumed the node, and 10 s later the helper set it DOWN under the next job."""
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(release, "AFTER_EXIT_S", 0)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    monkeypatch.setattr(cluster, "show_job", lambda job, timeout=None: cluster.JobInfo(
        job=job, state=JobState.COMPLETED, state_text="COMPLETED", nodes="n[1-2]"))
    monkeypatch.setattr(cluster, "drain", lambda *a: calls.append(("drain", *a)))
    monkeypatch.setattr(cluster, "end_step", lambda *a: calls.append(("end_step", *a)))
    assert release.main(["7", "0", "n2", "hpcshard x: lost: silent"]) == 0
    assert calls == []
