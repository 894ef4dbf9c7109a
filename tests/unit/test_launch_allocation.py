"""A run inside an allocation the user holds (`hpcshard run`): the allocation read from the
shell's environment, the shape it allows, the refusals, the step's nodes and ports, the
notice before the allocation ends, and the exit code (`launch.allocation`,
`slurm.env.Held`, `slurm.steps`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.errors import UserError
from hpcshard.launch import allocation, backends, release
from hpcshard.launch.allocation import (
    StepEnd,
    end_due,
    held,
    node_env,
    notice_due,
    outcome,
    shape,
    srun_argv,
    waiting_on,
)
from hpcshard.rundir import events, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.launchers import pid_file
from hpcshard.rundir.rankenv import REQUEUE_EXIT, STORAGE_EXIT
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm import cluster, steps
from hpcshard.slurm.env import Held, SlurmEnv
from hpcshard.slurm.states import JobState

JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "charlm.py")
SALLOC = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}


@pytest.mark.parametrize("env,nodes,gpus", [
    (SALLOC, ["n1", "n2"], None),
    ({**SALLOC, "SLURM_GPUS_PER_NODE": "4"}, ["n1", "n2"], 4),
    ({**SALLOC, "SLURM_GPUS_PER_NODE": "a100:8"}, ["n1", "n2"], 8),
    ({**SALLOC, "SLURM_JOB_GRES": "gpu:a100:4"}, ["n1", "n2"], 4),
    ({**SALLOC, "SLURM_GRES": "gpu:2"}, ["n1", "n2"], 2),
    ({**SALLOC, "SLURM_JOB_GRES": "shard:3"}, ["n1", "n2"], None),
    ({"SLURM_JOB_ID": "7", "SLURM_NODELIST": "gpu[01-03]"}, ["gpu01", "gpu02", "gpu03"], None),
])
def test_the_allocation_is_read_from_the_shells_environment(env: dict[str, str], nodes: list[str],
                                                            gpus: int | None) -> None:
    found = Held.from_environ(env)
    assert found is not None and (found.nodes, found.gpus_per_node) == (nodes, gpus)


@pytest.mark.parametrize("env,needle", [
    ({}, "no SLURM_JOB_ID"),
    ({"SLURM_JOB_ID": "41"}, "SLURM_JOB_NODELIST is empty or missing"),
])
def test_outside_an_allocation_is_refused_in_one_line(env: dict[str, str], needle: str) -> None:
    assert Held.from_environ({}) is None
    with pytest.raises(UserError, match=needle) as err:
        held(env)
    assert "\n" not in str(err.value)


ALLOC = Held(job_id="41", nodes=["n1", "n2", "n3"], gpus_per_node=4)


@pytest.mark.parametrize("nodes,spares,gpus,want", [
    (None, 0, None, (3, 4)),  # every node, its GPUs
    (None, 1, None, (2, 4)),  # less the spares
    (2, 0, 2, (2, 2)),
    (2, 1, 4, (2, 4)),
])
def test_the_shape_defaults_to_the_allocation(nodes: int | None, spares: int, gpus: int | None,
                                              want: tuple[int, int]) -> None:
    assert shape(ALLOC, nodes, spares, gpus) == want


@pytest.mark.parametrize("nodes,spares,gpus,needle", [
    (4, 0, None, "--nodes 4 is more than the allocation holds (allocation 41 has 3 node(s)"),
    (3, 1, None, "--nodes 3 + 1 spare(s) is more than the allocation holds"),
    (None, 3, None, "--spares 3 leaves no node to train on"),
    (2, 0, 8, "--gpus 8 is more than allocation 41 has on each node (4)"),
])
def test_a_shape_larger_than_the_allocation_is_one_line(nodes: int | None, spares: int, gpus: int | None,
                                                       needle: str) -> None:
    with pytest.raises(UserError) as err:
        shape(ALLOC, nodes, spares, gpus)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unknown_gpus_per_node_take_the_callers_default() -> None:
    assert shape(Held(job_id="1", nodes=["a"], gpus_per_node=None), None, 0, None) == (1, None)
    assert shape(Held(job_id="1", nodes=["a"], gpus_per_node=None), None, 0, 16) == (1, 16)


@pytest.mark.parametrize("now,deadline,lead,due", [
    (1000.0, None, 120, False),  # no time limit known
    (1000.0, 2000.0, None, False),
    (1000.0, 2000.0, 120, False),
    (1880.0, 2000.0, 120, True),
    (1990.0, 2000.0, 120, True),
    (1000.0, 1060.0, 120, True),  # an allocation shorter than the lead: at once
])
def test_the_command_sends_the_notice_lead_seconds_before_the_end(now: float, deadline: float | None,
                                                                  lead: int | None, due: bool) -> None:
    assert notice_due(now, deadline, lead) is due


@pytest.mark.parametrize("code,end,want", [
    (REQUEUE_EXIT, {"reason": "stop"}, REQUEUE_EXIT),
    (1, {"reason": "stop"}, REQUEUE_EXIT),  # srun's highest code hides nothing the ledger says
    (REQUEUE_EXIT, {"reason": "error"}, REQUEUE_EXIT),  # the supervisor's: faults spent the budget
    (0, {"reason": "done"}, 0),
    (1, {"reason": "storage"}, STORAGE_EXIT),
    (1, {"reason": "error"}, 1),
    (1, None, 1),
    (-15, None, 143),
])
def test_the_exit_code_is_the_ledgers_word_over_sruns(code: int, end: dict[str, object] | None,
                                                       want: int) -> None:
    assert outcome(code, end) == want


def test_one_task_per_node_in_a_step_named_after_the_run(tmp_path: Path) -> None:
    argv = srun_argv(ALLOC, 2, tmp_path, "hpcshard-x-1")
    assert argv[0] == "srun" and "--overlap" not in argv
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--job-name=hpcshard-x-1"} <= set(argv)
    assert argv[-2:] == ["hpcshard.launch.allocation", str(tmp_path)]
    inside = Held(job_id="41", nodes=["n1"], gpus_per_node=None, step_id="interactive")
    assert "--overlap" in srun_argv(inside, 1, tmp_path, "s")


def test_each_node_finds_its_place_in_the_step() -> None:
    """A step on two of three nodes: ranks by the step's nodes, not the job's; the
    rendezvous on the step's first node; another step of the same allocation meets on
    other ports."""
    env = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NODEID": "2",
           "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[2-3]", "SLURMD_NODENAME": "n3"}
    node = node_env(SlurmEnv.from_environ(env), 4)
    assert (node.node_rank, node.nnodes, node.per_node, node.rdzv_host) == (1, 2, 4, "n2")
    again = node_env(SlurmEnv.from_environ({**env, "SLURM_STEP_ID": "1"}), 4)
    assert again.rdzv_port != node.rdzv_port and again.coord_port != node.coord_port
    assert (node.run_id, again.run_id) == ("41.0", "41.1")
    whole = SlurmEnv.from_environ({k: v for k, v in env.items() if k != "SLURM_STEP_NODELIST"})
    assert whole.step_rank == 2  # the job's SLURM_NODEID where the step's nodes are not said


def test_a_step_is_found_by_the_runs_step_name() -> None:
    name = steps.step_name("char lm; rm -rf /", 1700000000.5)
    assert name.startswith("hpcshard-char-lm-rm--rf-") and " " not in name and ";" not in name
    assert steps.step_name("a", 1.0) != steps.step_name("a", 2.0)  # two runs of one name
    text = f"41.0 {name}\n41.1 other\n41.2 {name}\n"
    assert steps.parse_steps(text, name) == ["41.0", "41.2"]
    assert steps.parse_steps("", name) == []


def test_the_allocation_backend_asks_for_its_step_and_says_how_to_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = RunSpec(job=JOB, sets={}, nodes=2, gpus=1, backend=backends.ALLOCATION, name="r", jobs=["41"])
    spec.write(tmp_path)
    backend = backends.of(spec)
    assert not backend.in_queue and not backend.here and backend.asks_slurm
    answers: dict[str, list[str] | None] = {"41": ["41.3"]}
    monkeypatch.setattr(steps, "run_steps", lambda job, name, timeout=None: answers[job])
    assert backend.over(spec, tmp_path) is False
    answers["41"] = []
    assert backend.over(spec, tmp_path) is True and backend.ended(spec, tmp_path) is True
    answers["41"] = None
    assert backend.over(spec, tmp_path) is None  # no answer is never "over"
    with pytest.raises(ValueError, match="Slurm did not answer"):
        backend.notify(spec, tmp_path, "SIGUSR2")
    answers["41"] = []
    with pytest.raises(ValueError, match="no step of .* runs in allocation 41"):
        backend.cancel(spec, tmp_path)
    hint = backend.go_on(tmp_path)
    assert f"hpcshard resume {tmp_path} inside an allocation" in hint and "salloc -N 2 " in hint
    assert backends.of(RunSpec(job=JOB, sets={}, nodes=1, gpus=1, backend="local", name="r")).go_on(
        tmp_path) == f"hpcshard resume {tmp_path}"


def invoke(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, str]:
    clean = {k: None for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_ID",
                                "SLURM_GPUS_PER_NODE", "SLURM_JOB_GRES", "SLURM_GRES")}
    result = CliRunner().invoke(main, ["run", JOB, "--run-dir", str(tmp_path / "r"), *args],
                                env={**clean, **env})
    return result.exit_code, result.output


@pytest.mark.parametrize("env,args,needle", [
    ({}, [], "there is none here (no SLURM_JOB_ID)"),
    (SALLOC, ["--nodes", "3"], "--nodes 3 is more than the allocation holds"),
    ({**SALLOC, "SLURM_GPUS_PER_NODE": "2"}, ["--gpus", "4"], "--gpus 4 is more than allocation 41"),
    (SALLOC, ["--spares", "1", "--nodes", "2"], "--nodes 2 + 1 spare(s) is more than"),
])
def test_run_refuses_in_one_line_and_makes_nothing(tmp_path: Path, env: dict[str, str], args: list[str],
                                                   needle: str) -> None:
    code, output = invoke(tmp_path, env, *args)
    assert code == 2, output
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], output
    assert not (tmp_path / "r").exists()


def test_resume_outside_an_allocation_is_refused_before_its_preflight(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    RunSpec(job=JOB, sets={}, nodes=2, gpus=1, backend=backends.ALLOCATION, name="r").write(run)
    before = json.loads((run / "spec.json").read_text())
    result = CliRunner().invoke(main, ["resume", str(run)], env={"SLURM_JOB_ID": None})
    assert result.exit_code == 2 and "there is none here" in result.output, result.output
    assert json.loads((run / "spec.json").read_text()) == before
    assert allocation.OUTSIDE in result.output.replace("\n", " ").replace("Error: ", "")


@pytest.mark.parametrize("tres,want", [
    ("gres:gpu:4", 4),  # Slurm 22.05's squeue %b, for salloc --gres=gpu:4 and --gpus-per-node=4
    ("gres/gpu:a100:8", 8),  # newer Slurm's spelling, with a type
    ("gres:gpu:a100:2,gres:gpu:v100:2", 4),
    ("gres:shard:3", None),
    ("N/A", None),
    ("", None),
])
def test_the_allocations_gpus_are_read_from_slurm(tres: str, want: int | None) -> None:
    assert steps.parse_gpus_per_node(tres) == want


def test_salloc_gres_leaves_nothing_in_the_shell_so_slurm_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`salloc -N 2 --gres=gpu:4` (the docs' example) exports no GPU variable at all (Slurm
    22.05: only --gpus-per-node does): the run would take the profile's 1 GPU per node."""
    asked: list[str] = []

    def slurm_says(job: str, timeout: float | None = None) -> int:
        asked.append(job)
        return 4

    monkeypatch.setattr(allocation, "gpus_per_node", slurm_says)
    assert held(SALLOC).gpus_per_node == 4 and asked == ["41"]
    assert held({**SALLOC, "SLURM_GPUS_PER_NODE": "2"}).gpus_per_node == 2 and asked == ["41"]


LOST = {"event": "bad_node", "attempt": 0, "node": 1, "slurm_node": "n2", "reason": "lost: silent for 8 s"}


@pytest.mark.parametrize("records,running,want", [
    ([LOST], [0, 1, 2], [0, 2]),  # the frozen node's file stays: not waited for
    ([LOST], [1], []),  # the kept ones have ended
    ([{**LOST, "attempt": 1}], [1], [1]),  # an older attempt's loss
    ([{**LOST, "reason": "health check: bad"}], [1], [1]),  # its launcher ends by itself
    ([], [], []),
])
def test_the_step_waits_for_the_kept_launchers_only(records: list[dict[str, Any]], running: list[int],
                                                    want: list[int]) -> None:
    assert waiting_on(records, 0, running) == want


@pytest.mark.parametrize("closed_for,gone_for,due", [
    (None, None, False),  # the run goes on
    (None, 5.0, False),
    (0.0, None, False),  # closed, a kept launcher still saving its last word
    (0.0, 0.0, False),  # all gone just now: their interpreters are still shutting down
    (3.0, 3.0, True),  # gone for SETTLE_S
    (29.0, None, False),
    (30.0, None, True),  # one killed with -9 (its file stays): OTHERS_WAIT_S is enough
])
def test_the_step_ends_once_the_kept_launchers_left_or_had_their_time(
        closed_for: float | None, gone_for: float | None, due: bool) -> None:
    assert end_due(closed_for, gone_for, wait_s=30.0, settle_s=3.0) is due


def closed_run(tmp_path: Path) -> Path:
    """A run done on its spare after node 1 (n2) froze: node 1's pid file stays."""
    run = tmp_path / "run"
    (run / "launch").mkdir(parents=True)
    pid_file(run, 1).write_text('{"pid": 1}\n')
    for event in (events.BadNode(attempt=0, cycle=0, node=1, slurm_node="n2", reason="lost: silent"),
                  events.End(attempt=0, reason=EndReason.DONE, saved_step=8, saved="step-8")):
        ledger.append(run, event)
    return run


def seen_leave(ender: StepEnd, run: Path, kept: tuple[int, ...]) -> None:
    """The kept launchers' pid files, seen by the command (one poll), then removed as they leave."""
    for k in kept:
        pid_file(run, k).write_text(f'{{"pid": {k}}}\n')
    ender.poll()
    for k in kept:
        pid_file(run, k).unlink()


ALLOC3 = Held(job_id="41", nodes=["n1", "n2", "n3"], gpus_per_node=None)


@pytest.mark.parametrize("answer,state,nodes,cancelled,done", [
    (["41.0"], "RUNNING", "n[1-3]", ["41.0"], True),
    (None, "RUNNING", "n[1-3]", [], False),  # Slurm did not answer: asked again next poll
    ([], "RUNNING", "n[1-3]", [], True),  # the step is gone: srun ends by itself
    (["41.0"], "COMPLETED", "n[1-3]", [], True),  # the allocation ended
    (["41.0"], "RUNNING", "n[1,3]", [], True),  # n2 left it (Slurm ended its task)
    (["41.0"], None, "", ["41.0"], True),  # scontrol did not answer: as the release helper, it acts
])
def test_the_command_cancels_its_step_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: list[str] | None, state: str | None,
        nodes: str, cancelled: list[str], done: bool) -> None:
    run = closed_run(tmp_path)
    asked: list[tuple[str, str]] = []
    sent: list[tuple[str, ...]] = []
    info = None if state is None else cluster.JobInfo(job="41", state=JobState(state), state_text=state,
                                                      nodes=nodes)

    def run_steps(job: str, name: str, timeout: float | None = None) -> list[str] | None:
        asked.append((job, name))
        return answer

    monkeypatch.setattr(steps, "run_steps", run_steps)
    monkeypatch.setattr(cluster, "show_job", lambda job, timeout=None: info)
    monkeypatch.setattr(cluster, "scancel", lambda *a: sent.append(a))
    monkeypatch.setattr(allocation, "SETTLE_S", 0.0)
    ender = StepEnd(run, ALLOC3, "hpcshard-r-1", 0, 3)
    seen_leave(ender, run, (0, 2))
    ender.poll()
    assert asked == [("41", "hpcshard-r-1")] and sent == [(s,) for s in cancelled] and ender.done is done
    said = [r for r in ledger.read(run) if r["event"] == "cancel"]
    assert [r["job"] for r in said] == cancelled  # recorded: status and the report say why
    ender.poll()
    assert len(asked) == (1 if done else 2)  # it acts once


def test_the_command_waits_for_the_kept_launchers_and_says_a_refused_cancel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = closed_run(tmp_path)
    pid_file(run, 0).write_text('{"pid": 0}\n')
    pid_file(run, 2).write_text('{"pid": 2}\n')  # n3's launcher still writing its last word
    monkeypatch.setattr(steps, "run_steps", lambda job, name, timeout=None: ["41.0"])
    monkeypatch.setattr(cluster, "show_job", lambda job, timeout=None: None)

    def refused(*args: str) -> None:
        raise cluster.SlurmError("scancel 41.0: Access/permission denied")

    monkeypatch.setattr(cluster, "scancel", refused)
    monkeypatch.setattr(allocation, "SETTLE_S", 0.0)
    ender = StepEnd(run, ALLOC3, "s", 0, 3)
    ender.poll()
    assert not ender.done and ender.closed is not None and ender.gone is None
    pid_file(run, 0).unlink()
    pid_file(run, 2).unlink()
    ender.poll()
    assert ender.done
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "41.0" in x]
    assert "not cancelled (scancel 41.0: Access/permission denied)" in line and "`scancel 41.0`" in line
    assert not [r for r in ledger.read(run) if r["event"] == "cancel"]

def step_end_stand_ins(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[tuple[str, ...]]]:
    """StepEnd's world, stood in: a monotonic clock the test sets (`now[0]`), step 41.0
    found by its name, Slurm silent about the allocation, and each scancel's arguments
    recorded (`sent`)."""
    now = [0.0]
    monkeypatch.setattr(allocation.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(steps, "run_steps", lambda job, name, timeout=None: ["41.0"])
    monkeypatch.setattr(cluster, "show_job", lambda job, timeout=None: None)
    sent: list[tuple[str, ...]] = []
    monkeypatch.setattr(cluster, "scancel", lambda *a: sent.append(a))
    return now, sent



def test_a_restart_after_a_rank_crashed_is_not_the_runs_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """n2 froze, the spare took its place (cycle 1); then rank 0 raised (a peer's death:
    its own `end` record, error) and the launchers restart the cycle: loading the newest
    checkpoint may take minutes (66 s on NFS-like storage). The command must not cancel
    the step meanwhile (OTHERS_WAIT_S is for launchers gone, not a run going on), nor at
    the real end before the kept launchers have left."""
    run = tmp_path / "run"
    (run / "launch").mkdir(parents=True)
    for k in (0, 1, 2):  # (1: the frozen node's, where it froze)
        pid_file(run, k).write_text(f'{{"pid": {k}}}\n')
    for event in (events.BadNode(attempt=0, cycle=0, node=1, slurm_node="n2", reason="lost: silent"),
                  events.End(attempt=0, cycle=1, reason=EndReason.ERROR,
                             error="DistBackendError: Connection closed by peer")):
        ledger.append(run, event)
    now, sent = step_end_stand_ins(monkeypatch)
    ender = StepEnd(run, ALLOC3, "s", 0, 3)
    for now[0] in (0.0, 1.0, 31.0, 60.0):  # the restart: ranks start, the checkpoint loads
        ender.poll()
    assert sent == []
    ledger.append(run, events.Start(attempt=0, cycle=2, world=2, nodes=2, host="n1"))
    ender.poll()
    ledger.append(run, events.End(attempt=0, cycle=2, reason=EndReason.DONE, step=9, saved_step=9))
    now[0] = 600.0
    ender.poll()
    assert sent == []  # the kept launchers are still leaving
    for k in (0, 2):
        pid_file(run, k).unlink()
    for now[0] in (601.0, 604.0):
        ender.poll()
    assert sent == [("41.0",)]


def test_the_wait_for_the_kept_launchers_starts_at_the_latest_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close the ledger then takes back (a record after it says the run goes on) does not
    count toward OTHERS_WAIT_S at the next one: that one waits for its launchers anew."""
    run = closed_run(tmp_path)
    pid_file(run, 0).write_text('{"pid": 0}\n')
    over = release.Release(keep=("n1", "n3"), lost=("n2",), outcome="done")
    says: list[release.Release | None] = [over, None, over, over]
    monkeypatch.setattr(release, "plan", lambda *a, **k: says.pop(0))
    now, sent = step_end_stand_ins(monkeypatch)
    ender = StepEnd(run, ALLOC3, "s", 0, 3)
    for now[0] in (0.0, 10.0, 40.0):
        ender.poll()
    assert sent == [] and ender.closed == 40.0
    now[0] = 70.0
    ender.poll()  # (launcher 0 killed with -9: its file stays)
    assert sent == [("41.0",)]


def test_a_pid_file_this_host_never_saw_is_not_a_launcher_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept launchers run on n1 and n3 and wrote their pid files there; NFS's lookup
    cache hides the new names from the command's host for up to a minute. Not seeing them
    is not their end: the command gives them OTHERS_WAIT_S, and cancels the step no sooner
    (the tasks still running would be killed, srun reporting 137)."""
    run = closed_run(tmp_path)  # (only the frozen node's file reads here)
    now, sent = step_end_stand_ins(monkeypatch)
    ender = StepEnd(run, ALLOC3, "s", 0, 3)
    for now[0] in (0.0, 1.0, 4.0, 10.0, 29.0):
        ender.poll()
    assert sent == [] and ender.gone is None
    now[0] = 30.0
    ender.poll()
    assert sent == [("41.0",)]
