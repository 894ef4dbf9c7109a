"""The one request builder (`cli.request`): `render`, `submit`, `resume` and `sweep` build
their typed requests with it, without creating, running or asking anything; the one place a
request is scheduled; bad input caught once, at the command line's edge."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hpcshard import site
from hpcshard.cli import BadInput, main, request
from hpcshard.errors import JobCrashed, UserError
from hpcshard.launch import backends
from hpcshard.rundir import lease
from hpcshard.rundir.spec import Resolved, RunSpec
from hpcshard.slurm.sbatch import SbatchRequest
from tests.conftest import ROOT

JOB = str(ROOT / "jobs" / "charlm.py")


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a request runs nothing: no preflight, no Slurm command."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def resolved(**cli: Any) -> site.Resolved:
    return site.resolve(site.load(), None, cli)


def test_a_new_slurm_request_is_typed_and_made_of_nothing(tmp_path: Path, no_processes: None) -> None:
    run_dir = tmp_path / "r"
    req = request.new(resolved(gpus_per_node=2, time="00:30:00"), JOB, nodes=3,
                      backend=backends.SLURM, run_dir=run_dir, sets=("steps=7",))
    assert isinstance(req.sbatch, SbatchRequest) and req.backend.in_queue and req.fresh
    assert (req.sbatch.nodes, req.sbatch.gpus_per_node, req.sbatch.time) == (3, 2, "00:30:00")
    assert req.sbatch.run_dir == run_dir.resolve()
    assert (req.spec.nodes, req.spec.gpus, req.spec.sets["steps"]) == (3, 2, "7")
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []  # nothing made


def test_a_local_request_has_no_sbatch_and_a_script_keeps_its_arguments(tmp_path: Path,
                                                                      no_processes: None) -> None:
    own = tmp_path / "train.py"
    own.write_text("print('hi')\n")
    req = request.new(resolved(), str(own), args=("--lr", "3"), nodes=1,
                      backend=backends.LOCAL, run_dir=tmp_path / "r")
    assert req.sbatch is None and not req.backend.in_queue
    assert req.spec.script is not None
    assert req.spec.script.args == ("--lr", "3") and req.spec.script.kind == "file"
    assert req.spec.sets == {}


def test_resume_asks_for_the_same_sbatch_settings_on_the_new_shape(tmp_path: Path,
                                                                   no_processes: None) -> None:
    first = request.new(resolved(gpus_per_node=2, cpus_per_gpu=4, partition="p"), JOB,
                        nodes=2, backend=backends.SLURM, run_dir=tmp_path / "r")
    assert first.sbatch is not None
    (tmp_path / "r").mkdir()
    spec = first.spec
    spec.slurm = {**first.sbatch.__dict__, "run_dir": str(first.sbatch.run_dir)}
    spec.jobs = ["5"]
    again = request.again(spec, tmp_path / "r", nodes=4, gpus=1, sets=("lr=1e-3",))
    assert again.sbatch is not None and not again.fresh
    assert (again.sbatch.nodes, again.sbatch.gpus_per_node, again.sbatch.cpus_per_task) == (4, 1, 4)
    assert again.sbatch.partition == "p" and again.spec.sets["lr"] == "1e-3"


def test_a_sweeps_tasks_share_one_array_request(tmp_path: Path, no_processes: None) -> None:
    asked = request.tasks(resolved(), JOB, [{"lr": "1"}, {"lr": "2"}], nodes=1, backend=backends.SLURM,
                          root=tmp_path / "s", name="s", max_parallel=1)
    runs, array = asked.runs, asked.array
    assert array is not None and array.array == "0-1%1" and array.requeue
    assert [r.run_dir.name for r in runs] == ["task-0", "task-1"]
    assert [r.spec.sets["lr"] for r in runs] == ["1", "2"] and all(r.sbatch is array for r in runs)
    assert [r.spec.name for r in runs] == ["s-0", "s-1"]


@pytest.mark.parametrize(("call", "needle"), [
    (lambda t: request.new(resolved(min_nodes=3), JOB, nodes=2,
                           backend=backends.LOCAL, run_dir=t / "r"), "--min-nodes 3 is more than --nodes 2"),
    (lambda t: request.tasks(resolved(spares=1), JOB, [{}], nodes=1,
                             backend=backends.LOCAL, root=t / "s", name="s"), "do not take spares"),
    (lambda t: request.tasks(resolved(requeue_policy="chain"), JOB, [{}], nodes=1,
                             backend=backends.LOCAL, root=t / "s", name="s"), "--requeue-policy chain"),
    (lambda t: request.Target.parse(None), "nothing to run"),
])
def test_bad_input_is_a_user_error(tmp_path: Path, call: Any, needle: str, no_processes: None) -> None:
    with pytest.raises(UserError, match=needle):
        call(tmp_path)


def test_the_schedule_runs_a_local_request_through_its_backend(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[Any, ...]] = []

    def run(self: Any, spec: RunSpec, run_dir: Path, resume: str, owner: str, on_attempt: Any) -> int:
        ran.append((spec.name, run_dir, resume, owner))
        return 0

    monkeypatch.setattr(backends.Backend, "run", run)
    req = request.new(resolved(), JOB, nodes=1, backend=backends.LOCAL,
                      run_dir=tmp_path / "r", resume="never")
    req.spec.resolved = Resolved(sharding="full", blocks=1, block="B", params=1)
    (tmp_path / "r").mkdir()
    claim = request.take_run(req.run_dir, "test")
    assert request.schedule(req, claim) == 0
    assert ran == [("charlm", tmp_path / "r", "never", claim.token)]
    assert RunSpec.read(tmp_path / "r").name == "charlm"
    assert lease.read(tmp_path / "r") is None  # given back once the run ended here


def test_the_schedule_submits_a_slurm_request_and_hands_the_run_to_its_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    submitted: list[tuple[Any, ...]] = []

    def submit(*args: Any) -> str:
        submitted.append(args)
        return "42"

    monkeypatch.setattr("hpcshard.slurm.submit.submit", submit)
    req = request.new(resolved(), JOB, nodes=2, backend=backends.SLURM,
                      run_dir=tmp_path / "r")
    req.spec.resolved = Resolved(sharding="full", blocks=1, block="B", params=1)
    (tmp_path / "r").mkdir()
    assert request.schedule(req, request.take_run(req.run_dir, "test")) == 0
    sbatch, run_dir, _fn, *args = submitted[0]
    assert sbatch is req.sbatch and run_dir == (tmp_path / "r").resolve()
    policy = "requeue" if req.sbatch is not None and req.sbatch.requeue else req.spec.requeue_policy
    assert args == [str(run_dir), 1, 0, req.spec.max_requeues, "auto", policy]
    owner = lease.read(tmp_path / "r")
    assert owner is not None and owner.job == "42"
    assert RunSpec.read(tmp_path / "r").jobs == ["42"]
    assert "submitted job 42: 2 node(s)" in capsys.readouterr().out


def test_a_refused_submission_removes_the_run_directory_made_for_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any) -> str:
        raise ValueError("sbatch refused the job: no partition")

    monkeypatch.setattr("hpcshard.slurm.submit.submit", refuse)
    req = request.new(resolved(), JOB, nodes=1, backend=backends.SLURM,
                      run_dir=tmp_path / "r")
    req.spec.resolved = Resolved(sharding="full", blocks=1, block="B", params=1)
    (tmp_path / "r").mkdir()
    with pytest.raises(ValueError, match="no partition"):
        request.schedule(req, request.take_run(req.run_dir, "test"))
    assert not (tmp_path / "r").exists()


# -- the command line's edge ------------------------------------------------------------------


@pytest.fixture
def command(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """A command `boom` in the group that raises what the test puts in the list."""
    raised: list[BaseException] = []

    @click.command()
    def boom() -> None:
        raise raised[0]

    from hpcshard import cli

    monkeypatch.setitem(cli.COMMANDS, "boom", ("x:boom", "raises"))
    monkeypatch.setattr(cli.LazyGroup, "get_command",
                        lambda self, ctx, name: boom if name == "boom" else None)
    return raised


def test_the_edge_makes_bad_input_one_line_with_the_user_errors_exit_code(
        command: list[BaseException]) -> None:
    assert BadInput.exit_code == UserError.exit_code == 2
    for err in (UserError("--nodes 0: give at least 1"), ValueError("--nodes 0: give at least 1")):
        command[:] = [err]
        result = CliRunner().invoke(main, ["boom"])
        assert result.exit_code == 2 and result.output == "Error: --nodes 0: give at least 1\n"


def test_the_edge_prints_a_crashed_jobs_traceback_and_leaves_bugs_as_tracebacks(
        command: list[BaseException]) -> None:
    command[:] = [JobCrashed("preflight of j crashed:\nTraceback ...\nZeroDivisionError")]
    result = CliRunner().invoke(main, ["boom"])
    assert result.exit_code == JobCrashed.exit_code == 1 and "ZeroDivisionError" in result.output
    command[:] = [RuntimeError("a bug")]
    result = CliRunner().invoke(main, ["boom"])
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "a bug"


def exits_outside_commands(source: str) -> list[int]:
    """Lines that leave the process (sys.exit, SystemExit, os._exit) or raise click's own
    exceptions in a function that is not a click command."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if any("command" in ast.unparse(d) for d in fn.decorator_list):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call | ast.Raise):
                continue
            if ast.unparse(node).startswith(("sys.exit(", "os._exit(", "raise SystemExit", "raise click.",
                                "ctx.exit(", "raise BadInput")):
                found.append(node.lineno)
    return found


def test_the_source_walk_finds_an_exit_in_a_helper() -> None:
    assert exits_outside_commands("import sys\ndef f():\n    sys.exit(1)\n") == [3]
    assert exits_outside_commands("def f():\n    raise SystemExit(2)\n") == [2]
    assert exits_outside_commands("@click.command()\ndef f():\n    sys.exit(1)\n") == []


def test_no_helper_of_the_command_line_exits() -> None:
    """Control leaves a command through its return or an exception, caught once at the
    edge: no helper exits on the command's behalf (the edge itself, `LazyGroup.invoke`,
    is the one place)."""
    found = []
    for path in sorted((ROOT / "hpcshard" / "cli").glob("*.py")):
        if path.name == "__init__.py":
            continue
        found += [f"{path.relative_to(ROOT)}:{n}" for n in exits_outside_commands(path.read_text())]
    assert not found, found


def test_auto_asks_slurm_only_after_every_check_of_the_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            no_processes: None) -> None:
    """A missing secret, a foreign run directory: one line, before `scontrol ping` (up to
    15 s where no controller answers) is run."""
    def asked() -> bool:
        raise AssertionError("Slurm was asked before the input was checked")

    monkeypatch.setattr("hpcshard.slurm.cluster.available", asked)
    monkeypatch.delenv("MY_TOKEN", raising=False)
    with pytest.raises(UserError, match="MY_TOKEN is not set"):
        request.new(resolved(secrets=["MY_TOKEN"]), JOB, nodes=1, backend="auto", run_dir=tmp_path / "r")
    with pytest.raises(UserError, match="MY_TOKEN is not set"):
        request.tasks(resolved(secrets=["MY_TOKEN"]), JOB, [{}], nodes=1, backend="auto", root=tmp_path / "s")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="is not empty"):
        request.new(resolved(), JOB, nodes=1, backend="auto", run_dir=tmp_path / "full")


def test_a_log_followed_across_a_character_cut_in_two_and_a_byte_that_is_not_utf8(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcshard.cli.common import follow_log

    log = tmp_path / "rank-0.log"
    parts = iter([b"step 1 \xc3", b"\xa9t\xc3\xa9 \xff\n"])  # "été", the é cut between two reads

    def done() -> tuple[bool, str]:
        with log.open("ab") as f:
            f.write(next(parts, b""))
        return log.stat().st_size == 15, ""

    log.write_bytes(b"")
    follow_log(log, done, interval=0)
    assert capsys.readouterr().out == "step 1 \u00e9t\u00e9 \ufffd\n"


def test_the_edge_leaves_a_corrupt_file_that_no_check_read_as_a_traceback(
        command: list[BaseException]) -> None:
    import json

    for err in (json.JSONDecodeError("Expecting value", "{", 1),
                UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")):
        command[:] = [err]
        result = CliRunner().invoke(main, ["boom"])
        assert result.exit_code == 1 and result.exception is err


def test_the_local_backends_nodes_are_local_and_a_slurm_jobs_are_not(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """The policy's `local` fact (no other node to be given; the command requeues) comes
    from who started the launcher: `launch.local` runs `python -m hpcshard.launch.node`."""
    from hpcshard.launch import node

    seen: list[bool] = []
    def run_node(*args: Any, local: bool = False, **kwargs: Any) -> int:
        seen.append(local)
        return 0

    monkeypatch.setattr(node, "run_node", run_node)
    monkeypatch.setattr(node.NodeEnv, "from_environ", classmethod(lambda cls: None))
    monkeypatch.setattr("sys.argv", ["node", str(tmp_path)])
    node.main()
    assert seen == [True]
    import inspect

    from hpcshard.launch import slurm

    assert "local=" not in inspect.getsource(slurm)  # its run_node call keeps the default, False
    assert inspect.signature(node.run_node).parameters["local"].default is False
