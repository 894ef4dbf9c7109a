"""Chains of runs (`rundir.chain`, `cli.chain`): `--after` and `--then` parsed, what a run's
ledger says of its end, what a dependent waits for, what a `--then` step decides when it
starts, and bad input refused in one line with nothing made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcshard.errors import UserError
from hpcshard.rundir import ledger
from hpcshard.rundir.chain import (
    After,
    Chain,
    Then,
    check_fresh,
    decide_then,
    depend_on_run,
    done_step,
    job_exit,
    parse_after,
    parse_then,
    status_lines,
    verdict,
)
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm.sbatch import SbatchRequest
from hpcshard.slurm.submit import sbatch_text
from tests.unit.test_cli_submit import JOB, assert_one_line_error, invoke


@pytest.mark.parametrize("text,expected", [
    ("runs/a", ("afterok", "runs/a")),
    ("123", ("afterok", "123")),
    ("afterany:runs/a", ("afterany", "runs/a")),
    ("afternotok:77", ("afternotok", "77")),
    ("runs/a:b", ("afterok", "runs/a:b")),  # a colon in a path is the path's
])
def test_after_is_kind_and_target(text: str, expected: tuple[str, str]) -> None:
    assert parse_after(text) == expected


@pytest.mark.parametrize("text,needle", [("afterall:runs/a", "'afterall'"), ("", "run directory")])
def test_a_bad_after_is_one_line(text: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        parse_after(text)


def test_then_takes_eval_or_an_export_directory_that_is_new_or_empty(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    steps = parse_then([f"export-hf={tmp_path / 'new'}", f"export-hf:{tmp_path / 'empty'}", "eval"])
    assert [(s.what, s.dir) for s in steps] == [("export-hf", str(tmp_path / "new")),
                                                ("export-hf", str(tmp_path / "empty")), ("eval", "")]
    for bad, needle in [([f"export-hf={tmp_path / 'full'}"], "not an empty directory"),
                        (["export-hf"], "needs the directory"), (["convert=x"], "valid: export-hf=DIR, eval"),
                        (["eval=x"], "takes nothing more"),
                        ([f"export-hf={tmp_path / 'n'}"] * 2, "given twice")]:
        with pytest.raises(UserError, match=needle):
            parse_then(bad)


def rec(event: str, attempt: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "attempt": attempt, **fields}


START0, START1 = rec("start", 0), rec("start", 1)


ENDINGS = [
    ([], None),
    ([START0], None),  # training, or killed: Slurm says which
    ([START0, rec("end", 0, reason="done", step=30)], "done"),
    ([START0, rec("end", 0, reason="stop"), rec("requeue", 0, job="5")], None),  # a requeue comes
    ([START0, rec("end", 0, reason="stop"), rec("chain", 0, job="5", next="6")], None),
    ([START0, rec("guard", 0, job="5", next="7", state="NODE_FAIL")], None),
    ([START0, rec("end", 0, reason="stop")], "stop"),  # requeue_policy none: waits for resume
    ([START0, rec("end", 0, reason="error"), rec("gave_up", 0, reason="a bug")], "gave up: a bug"),
    # the leader's stop written after another launcher's requeue: still requeued
    ([START0, rec("requeue", 0, job="5"), rec("end", 0, reason="stop")], None),
    # a requeue left to the batch script, whose actions could not be written: it never comes
    ([START0, rec("end", 0, reason="stop"), rec("requeue", 0, job="5", host=True),
      rec("gave_up", 0, reason="the batch script's actions could not be written")],
     "gave up: the batch script's actions could not be written"),
    # a give-up a guard job then took over from: the run goes on
    ([START0, rec("gave_up", 0, reason="x"), rec("guard", 0, job="5", next="7", state="FAILED")], None),
    ([START0, rec("end", 0, reason="error")], "error"),
    # the newest attempt decides: an old done does not stand for a resumed run's end
    ([START0, rec("end", 0, reason="done"), START1], None),
    ([START0, rec("end", 0, reason="stop"), rec("requeue", 0, job="5"), START1,
      rec("end", 1, reason="done", step=30)], "done"),
    # rank 0's end of a cycle the launchers restart in place (a peer died) closes that cycle
    # only: the restart decided (its fault record), then the next cycle's start
    ([START0, rec("end", 0, reason="error", cycle=0), rec("fault", 0, cycle=0, restart=True)], None),
    ([START0, rec("end", 0, reason="error", cycle=0), rec("start", 0, cycle=1)], None),
    ([START0, rec("end", 0, reason="error", cycle=0), rec("start", 0, cycle=1),
      rec("end", 0, reason="done", cycle=1, step=30)], "done"),
    ([START0, rec("end", 0, reason="error", cycle=0), rec("fault", 0, cycle=0, restart=False, end="bug"),
      rec("end", 0, reason="bug", cycle=0)], "bug"),
]


@pytest.mark.parametrize("records,expected", ENDINGS)
def test_the_ledger_says_how_a_run_ended(records: list[dict[str, Any]], expected: str | None) -> None:
    assert verdict(records) == expected


@pytest.mark.parametrize("records,expected", ENDINGS)
def test_a_job_fails_only_when_its_run_ended_other_than_done(records: list[dict[str, Any]],
                                                            expected: str | None) -> None:
    """Slurm's afterok/afternotok on a run's job mean what the run did: a run that goes on
    (requeued, continued, taken over) or ended done leaves its job COMPLETED (exit 0); an
    error, a stop nobody continues or a give-up, FAILED (exit 1)."""
    assert job_exit(records) == (0 if expected in (None, "done") else 1)


@pytest.mark.parametrize("records,expected", ENDINGS)
def test_follow_stops_where_the_verdict_is_final(records: list[dict[str, Any]], expected: str | None) -> None:
    """`submit --follow` (`ledger.finished`) and what waits for the run (`verdict`) agree on
    when it ended for good: done, or given up (a stop or an error is for Slurm's word)."""
    final = expected is not None and (expected == "done" or expected.startswith("gave up"))
    assert (ledger.finished(records, 0) is not None) == final


def test_done_step_is_the_last_done_end() -> None:
    assert done_step([START0, rec("end", 0, reason="done", step=30)]) == 30
    assert done_step([START0, rec("end", 0, reason="stop", step=10)]) is None


@pytest.mark.parametrize("kind,ended,newest,over,expected", [
    ("afterok", None, "12", False, "12"),  # going: wait for its newest job
    ("afterany", None, "12", False, "12"),
    ("afterok", "done", "12", True, ""),  # ended done: nothing to wait for
    ("afterany", "error", "12", True, ""),
    ("afternotok", "error", "12", True, ""),
    ("afterok", "error", "12", True, "never"),
    ("afternotok", "done", "12", True, "never"),
    ("afterok", None, "12", None, "did not answer"),
    ("afterok", None, "12", True, "is over and the run did not finish"),
    ("afterok", None, None, None, "local backend"),
])
def test_a_run_is_waited_for_through_its_newest_job(kind: str, ended: str | None, newest: str | None,
                                                    over: bool | None, expected: str) -> None:
    if expected.isdigit() or expected == "":
        assert depend_on_run(kind, "runs/a", ended, newest, over) == expected
    else:
        with pytest.raises(UserError, match=expected):
            depend_on_run(kind, "runs/a", ended, newest, over)


@pytest.mark.parametrize("ended,carriers,newest,action,what", [
    ("done", [], "12", "go", None),
    ("done", None, "12", "go", None),
    (None, ["13"], "13", "wait", ["13"]),  # continued as job 13: wait for it
    (None, ["12", "14"], "12", "wait", ["12", "14"]),  # requeued, or its guard may take over
    (None, None, "12", "wait", ["12"]),  # Slurm did not answer: never taken for over
    (None, [], "12", "skip", "did not finish"),  # killed from outside, nothing carries it
    ("error", [], "12", "skip", "ended error"),
    ("stop", [], "12", "skip", "ended stop"),
])
def test_a_then_step_goes_only_once_the_run_ended_done(ended: str | None, carriers: list[str] | None,
                                                       newest: str, action: str, what: Any) -> None:
    got, said = decide_then(ended, carriers, newest)
    assert got == action
    assert said == what if not isinstance(what, str) else what in said


@pytest.mark.parametrize("done,newest,needle", [
    (30, 30, ""), (30, 20, "step 20, not the step the run finished at (30)"),
    (30, None, "no committed checkpoint"), (None, 30, "records no step"),
])
def test_a_stale_checkpoint_is_never_the_end(done: int | None, newest: int | None, needle: str) -> None:
    said = check_fresh(done, newest)
    assert (needle in said) if needle else said == ""


def test_the_chain_file_round_trips_and_shows_in_status(tmp_path: Path) -> None:
    chain = Chain(after=After(kind="afterok", target="runs/a", job="12", run="/r/a"),
                  then=[Then(what="export-hf", dir="/out", jobs=["20", "22"], state="waiting",
                             said="the run goes on: for job 21")])
    chain.write(tmp_path)
    Chain.update(tmp_path, lambda c: c.followers.append({"job": "30", "kind": "afterok", "run": "/r/b"}))
    back = Chain.read(tmp_path)
    assert back.after == chain.after and back.then == chain.then and len(back.followers) == 1
    lines = status_lines(back, {"12": "RUNNING", "22": "PENDING"})
    assert lines == ["after: afterok /r/a (job 12 RUNNING)",
                     "then: export-hf /out: waiting: the run goes on: for job 21 [job 22 PENDING]",
                     "followed by: /r/b (afterok, job 30 unknown)"]
    assert Chain.read(tmp_path / "none") == Chain()


def test_the_dependency_reaches_the_script_checked(tmp_path: Path) -> None:
    req = SbatchRequest(job_name="a", nodes=1, gpus_per_node=0, run_dir=tmp_path, dependency="afterok:12")
    assert "#SBATCH --dependency=afterok:12\n" in sbatch_text(req, tmp_path)
    assert "--dependency" not in sbatch_text(SbatchRequest(job_name="a", nodes=1, gpus_per_node=0,
                                                           run_dir=tmp_path), tmp_path)
    for bad in ("afterok:12; echo pwned", "afterok:", "after:12", "afterok:12\nb"):
        with pytest.raises(ValueError, match="dependency"):
            SbatchRequest(job_name="a", nodes=1, gpus_per_node=0, dependency=bad).validate()


def test_bad_chains_are_one_line_and_nothing_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    run = tmp_path / "r"
    for args, needles in [
        (["--backend", "local", "--after", "123"], ["local backend"]),
        (["--backend", "local", "--then", f"export-hf={full}"], ["not an empty directory"]),
        (["--backend", "slurm", "--after", str(tmp_path / "missing")], ["neither a run directory"]),
    ]:
        assert_one_line_error(*invoke("submit", JOB, "--run-dir", str(run), *args), *needles)
        assert not run.exists()
    # An unknown job: Slurm's answer, asked once.
    monkeypatch.setattr(cluster, "query_job",
                        lambda job, timeout=None: cluster.JobQuery(job, cluster.Said.NO_SUCH_JOB))
    assert_one_line_error(*invoke("submit", JOB, "--run-dir", str(run), "--backend", "slurm",
                                  "--after", "999"), "Slurm does not know job 999")
    assert not run.exists()


def test_a_run_named_by_after_is_waited_for_through_its_newest_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A continued run: the dependency is on its newest job, not the one it began with."""
    from hpcshard.cli.chain import resolve
    from hpcshard.slurm import cluster

    up = tmp_path / "up"
    up.mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="up", backend="slurm",
            jobs=["5", "9"]).write(up)
    (up / "attempts.jsonl").write_text(json.dumps(rec("start", 0)) + "\n")
    asked: list[str] = []

    def query(job: str, timeout: float | None = None) -> cluster.JobQuery:
        asked.append(job)
        running = cluster.JobInfo(job, cluster.JobState.RUNNING, "RUNNING")
        return cluster.JobQuery(job, cluster.Said.KNOWN, running)

    monkeypatch.setattr(cluster, "query_job", query)
    assert resolve(f"afterany:{up}") == After(kind="afterany", target=str(up), job="9", run=str(up.resolve()))
    assert asked == ["9"]


def test_a_continuation_moves_every_follower_onto_the_new_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`launch.slurm.chain` and a guard's take-over call `carry`: what waited for the old job
    waits for the new one, each with its own kind; one that cannot be moved is said."""
    from hpcshard.launch import then
    from hpcshard.slurm import cluster

    Chain(followers=[{"job": "20", "kind": "afterany", "run": ""},
                     {"job": "30", "kind": "afterok", "run": "/r/b"}]).write(tmp_path)
    moved: list[tuple[str, str]] = []

    def depend(job: str, dependency: str) -> None:
        if job == "20":
            raise cluster.SlurmError("Job has already started")
        moved.append((job, dependency))

    monkeypatch.setattr(cluster, "depend", depend)
    said = then.carry(tmp_path, "12", "13")
    assert moved == [("30", "afterok:13")]
    assert said == ["follower 20 still waits on 12: Job has already started"]
    # `resume` moves them the same way (chain.resumed), with a note for a run's job alone (a
    # `--then` step's job has long started)
    from hpcshard.cli import chain

    Chain(followers=[{"job": "20", "kind": "afterany", "run": ""},
                     {"job": "40", "kind": "afterok", "run": "/r/c"},
                     {"job": "30", "kind": "afterok", "run": "/r/b"}]).write(tmp_path)
    monkeypatch.setattr(cluster, "depend", lambda job, dependency: depend(
        job, dependency) if job != "40" else depend("20", dependency))
    moved.clear()
    chain.resumed(tmp_path, "14")
    assert moved == [("30", "afterok:14")]
    assert capsys.readouterr().err == ("note: /r/c (job 40) was not moved onto job 14: Job has already "
                                       "started\n")


def test_a_then_step_waits_again_or_skips_as_the_ledger_says(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Started after job 12 ended: the run went on as job 13, so the step waits for 13 as a
    new job of its script; once the run has ended in an error, it is skipped, with why."""
    from hpcshard.launch import then
    from hpcshard.slurm import cluster

    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="r", backend="slurm",
            jobs=["12", "13"]).write(tmp_path)
    Chain(then=[Then(what="export-hf", dir=str(tmp_path / "out"), jobs=["20"])]).write(tmp_path)
    (tmp_path / "then").mkdir()
    (tmp_path / "then" / "then-0.sh").write_text("#!/bin/bash\n")
    led = tmp_path / "attempts.jsonl"
    led.write_text("".join(json.dumps(r) + "\n" for r in [
        START0, rec("end", 0, reason="stop"), rec("chain", 0, job="12", next="13")]))
    monkeypatch.setattr(then, "carriers", lambda spec, run_dir: ["13"])
    sent: list[tuple[str, ...]] = []
    def sbatch(*args: str, **kw: object) -> str:
        sent.append(args)
        return "21"

    monkeypatch.setattr(cluster, "sbatch", sbatch)
    assert then.run_step(tmp_path, 0, job="20") == 0
    assert sent == [("--dependency=afterany:13", str(tmp_path / "then" / "then-0.sh"))]
    step = Chain.read(tmp_path).then[0]
    assert (step.state, step.jobs) == ("waiting", ["20", "21"])
    with led.open("a") as f:
        f.write(json.dumps(START1) + "\n" + json.dumps(rec("end", 1, reason="error")) + "\n")
    assert then.run_step(tmp_path, 0, job="21") == 1
    step = Chain.read(tmp_path).then[0]
    assert step.state == "skipped" and "ended error" in step.said and len(sent) == 1


def test_a_follower_registered_after_the_run_went_on_is_moved_by_its_submit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--after RUN`: sbatch made job 40 wait on job 5; before 40 was written into the run's
    chain.json, the run went on as job 9 (a continuation moves the followers it finds:
    not this one). The submit sees the newer job once it has registered and moves 40 itself
    (else 40 waits on a job that ends in a stop, never to start or at the wrong time)."""
    from hpcshard.cli.chain import submitted
    from hpcshard.slurm import cluster

    up, new = tmp_path / "up", tmp_path / "new"
    up.mkdir()
    new.mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="up", backend="slurm",
            jobs=["5", "9"]).write(up)
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="new", backend="slurm").write(new)
    moved: list[tuple[str, str]] = []
    monkeypatch.setattr(cluster, "depend", lambda job, dependency: moved.append((job, dependency)))
    submitted(new, After(kind="afterok", target=str(up), job="5", run=str(up.resolve())), "40")
    assert Chain.read(up).followers == [{"job": "40", "kind": "afterok", "run": str(new.resolve())}]
    assert moved == [("40", "afterok:9")]
    moved.clear()  # the run still on the job the dependency names: nothing to move
    submitted(new, After(kind="afterok", target=str(up), job="9", run=str(up.resolve())), "41")
    assert moved == []


def test_after_a_job_array_waits_for_the_whole_array_not_the_task_scontrol_showed_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--after 100` where 100 is a sweep's array: scontrol answers with every task, and the
    fields read are the last task's (its StdOut in task-0 of the sweep): the dependency is
    on the array (Slurm's afterok:100 waits for every task), not on that one task's run. A
    task named by its own id (100_1) is that task's run."""
    from hpcshard.cli.chain import resolve
    from hpcshard.slurm import cluster

    task = tmp_path / "task-0"
    (task / "logs").mkdir(parents=True)
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="t0", backend="slurm",
            jobs=["100_0"]).write(task)
    (task / "attempts.jsonl").write_text(json.dumps(START0) + "\n")

    def query(job: str, timeout: float | None = None) -> cluster.JobQuery:
        info = cluster.JobInfo("100", cluster.JobState.RUNNING, "RUNNING",
                               stdout=str(task / "logs" / "slurm-100_0.out"), array_job="100")
        return cluster.JobQuery(job, cluster.Said.KNOWN, info)

    monkeypatch.setattr(cluster, "query_job", query)
    assert resolve("100") == After(kind="afterok", target="100", job="100")
    assert resolve("100_0") == After(kind="afterok", target="100_0", job="100_0", run=str(task.resolve()))


def test_an_export_directory_accepted_empty_at_submit_is_written_after_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--then export-hf=DIR` takes an existing empty DIR at submit, but `ckpt export --hf`
    writes only a new directory (refused: 'exists'): the step hours later failed. The step
    makes room for it while DIR is still empty; one that filled up meanwhile stays, and
    the export refuses it."""
    import subprocess

    from hpcshard.launch import then
    from hpcshard.rundir import store

    out = tmp_path / "hf"
    out.mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="r", backend="slurm",
            jobs=["12"]).write(tmp_path)
    Chain(then=parse_then([f"export-hf={out}"])).write(tmp_path)
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        START0, rec("end", 0, reason="done", step=4)]))
    monkeypatch.setattr(store, "committed", lambda root: [type("C", (), {"step": 4})()])

    def export(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        if Path(argv[-1]).exists():  # what runtime.export does
            return subprocess.CompletedProcess(argv, 2, "", f"Error: --hf {argv[-1]!r} exists; choose a new "
                                               "directory (nothing is overwritten)\n")
        Path(argv[-1]).mkdir()
        return subprocess.CompletedProcess(argv, 0, "wrote\n", "")

    monkeypatch.setattr(then.subprocess, "run", export)
    assert then.run_step(tmp_path, 0, slurm=False) == 0
    assert Chain.read(tmp_path).then[0].state == "done"
    (out / "mine").write_text("x")  # filled meanwhile: nothing of it removed
    Chain(then=[Then(what="export-hf", dir=str(out))]).write(tmp_path)
    assert then.run_step(tmp_path, 0, slurm=False) == 2
    assert (out / "mine").exists() and Chain.read(tmp_path).then[0].state == "failed"


def test_a_then_step_sbatch_refused_after_the_run_was_queued_is_a_warning_not_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's job 12 is queued (it owns the run now); sbatch refuses the step's job. Exit
    2 ("nothing submitted") would send the user to submit the run again: the step is
    recorded failed with sbatch's line, and the next step is still submitted."""
    from hpcshard.cli.chain import submitted
    from hpcshard.launch import then
    from hpcshard.slurm import cluster

    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, name="r", backend="slurm",
            jobs=["12"]).write(tmp_path)
    Chain(then=[Then(what="export-hf", dir=str(tmp_path / "hf")), Then(what="eval")]).write(tmp_path)
    monkeypatch.setattr(then, "script", lambda spec, run_dir, i, step: run_dir / f"then-{i}.sh")
    refused = cluster.SlurmError("sbatch: error: Batch job submission failed: Invalid generic resource")
    answers: list[str | Exception] = [refused, "21"]

    def sbatch(*args: str, **kw: object) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(cluster, "sbatch", sbatch)
    submitted(tmp_path, None, "12")
    steps = Chain.read(tmp_path).then
    assert (steps[0].state, steps[1].state, steps[1].jobs) == ("failed", "waiting", ["21"])
    assert "Invalid generic resource" in steps[0].said
    assert "then: export-hf" in capsys.readouterr().err
