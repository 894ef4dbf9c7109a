"""A run that is over releases its allocation from the batch script (`launch.release`,
the template's `host_setup` watch): the rendered script run by bash against a stand-in
srun (the step: one launcher writes the release, then srun waits for the lost node's task
until the step is ended), scontrol and scancel, also under a site `launch` block that waits
for srun with a plain `wait`, and ended by Slurm (TERM to every process of the batch step);
and the launcher's side, which leaves the release to the script where it watches, to its
own helper where it does not."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcshard.launch import hostside, release
from hpcshard.launch.hostside import Drain, HostActions, StepRelease
from hpcshard.rundir import events, launchers, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.slurm.env import SlurmEnv
from hpcshard.slurm.sbatch import SbatchRequest, render

pytestmark = pytest.mark.unit

SRUN = """#!/bin/bash
# The step: a launcher writes its decision (a rename over the script's file), then srun
# waits for the lost node's task, which never answers, until the step is ended (a DOWN of
# that node, a cancel: the stand-ins below make ENDED), or for HOLD_POLLS tenths of a second.
[ -e "$HPCSHARD_HOST_ACTIONS" ] && [ ! -s "$HPCSHARD_HOST_ACTIONS" ] || exit 90
echo "srun: watched=${HPCSHARD_HOST_WATCH:-no}" >> "$SCONTROL_LOG"
printf '%s' "$DECISION" > "$HPCSHARD_HOST_ACTIONS.new"
mv "$HPCSHARD_HOST_ACTIONS.new" "$HPCSHARD_HOST_ACTIONS"
[ -z "$TERM_BATCH" ] || kill -TERM "$PPID"  # (scancel of the job: the batch shell's TERM)
exec {fd}<> <(:)
if [ -n "$TERM_ALL" ]; then  # (Slurm ends the job: TERM to every process of the batch step)
    until grep -q "release of step" "$TERM_ALL"; do read -rt 0.1 -u "$fd"; done
    kill -TERM 0
fi
for _ in $(seq "$HOLD_POLLS"); do
    [ -e "$SCONTROL_LOG.ended" ] && break
    read -rt 0.1 -u "$fd"
done
echo "srun returns" >> "$SCONTROL_LOG"
exit "$SRUN_EXIT"
"""
SCONTROL = """#!/bin/bash
echo "$*" >> "$SCONTROL_LOG"
case "$*" in
"show job"*) echo "JobId=12 JobName=x"; echo "   NodeList=$JOB_NODES BatchHost=n1"; exit 0 ;;
"show hostnames"*) printf '%s\\n' $HOSTNAMES; exit 0 ;;
*"$DENY"*) echo "slurm_update error: Access/permission denied" >&2; exit 1 ;;
*State=DOWN*) touch "$SCONTROL_LOG.ended" ;;
esac
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$SCONTROL_LOG"
touch "$SCONTROL_LOG.ended"
"""
SQUEUE = """#!/bin/bash
echo "squeue $*" >> "$SCONTROL_LOG"
[ "$SQUEUE_JOBS" != fail ] || exit 1
printf '%s\\n' $SQUEUE_JOBS
"""


def batch(tmp_path: Path, decision: str, srun_exit: int = 137, hold: int = 600, deny: str = "never",
          job_nodes: str = "n[1-3]", hostnames: str = "n1 n2 n3", term: bool = False, launch: str = "",
          ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The whole rendered script, run by bash with the stand-ins; what they were asked.
    `launch`: a site template's own `launch` block (`LAUNCH` formatted with it)."""
    script, env = staged(tmp_path, decision, srun_exit, hold, deny, job_nodes, hostnames, launch)
    env["TERM_BATCH"] = "1" if term else ""
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    return proc, called(tmp_path)


def staged(tmp_path: Path, decision: str, srun_exit: int = 137, hold: int = 600, deny: str = "never",
           job_nodes: str = "n[1-3]", hostnames: str = "n1 n2 n3", launch: str = "",
           ) -> tuple[Path, dict[str, str]]:
    """The rendered script and the stand-ins on disk; the environment to run it with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL), ("squeue", SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    site = tmp_path / "templates"
    site.mkdir()
    (site / "site.j2").write_text(LAUNCH.format(launch=launch))
    script = tmp_path / "job.sh"
    req = SbatchRequest(job_name="x", nodes=3, gpus_per_node=0, run_dir=tmp_path / "run",
                        template_dirs=[str(site)], template="site.j2" if launch else "sbatch.j2")
    script.write_text(render(req, "python -m x", tmp_path / "submitit"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "12",
           "SLURM_JOB_NUM_NODES": "3", "DECISION": decision, "SCONTROL_LOG": str(tmp_path / "called.log"),
           "DENY": deny, "SRUN_EXIT": str(srun_exit), "HOLD_POLLS": str(hold), "JOB_NODES": job_nodes,
           "HOSTNAMES": hostnames, "TERM_BATCH": "", "TERM_ALL": "", "HPCSHARD_RELEASE_POLLS": "2",
           "SQUEUE_JOBS": "12"}
    env.pop(hostside.WATCH_ENV, None)
    return script, env


def called(tmp_path: Path) -> list[str]:
    log = tmp_path / "called.log"
    return log.read_text().splitlines() if log.exists() else []


LAUNCH = """{{% extends "sbatch.j2" %}}
{{% block launch -%}}
export SUBMITIT_EXECUTOR=slurm
{launch}
{{%- endblock %}}
"""
SRUN_LINE = ('srun --output {{ task_stdout | q }} --error {{ task_stderr | q }} "${HPCSHARD_SRUN_ARGS[@]}" '
             '"${HPCSHARD_WRAP[@]}" {{ command }}')


REASON = "hpcshard run: lost: silent"
DOWN = f"update NodeName=n2 State=DOWN Reason={REASON}"
ALONE = "squeue -h -t R,S,CG -w n2 -o %A"
"""Asked before a DOWN: which jobs run on the node (a DOWN ends every one of them)."""
HELD = ["show job 12", "show hostnames n[1-3]", ALONE]
"""What the watch asks before a DOWN: does the job still hold the node, and is it alone there."""


def released(code: int = 0, down: tuple[str, ...] = ("n2",), drains: tuple[Drain, ...] = ()) -> str:
    return HostActions(drains=list(drains), release=StepRelease("12.0", code, list(down), REASON)).text()


@pytest.mark.parametrize("decision, deny, calls, code", [
    (released(), "never", [*HELD, DOWN], 0),  # done on the spare: DOWN
    (released(down=()), "never", ["scancel 12.0"], 0),  # bad_nodes = "none": the step cancelled
    (released(), "NodeName", [*HELD, DOWN, "scancel 12.0"], 0),  # no rights
    (released(code=1), "never", [*HELD, DOWN], 1),  # an error, then over
], ids=["down", "cancel", "down-refused", "error"])
def test_a_release_written_while_srun_runs_is_acted_on_before_srun_returns(
        tmp_path: Path, decision: str, deny: str, calls: list[str], code: int) -> None:
    """srun would wait for the frozen node's task (here up to a minute): the batch script,
    outside the step, ends the step, and exits with the launchers' code whatever srun says
    after (137: a task still ending when the step was ended)."""
    proc, called = batch(tmp_path, decision, deny=deny)
    assert called == ["srun: watched=1", *calls, "srun returns"], proc.stderr
    assert proc.returncode == code, proc.stderr
    assert "hpcshard (batch host): the run is over: release of step 12.0" in proc.stderr


@pytest.mark.parametrize("jobs, said", [
    ("12 345", "n2 not set DOWN: job 345 runs there too (a DOWN would end it)"),
    ("fail", "n2 not set DOWN: squeue did not say what else runs there"),
], ids=["shared", "no-answer"])
def test_a_lost_node_another_job_runs_on_is_not_set_down(tmp_path: Path, jobs: str, said: str) -> None:
    """The job did not have its nodes to itself (no --exclusive: a GPU partition packs other
    users' jobs onto a node's free GPUs): a DOWN of its lost node would end theirs too
    (Slurm fails every job on a DOWN node). The step is cancelled instead; Slurm marks the
    node DOWN itself after SlurmdTimeout, if it is gone."""
    script, env = staged(tmp_path, released())
    env["SQUEUE_JOBS"] = jobs
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert called(tmp_path) == ["srun: watched=1", *HELD, "scancel 12.0", "srun returns"], proc.stderr
    assert said in proc.stderr and proc.returncode == 0


def test_a_lost_node_that_left_the_job_is_not_set_down(tmp_path: Path) -> None:
    """Slurm marked it DOWN itself meanwhile (the step ends by itself: srun returns on its
    own here): back in service, it may be another job's, so it is neither set DOWN nor the
    step cancelled."""
    proc, called = batch(tmp_path, released(), hold=60, job_nodes="n[1,3]", hostnames="n1 n3")
    assert called == ["srun: watched=1", "show job 12", "show hostnames n[1,3]", "srun returns"], proc.stderr
    assert proc.returncode == 0 and "n2 no longer in job 12" in proc.stderr


@pytest.mark.parametrize("decision", [
    "",  # nothing written: the launchers had a client and nothing to leave
    HostActions(drains=[Drain(["n4"], "DRAIN", "slow")]).text(),  # drains only: after srun
    released()[:-4],  # not whole: never acted on
    released().replace("release 12.0", "release 99.0"),  # another job's step
    released().replace("release 12.0 0 n2", "release 12.0 0 $(touch${IFS}pwned)"),  # not a node name
], ids=["empty", "drains-only", "not-whole", "other-job", "hostile"])
def test_a_job_not_released_is_untouched(tmp_path: Path, decision: str) -> None:
    """srun runs 3 s past the file's write (the watch would have acted after 2 polls), then
    returns by itself: nothing was asked of Slurm while it ran, and the script exits srun's
    code."""
    proc, called = batch(tmp_path, decision, srun_exit=3, hold=30)
    whole_drain = "DRAIN" in decision and decision.endswith("end\n")
    drains = ["update NodeName=n4 State=DRAIN Reason=slow"] if whole_drain else []
    assert called == ["srun: watched=1", "srun returns", *drains], proc.stderr
    assert proc.returncode == 3 and not (tmp_path / "pwned").exists()


def test_the_host_block_leaves_the_lost_nodes_down_to_the_release(tmp_path: Path) -> None:
    """Without a client the launchers also wrote the lost node's DOWN and a deferred drain
    for after srun: once the release has set it DOWN, only the drain remains."""
    drains = (Drain(["n4"], "DRAIN", "slow"), Drain(["n2"], "DOWN", REASON))
    proc, called = batch(tmp_path, released(drains=drains))
    assert called == ["srun: watched=1", *HELD, DOWN, "srun returns",
                      "update NodeName=n4 State=DRAIN Reason=slow"], proc.stderr
    assert proc.returncode == 0


def test_a_cancelled_job_ends_its_batch_script_and_the_watch_with_it(tmp_path: Path) -> None:
    """scancel of the job while srun runs: SIGTERM to the batch shell, which dies of it as
    it did before the watch (nothing traps TERM before srun returns); the watch, its child,
    leaves once the shell is gone (Slurm's proctrack would kill it too)."""
    proc, called = batch(tmp_path, "", hold=20, term=True)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    script = str(tmp_path / "job.sh").encode()
    deadline = time.monotonic() + 30
    while _running(script) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(script)


def test_a_job_slurm_ends_while_a_release_waits_is_not_released(tmp_path: Path) -> None:
    """scancel of the job, its time limit, a requeue: Slurm sends TERM to every process of
    the batch step (here the whole process group) while the watch waits out its polls after
    the release line showed up: it leaves without acting (the job is over; the node it
    would set DOWN may be given to another job once Slurm has it back)."""
    script, env = staged(tmp_path, released(), hold=100)
    log = tmp_path / "batch.err"
    env |= {"TERM_ALL": str(log), "HPCSHARD_RELEASE_POLLS": "1"}
    with log.open("w") as err:
        proc = subprocess.run(["bash", str(script)], stderr=err, env=env, timeout=120, start_new_session=True)
    gone_or_timeout(str(script).encode())
    assert proc.returncode == -signal.SIGTERM, log.read_text()
    assert called(tmp_path) == ["srun: watched=1"], log.read_text()


@pytest.mark.parametrize("decision, calls", [
    ("", []),  # nothing to release: the watch must not keep `wait` waiting
    (released(), [*HELD, DOWN]),
], ids=["nothing", "release"])
def test_a_site_launch_block_that_waits_for_every_child_still_ends(
        tmp_path: Path, decision: str, calls: list[str]) -> None:
    """A site's `launch` block that runs srun in the background and waits for it with a
    plain `wait` (so that the batch shell takes a `--signal=B:` notice while srun runs, or
    beside a monitor step): the watch is not one of the jobs `wait` waits for, so srun's
    return ends the wait, and the release still works."""
    proc, said = batch(tmp_path, decision, srun_exit=0, hold=10 if not decision else 600,
                       launch=f"{SRUN_LINE} &\nwait")
    assert said == ["srun: watched=1", *calls, "srun returns"], proc.stderr
    assert proc.returncode == 0, proc.stderr


def gone_or_timeout(cmd: bytes) -> None:
    """Wait (up to 30 s) until no process runs `cmd` any more."""
    deadline = time.monotonic() + 30
    while _running(cmd) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(cmd)


def _running(cmd: bytes) -> list[int]:
    """Processes whose command line names `cmd` (this test's own script)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if cmd in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("release_, needle", [
    (StepRelease("12.0; rm -rf /", 0, [], "x"), "release of step"),
    (StepRelease("12", 0, [], "x"), "release of step"),
    (StepRelease("12.0", 256, [], "x"), "exit code 256"),
    (StepRelease("12.0", 0, ["$(id)"], "x"), "node name"),
])
def test_release_values_bash_would_split_or_run_are_refused(release_: StepRelease, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        HostActions(release=release_).text()


def test_a_release_round_trips_and_merges_with_what_is_there() -> None:
    mine = HostActions(release=StepRelease("12.0", 0, ["n2", "n5"], "hpcshard r: lost:\nsilent"))
    assert mine.text().splitlines()[1] == "release 12.0 0 n2,n5 hpcshard r: lost: silent"
    assert HostActions.parse(mine.text()) == HostActions(release=StepRelease("12.0", 0, ["n2", "n5"],
                                                                             "hpcshard r: lost: silent"))
    drains = HostActions(drains=[Drain(["n4"], "DRAIN", "slow")])
    assert drains.merged(mine).release == mine.release and mine.merged(drains).drains == drains.drains


def job(tmp_path: Path, watched: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, SlurmEnv, Path]:
    """A 3-node job whose attempt was done on the spare after n2 was lost; node 2's launcher
    has ended already. `watched`: its batch script exported HPCSHARD_HOST_WATCH."""
    run = tmp_path / "run"
    (run / "launch").mkdir(parents=True)
    for event in (events.BadNode(attempt=0, cycle=0, node=1, slurm_node="n2", reason="lost: silent"),
                  events.End(attempt=0, reason=EndReason.DONE, saved_step=8, saved="step-8")):
        ledger.append(run, event)
    host = run / "launch" / "host-77.0"
    host.write_text("")
    monkeypatch.setenv(hostside.ENV, str(host))
    if watched:
        monkeypatch.setenv(hostside.WATCH_ENV, "1")
    else:
        monkeypatch.delenv(hostside.WATCH_ENV, raising=False)
    assert not launchers.pid_file(run, 2).exists()
    return run, SlurmEnv(job_id="77", ref="77", nodes=["n1", "n2", "n3"], node_id=0, restart_count=0,
                         gpus_on_node=1, step_id="0"), host


@pytest.mark.parametrize("client", [True, False])
@pytest.mark.parametrize("down", [True, False])
def test_a_watching_batch_script_gets_the_release_client_or_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: bool, down: bool) -> None:
    """The launcher writes the release for its batch script (no helper: under
    proctrack/cgroup it would die with the step), with Slurm's client here or without."""
    run, env, host = job(tmp_path, True, monkeypatch)
    monkeypatch.setattr(hostside, "has_client", lambda action="requeue": client)
    helpers: list[str] = []
    monkeypatch.setattr(release, "after_exit", lambda *a: helpers.append(" ".join(a)))
    release.release(run, env, 0, down=down)
    actions = HostActions.parse(host.read_text())
    assert actions is not None and actions.release == StepRelease("77.0", 0, ["n2"] if down else [],
                                                                  "hpcshard run: lost: silent")
    assert helpers == []
    (cancel,) = [r for r in ledger.read(run) if r["event"] == "cancel"]
    assert "the batch script is asked" in cancel["reason"]


@pytest.mark.parametrize("client, helper", [(True, ["77 0 n2 hpcshard run: lost: silent"]), (False, [])])
def test_without_the_watch_a_launcher_leaves_a_helper_where_it_has_a_client(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        client: bool, helper: list[str]) -> None:
    """A site template that replaced `host_setup` (or a script from before the watch):
    today's helper, with Slurm's client; without one, nothing is done, in one line."""
    run, env, host = job(tmp_path, False, monkeypatch)
    monkeypatch.setattr(hostside, "has_client", lambda action="requeue": client)
    helpers: list[str] = []
    monkeypatch.setattr(release, "after_exit", lambda *a: helpers.append(" ".join(a)))
    release.release(run, env, 0, down=True)
    assert helpers == helper and host.read_text() == ""
    cancels = [r for r in ledger.read(run) if r["event"] == "cancel"]
    assert len(cancels) == (1 if client else 0)
    if not client:
        assert "the job ends when Slurm marks them DOWN" in capsys.readouterr().err


def test_a_release_the_script_cannot_be_given_falls_back_to_the_helper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host file's folder gone (or the lock never had): with Slurm's client, the helper."""
    run, env, host = job(tmp_path, True, monkeypatch)
    monkeypatch.setenv(hostside.ENV, str(tmp_path / "gone" / "host-77.0"))
    monkeypatch.setattr(hostside, "has_client", lambda action="requeue": True)
    helpers: list[str] = []
    monkeypatch.setattr(release, "after_exit", lambda *a: helpers.append(" ".join(a)))
    release.release(run, env, 0, down=True)
    assert helpers == ["77 0 n2 hpcshard run: lost: silent"]
    (cancel,) = [r for r in ledger.read(run) if r["event"] == "cancel"]
    assert "a helper left by this launcher is asked" in cancel["reason"]


def test_the_release_carries_the_jobs_exit_code_from_the_records_that_closed_the_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch script exits with the release's code, whatever srun says: the job's (1 for a
    run given up: afterok never starts), not the releasing launcher's own (0 where another
    launcher gave the run up: `slurm.task_exit`)."""
    run, env, host = job(tmp_path, True, monkeypatch)
    ledger.append(run, events.GaveUp(attempt=0, reason="the cap of 0 is reached"))
    monkeypatch.setattr(hostside, "has_client", lambda action="requeue": True)
    release.release(run, env, 0, down=True)
    actions = HostActions.parse(host.read_text())
    assert actions is not None and actions.release is not None and actions.release.code == 1
