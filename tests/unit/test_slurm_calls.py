"""Slurm calls that hang or give up: fake Slurm commands first on PATH (and nothing else:
no real sacct behind them), each logging how it was called. Timeouts and back-offs are
made short so that a hang costs a second, not minutes."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.rundir import lease, ledger
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm import client, cluster
from hpcshard.slurm.env import SlurmEnv

HANG = "exec /bin/sleep 30\n"
"""A command whose controller never answers (exec: the sleep itself is what times out)."""
SLURMCTLD_TIMEOUT = cluster.slurmctld_timeout
"""The real one (the `bin_dir` fixture puts a stand-in in its place)."""


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The only directory on PATH; short timeouts and back-offs."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    monkeypatch.setattr(client, "TIMEOUT_S", 0.5)
    monkeypatch.setattr(client, "SBATCH_TIMEOUT_S", 0.5)
    monkeypatch.setattr(client, "BACKOFF_S", 0.05)
    monkeypatch.setattr(cluster, "REQUEUE_BUDGET_S", 2.0)
    monkeypatch.setattr(cluster, "HELD_BUDGET_S", 1.5)
    monkeypatch.setattr(cluster, "slurmctld_timeout", lambda: 0.5)  # (a fail-over: 1 s)
    return path


def fake(bin_dir: Path, name: str, body: str) -> Path:
    """A fake Slurm command that appends its arguments to BIN/NAME.log, then runs `body`."""
    log = bin_dir / f"{name}.log"
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{body}')
    script.chmod(0o755)
    return log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("update", [
    'echo "Invalid node name specified for job 77" >&2; exit 1\n',  # refused
    HANG,  # no answer
])
def test_release_follows_requeuehold_whatever_the_update_does(bin_dir: Path, update: str) -> None:
    log = fake(bin_dir, "scontrol", f'if [ "$1" = update ]; then {update}fi\nexit 0\n')
    note = cluster.requeue("77", exclude=["n3"])  # requeued, only not without n3: said so
    assert [c.split()[0] for c in calls(log) if c.split()[0] != "update"] == ["requeuehold", "release"]
    assert calls(log)[-1] == "release 77"
    assert "update" in note and "requeued with the nodes it had" in note


def test_a_requeuehold_whose_answer_was_lost_is_released_all_the_same(bin_dir: Path) -> None:
    log = fake(bin_dir, "scontrol", f'if [ "$1" = requeuehold ]; then {HANG}fi\nexit 0\n')
    with pytest.raises(cluster.SlurmError, match="gave no answer"):  # not known to be queued: said so
        cluster.requeue("77", exclude=["n3"])
    assert calls(log)[-1] == "release 77" and "update JobId=77 ExcNodeList=n3" in calls(log)


def continue_run(tmp_path: Path) -> list[dict[str, object]]:
    """A clean stop of attempt 0 of Slurm job 77 under the requeue policy: what the
    launcher records."""
    from hpcshard.launch import slurm

    run = tmp_path / "run"
    run.mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=1, backend="slurm", name="x",
            jobs=["77"]).write(run)
    env = SlurmEnv(job_id="77", ref="77", nodes=["n1", "n2"], node_id=0, restart_count=0, gpus_on_node=1)
    slurm._continue(run, env, attempt=0, first_attempt=0, max_requeues=3, policy="requeue",
                    owner=lease.Owner.of_job("77"))
    with contextlib.suppress(OSError):
        return ledger.read(run)
    return []


SHOW = 'if [ "$1" = show ]; then echo "JobId=77 JobState=RUNNING Restarts=0"; exit 0; fi\n'


def test_a_requeue_goes_through_a_controller_blip(tmp_path: Path, bin_dir: Path) -> None:
    blipped = tmp_path / "blipped"
    log = fake(bin_dir, "scontrol", SHOW + (
        f'if [ "$1" = requeue ] && [ ! -e {blipped} ]; then : > {blipped}\n'
        '  echo "Socket timed out on send/recv operation for job 77" >&2; exit 1\nfi\nexit 0\n'))
    (record,) = continue_run(tmp_path)
    assert [c for c in calls(log) if c.startswith("requeue")] == ["requeue 77", "requeue 77"]
    assert record["event"] == "requeue" and record["error"] is None, record


def test_a_requeue_is_made_whatever_the_ledger_does(tmp_path: Path, bin_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A notice ended the run's wait for storage that still gives EIO: the ledger can be
    neither read (the continuations so far, the bad nodes) nor written (the requeue's
    record). Its read raised before `scontrol requeue`, and the job, not requeued, ended at
    its time limit (TIMEOUT). The requeue is made; the continuations are counted from the
    attempt's number."""
    log = fake(bin_dir, "scontrol", SHOW + "exit 0\n")

    def eio(*_: object, **__: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ledger, "read", eio)
    monkeypatch.setattr(ledger, "append", eio)
    continue_run(tmp_path)
    assert [c for c in calls(log) if c.startswith("requeue")] == ["requeue 77"]


def test_a_retried_requeue_that_had_taken_counts_as_done(tmp_path: Path, bin_dir: Path) -> None:
    """The first answer was lost but the requeue took: the retry hears that the job is
    pending already."""
    tried = tmp_path / "tried"
    fake(bin_dir, "scontrol", SHOW + (
        f'if [ "$1" = requeue ]; then if [ -e {tried} ]; then '
        'echo "Job is pending execution for job 77" >&2; exit 1; fi\n'
        f'  : > {tried}; {HANG}fi\nexit 0\n'))
    (record,) = continue_run(tmp_path)
    assert record["event"] == "requeue" and record["error"] is None, record


@pytest.mark.parametrize("said,retried", [
    ("Unable to contact slurm controller (connect failure)", True),  # down for the whole budget
    ("Requested operation is presently disabled for job 77", False),  # refused: asking again is no use
])
def test_a_requeue_that_still_fails_gives_up_with_its_reason(tmp_path: Path, bin_dir: Path,
                                                             said: str, retried: bool) -> None:
    log = fake(bin_dir, "scontrol", SHOW + f'echo "{said}" >&2; exit 1\n')
    start = time.monotonic()
    (record,) = continue_run(tmp_path)
    assert time.monotonic() - start < cluster.REQUEUE_BUDGET_S + 2
    # (as often as the budget allows: a count of tries depends on this host's load)
    tries = len([c for c in calls(log) if c.startswith("requeue")])
    assert tries > 1 if retried else tries == 1
    assert record["event"] == "gave_up" and said in str(record["reason"]), record
    assert "hpcshard resume" in str(record["reason"])


def test_a_requeue_outlasts_a_fail_over_to_the_backup_controller(tmp_path: Path, bin_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The primary controller died as the job was sent on: no controller answers until the
    backup takes control, SlurmctldTimeout later (120 s by default; 2 s here, read from the
    slurm.conf the client reads). A requeue that gave up sooner (60 s, five tries; 2 s
    here) left a run stopped that the backup would have requeued."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n#SlurmctldTimeout=1\nSlurmctldTimeout=2\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setattr(cluster, "slurmctld_timeout", SLURMCTLD_TIMEOUT)  # (the fixture's: 0.5 s)
    back = time.time() + 2.5  # the backup in control: past the floor's 2 s, within the fail-over's 4
    log = fake(bin_dir, "scontrol", SHOW + (
        f'if [ "$1" = requeue ] && [ "$(/bin/date +%s%N)" -lt {int(back * 1e9)} ]; then\n'
        '  echo "Unable to contact slurm controller (connect failure)" >&2; exit 1\nfi\nexit 0\n'))
    (record,) = continue_run(tmp_path)
    assert record["event"] == "requeue" and record["error"] is None, record
    assert time.time() >= back and len([c for c in calls(log) if c.startswith("requeue")]) > 1


@pytest.mark.parametrize("conf, seconds", [
    ("SlurmctldTimeout=300\n", 300.0),
    ("ClusterName=x\n  slurmctldtimeout = 60 # lower\n", 60.0),
    ("#SlurmctldTimeout=300\n", cluster.SLURMCTLD_TIMEOUT_S),  # (a comment: Slurm's default)
    (None, cluster.SLURMCTLD_TIMEOUT_S),  # (no file to read)
])
def test_slurmctld_timeout_is_read_from_the_clients_slurm_conf(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, conf: str | None, seconds: float) -> None:
    path = tmp_path / "slurm.conf"
    if conf is not None:
        path.write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(path))
    assert cluster.slurmctld_timeout() == seconds
    assert cluster.requeue_budget() == max(cluster.REQUEUE_BUDGET_S, 2 * seconds)



@pytest.mark.parametrize("include", ["ha.conf", "{dir}/ha.conf", "conf.d/*.conf"])
def test_slurmctld_timeout_is_read_from_a_file_the_slurm_conf_includes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, include: str) -> None:
    """An HA site may keep its controllers' lines (SlurmctldHost, SlurmctldTimeout) in a
    file of their own that slurm.conf includes (relative to its directory, absolute, or a
    glob). Read from slurm.conf alone, a SlurmctldTimeout of 300 was Slurm's default of
    120: the requeue gave up after 240 s, before the backup took control at 300."""
    (tmp_path / "conf.d").mkdir()
    for where in ("ha.conf", "conf.d/ha.conf"):
        (tmp_path / where).write_text("SlurmctldHost=a\nSlurmctldHost=b\nSlurmctldTimeout=300\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=x\nSlurmctldTimeout=60\nInclude {include.format(dir=tmp_path)}\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert cluster.slurmctld_timeout() == 300.0 and cluster.requeue_budget() == 600.0
    conf.write_text(f"include {include.format(dir=tmp_path)}\nSlurmctldTimeout=60\n")  # (the later one)
    assert cluster.slurmctld_timeout() == 60.0

HUNG_CALLS = {
    "sbatch": (lambda: cluster.sbatch("job.sh"), "may have been submitted"),
    "scancel": (lambda: cluster.scancel("77"), "gave no answer"),
    "requeue": (lambda: cluster.requeue("77"), "gave no answer"),
    "requeuehold": (lambda: cluster.requeue("77", exclude=["n3"]), "gave no answer"),
    "partitions": (lambda: cluster.partitions(), "Slurm does not answer"),
    "query_job": (lambda: cluster.query_job("77"), "gave no answer"),
}


@pytest.mark.parametrize("name", HUNG_CALLS)
def test_every_slurm_call_ends_when_the_controller_hangs(bin_dir: Path, name: str) -> None:
    for command in ("sbatch", "scancel", "scontrol", "sinfo", "squeue"):
        fake(bin_dir, command, HANG)
    call, said = HUNG_CALLS[name]
    bound = cluster.REQUEUE_BUDGET_S + cluster.HELD_BUDGET_S + 1 if "requeue" in name else 3
    start = time.monotonic()
    try:
        answer = str(call())
    except ValueError as err:
        answer = str(err)
    assert time.monotonic() - start < bound
    assert said in answer, answer


def test_sbatch_is_sent_again_only_when_it_surely_was_not_sent(tmp_path: Path, bin_dir: Path) -> None:
    down = tmp_path / "down"
    log = fake(bin_dir, "sbatch", (
        f'if [ ! -e {down} ]; then : > {down}; echo "sbatch: error: Batch job submission failed: '
        'Unable to contact slurm controller (connect failure)" >&2; exit 1; fi\necho 4243\n'))
    assert cluster.sbatch("job.sh") == "4243" and len(calls(log)) == 2  # never reached: sent again
    log.unlink()
    fake(bin_dir, "sbatch", 'echo "sbatch: error: Batch job submission failed: Socket timed out on '
         'send/recv operation" >&2; exit 1\n')
    with pytest.raises(ValueError, match="may have been submitted"):
        cluster.sbatch("job.sh")  # it may have been made: never sent twice
    assert len(calls(log)) == 1


def test_sbatch_does_not_see_the_variables_it_is_told_to_leave_out(tmp_path: Path, bin_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard's sbatch leaves out SBATCH_USE_MIN_NODES (a user's shell hands it to the job,
    and it would hold the guard's range of nodes to its least): unset for that call only."""
    seen = tmp_path / "seen"
    fake(bin_dir, "sbatch", f'echo "${{SBATCH_USE_MIN_NODES-unset}} $SBATCH_ACCOUNT" >> {seen}; echo 4243\n')
    monkeypatch.setenv("SBATCH_USE_MIN_NODES", "1")
    monkeypatch.setenv("SBATCH_ACCOUNT", "ml")
    assert cluster.sbatch("job.sh", unset=("SBATCH_USE_MIN_NODES",)) == "4243"
    assert cluster.sbatch("job.sh") == "4243"
    assert seen.read_text().splitlines() == ["unset ml", "1 ml"]


def test_a_submission_whose_answer_was_lost_is_found_by_its_script(tmp_path: Path, bin_dir: Path) -> None:
    script = tmp_path / ".submission_file_0123.sh"
    log = fake(bin_dir, "sbatch", HANG)
    fake(bin_dir, "squeue", f'echo "4242|/elsewhere/job.sh"\necho "4243|{script}"\n')
    assert cluster.sbatch(str(script), unique=True) == "4243" and len(calls(log)) == 1
    with pytest.raises(ValueError, match="may have been submitted"):
        cluster.sbatch(str(tmp_path / "other.sh"), unique=True)


def test_a_repeated_scancel_of_a_job_that_went_meanwhile_succeeds(tmp_path: Path, bin_dir: Path) -> None:
    tried = tmp_path / "tried"
    log = fake(bin_dir, "scancel", (
        f'if [ -e {tried} ]; then echo "scancel: error: Kill job error on job id 77: Invalid job id '
        f'specified" >&2; exit 1; fi\n: > {tried}\n'
        'echo "scancel: error: Socket timed out on send/recv operation" >&2; exit 1\n'))
    cluster.scancel("77")
    assert len(calls(log)) == 2
    with pytest.raises(ValueError, match="Invalid job id"):
        cluster.scancel("77")  # at the first try, still an error


@pytest.mark.parametrize("body,said,alive", [
    ('echo "JobId=77 JobState=RUNNING Restarts=1"\n', cluster.Said.KNOWN, True),
    ('echo "JobId=77 JobState=COMPLETED Restarts=1"\n', cluster.Said.KNOWN, False),
    ('echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n', cluster.Said.NO_SUCH_JOB, False),
    ('echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1\n',
     cluster.Said.NO_ANSWER, None),
    (HANG, cluster.Said.NO_ANSWER, None),
])
def test_a_job_query_tells_over_from_no_answer(bin_dir: Path, body: str, said: cluster.Said,
                                               alive: bool | None) -> None:
    fake(bin_dir, "scontrol", body)
    assert cluster.query_job("77").said is said
    assert cluster.job_alive("77") is alive


def test_resume_refuses_when_slurm_does_not_answer(tmp_path: Path, bin_dir: Path) -> None:
    """scontrol hangs and there is no accounting: the run may well be training. resume says
    so in one line and submits nothing (it took the silence for "over", and submitted a
    second job on the live run)."""
    train = tmp_path / "train.py"
    train.write_text("print('training')\n")
    fake(bin_dir, "sinfo", 'echo "debug*|2|gpu:2|infinite"\n')
    fake(bin_dir, "srun", "exit 1\n")  # submitit looks for it; never run here
    submitted = fake(bin_dir, "sbatch", 'case "$1" in --parsable) echo 4243;; '
                     '*) echo "Submitted batch job 4243";; esac\n')
    run = tmp_path / "run"
    out = CliRunner().invoke(main, ["submit", "--backend", "slurm", str(train), "--run-dir", str(run)])
    assert out.exit_code == 0 and len(calls(submitted)) == 1, out.output
    fake(bin_dir, "scontrol", HANG)
    out = CliRunner().invoke(main, ["resume", str(run)])
    assert out.exit_code == 2, out.output
    assert out.output.strip().splitlines() == [
        f"Error: {run} is in use: Slurm did not answer whether job 4243, which owns the run, still "
        "runs; try again when the controller answers"]
    assert len(calls(submitted)) == 1 and RunSpec.read(run).jobs == ["4243"]


def test_a_command_that_was_not_done_raises_slurm_s_own_line(bin_dir: Path) -> None:
    """The one convention of slurm.cluster: a command raises SlurmError (a ValueError, for
    the CLI's one line) with what Slurm said; one that was done returns."""
    fake(bin_dir, "scontrol", 'echo "slurm_update error: Invalid user id" >&2; exit 1\n')
    for command in (lambda: cluster.drain("n1", "bad"), lambda: cluster.release("77")):
        with pytest.raises(cluster.SlurmError, match="Invalid user id"):
            command()
    fake(bin_dir, "scontrol", "exit 0\n")
    cluster.drain("n1", "bad")
    cluster.release("77")
    assert issubclass(cluster.SlurmError, ValueError)


def test_a_refused_drain_is_recorded_with_slurm_s_line(tmp_path: Path, bin_dir: Path) -> None:
    from hpcshard.launch.exclusion import declare_bad

    where = {"host": "h1", "slurm_node": "n1"}
    fake(bin_dir, "scontrol", 'echo "slurm_update error: Invalid user id" >&2; exit 1\n')
    declare_bad(tmp_path, 0, 0, 1, where, "bad on purpose", drain=True)
    fake(bin_dir, "scontrol", "exit 0\n")
    declare_bad(tmp_path, 0, 0, 2, where, "bad on purpose", drain=True)
    refused, done = ledger.read(tmp_path)
    assert (refused["drained"], refused["drain_error"]) == (False, "slurm_update error: Invalid user id")
    assert done["drained"] is True and "drain_error" not in done


def test_resume_moves_the_runs_still_waiting_on_it_onto_its_new_job(tmp_path: Path, bin_dir: Path) -> None:
    """`submit --after RUN` made job 50 wait afterok on job 4243; 4243 stopped without
    finishing (exit 75: FAILED), so 50 waits for ever (DependencyNeverSatisfied). `resume`
    carries the run on as a new job: 50 waits for that one (as a continuation moves it)."""
    from hpcshard.rundir.chain import Chain

    train = tmp_path / "train.py"
    train.write_text("print('training')\n")
    fake(bin_dir, "sinfo", 'echo "debug*|2|gpu:2|infinite"\n')
    fake(bin_dir, "srun", "exit 1\n")
    count = bin_dir / "n"  # (PATH is the fakes only: shell builtins)
    fake(bin_dir, "sbatch", f'n=4243; [ -f {count} ] && read n < {count}; echo $((n + 1)) > {count}\n'
         'case "$1" in --parsable) echo $n;; *) echo "Submitted batch job $n";; esac\n')
    run = tmp_path / "run"
    out = CliRunner().invoke(main, ["submit", "--backend", "slurm", str(train), "--run-dir", str(run)])
    assert out.exit_code == 0, out.output
    Chain(followers=[{"job": "50", "kind": "afterok", "run": str(tmp_path / "next")}]).write(run)
    scontrol = fake(bin_dir, "scontrol", 'case "$1" in show) echo "JobId=$4 JobState=FAILED ExitCode=75:0";; '
                    'esac\nexit 0\n')
    out = CliRunner().invoke(main, ["resume", str(run)])
    assert out.exit_code == 0, out.output
    assert RunSpec.read(run).jobs == ["4243", "4244"]
    assert "update JobId=50 Dependency=afterok:4244" in calls(scontrol)
