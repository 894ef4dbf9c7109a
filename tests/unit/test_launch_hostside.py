"""Slurm actions without Slurm's client in the launcher's environment (`launch.hostside`):
the file's format, the way each action goes, what the launcher writes, and the batch
script's host block run by bash against a stand-in srun and scontrol."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpcshard.launch import exclusion, hostside
from hpcshard.launch import slurm as launch_slurm
from hpcshard.launch.hostside import Drain, HostActions, Way
from hpcshard.rundir import events, ledger
from hpcshard.rundir.chain import verdict
from hpcshard.slurm.env import SlurmEnv
from hpcshard.slurm.sbatch import SbatchRequest, render

ACTIONS = HostActions("12_3", ["n2", "gpu-07.rack1"], 2, [Drain(["n4"], "DRAIN", "hpcshard run: straggler"),
                                                          Drain(["n2", "n5"], "DOWN", "lost")])


def test_actions_file_round_trips_and_is_whole() -> None:
    text = ACTIONS.text()
    assert text.splitlines() == ["hpcshard-host-actions 1", "drain n4 DRAIN hpcshard run: straggler",
                                 "drain n2,n5 DOWN lost", "requeue 12_3 n2,gpu-07.rack1 2", "end"]
    assert HostActions.parse(text) == ACTIONS
    assert HostActions.parse(HostActions("7").text()) == HostActions("7")
    assert HostActions("7").text().splitlines()[1] == "requeue 7 - -"
    for cut in ("", text[:-4], text.replace("hpcshard-host-actions 1", "other 1")):
        assert HostActions.parse(cut) is None  # empty (the script's own), cut short, not ours


@pytest.mark.parametrize("actions, needle", [
    (HostActions("12; rm -rf /"), "requeue of job"),
    (HostActions("12", nodes=0), "requeue of job"),
    (HostActions("12", ["n1 n2"]), "node name"),
    (HostActions("12", ["$(id)"]), "node name"),
    (HostActions(drains=[Drain(["n1"], "RESUME", "x")]), "not DRAIN or DOWN"),
    (HostActions(drains=[Drain([], "DOWN", "x")]), "not DRAIN or DOWN"),
])
def test_values_bash_would_split_or_run_are_refused(actions: HostActions, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        actions.text()


def test_a_reason_is_one_line_of_words() -> None:
    text = HostActions(drains=[Drain(["n1"], "DRAIN", "a\nb\tc  $(id) " + "x" * 300)]).text()
    line = text.splitlines()[1]
    assert line.startswith("drain n1 DRAIN a b c $(id) x") and len(line) == len("drain n1 DRAIN ") + 200


@pytest.mark.parametrize("action, client, host_file, expected", [
    ("requeue", True, None, Way.HERE),
    ("requeue", True, "/r/launch/host-1.0", Way.HERE),
    ("chain", True, None, Way.HERE),
    ("requeue", False, "/r/launch/host-1.0", Way.HOST),
    ("drain", False, "/r/launch/host-1.0", Way.HOST),
    ("requeue", False, None, Way.NONE),  # a script rendered before the host block
    ("chain", False, "/r/launch/host-1.0", Way.NONE),
    ("guard", False, "/r/launch/host-1.0", Way.NONE),
    ("lookup", False, "/r/launch/host-1.0", Way.NONE),
])
def test_way_each_action_goes(action: str, client: bool, host_file: str | None, expected: Way) -> None:
    assert hostside.way(action, client, host_file) is expected


LOST = {"slurm_node": "n2", "reason": "lost: silent", "drain_error": hostside.DEFERRED}
SLOW = {"slurm_node": "n4", "reason": "straggler: slow", "drain_error": hostside.DEFERRED}
DRAINED = {"slurm_node": "n5", "reason": "health check failed", "drained": True}


@pytest.mark.parametrize("bad, job, down_lost, expected", [
    ([], "", True, HostActions()),
    ([], "9", False, HostActions("9")),
    ([SLOW, DRAINED], "", False, HostActions(drains=[Drain(["n4"], "DRAIN", "hpcshard r: straggler: slow")])),
    ([LOST], "9", True, HostActions("9", drains=[Drain(["n2"], "DRAIN", "hpcshard r: lost: silent"),
                                                 Drain(["n2"], "DOWN", "hpcshard r: lost: silent")])),
    ([LOST], "9", False, HostActions("9", drains=[Drain(["n2"], "DRAIN", "hpcshard r: lost: silent")])),
    ([{"slurm_node": "n2", "reason": "lost: silent"}], "", True,  # not asked to drain: DOWN all the same
     HostActions(drains=[Drain(["n2"], "DOWN", "hpcshard r: lost: silent")])),
])
def test_decide_drains_then_downs_then_requeues(bad: list[dict[str, object]], job: str, down_lost: bool,
                                               expected: HostActions) -> None:
    assert hostside.decide("r", bad, job, down_lost=down_lost) == expected


@pytest.mark.parametrize("policy, done, way, needle", [
    ("requeue", 0, Way.HERE, ""),
    ("requeue", 0, Way.HOST, ""),
    ("none", 0, Way.HERE, "policy is none"),
    ("requeue", 3, Way.HOST, "cap of 3"),
    ("requeue", 0, Way.NONE, "render the script with a `host` block"),
    ("chain", 0, Way.NONE, "chain needs Slurm's client"),
])
def test_when_a_stopped_job_is_not_sent_on(policy: str, done: int, way: Way, needle: str) -> None:
    why = launch_slurm.not_continued(policy, done, 3, way)
    assert (needle in why and why) if needle else why == ""


@pytest.fixture
def no_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A launcher in a container without Slurm's client, its batch script with a host block."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert not hostside.has_client()
    host = tmp_path / "run" / "launch" / "host-12.0"
    host.parent.mkdir(parents=True)
    host.write_text("")  # (the script makes it before srun)
    monkeypatch.setenv(hostside.ENV, str(host))
    return host


SLURM = SlurmEnv(job_id="12", ref="12", nodes=["n1", "n2"], node_id=0, restart_count=0, gpus_on_node=2)


def test_without_a_client_the_launcher_leaves_requeue_and_drains_to_the_batch_script(
        no_client: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = no_client.parents[1]
    exclusion.declare_bad(run, 0, 0, 1, {"host": "h2", "slurm_node": "n2"}, "lost: silent", drain=True)
    bad = ledger.bad_nodes(run)[0]
    assert (bad["drained"], bad["drain_error"]) == (False, hostside.DEFERRED)
    left = launch_slurm._continue(run, SLURM, 0, 0, 5, "requeue", owner=None)  # type: ignore[arg-type]
    assert left is not None and left.host is True and left.excluded == ["n2"]
    requeue = [r for r in ledger.read(run) if r["event"] == "requeue"]
    assert requeue == [{**requeue[0], "job": "12", "host": True, "excluded": ["n2"]}]
    spec = type("Spec", (), {"bad_nodes": "drain"})()
    launch_slurm._leave_to_host(run, spec, 0, left)  # type: ignore[arg-type]
    assert HostActions.parse(no_client.read_text()) == HostActions(
        "12", ["n2"], None, [Drain(["n2"], "DRAIN", "hpcshard run: lost: silent"),
                             Drain(["n2"], "DOWN", "hpcshard run: lost: silent")])
    err = capsys.readouterr().err
    assert "no Slurm client" in err and "left to the batch script" in err


def test_a_node_name_bash_could_split_gives_the_run_up_in_one_line(
        no_client: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A node name Slurm never gives reaches the host file's check, and the launcher does
    not end in a traceback. A requeue so lost gives the run up (the ledger says why: nothing
    requeues it); drains alone only say so, in one line: the run ended as it ended, or
    another launcher's requeue in the file continues it, and a give-up would read as its end
    (`chain.verdict`: the job FAILED, `--after` refused)."""
    run = no_client.parents[1]
    exclusion.declare_bad(run, 0, 0, 1, {"host": "h2", "slurm_node": "n2;reboot"}, "lost: silent", drain=True)
    spec = type("Spec", (), {"bad_nodes": "drain"})()
    launch_slurm._leave_to_host(run, spec, 0, None)  # type: ignore[arg-type]
    assert not [r for r in ledger.read(run) if r["event"] == "gave_up"] and no_client.read_text() == ""
    (said,) = [line for line in capsys.readouterr().err.splitlines() if "not one Slurm gives" in line]
    assert "drains could not be written" in said and "by hand" in said
    left = launch_slurm._continue(run, SLURM, 0, 0, 5, "requeue", owner=None)  # type: ignore[arg-type]
    launch_slurm._leave_to_host(run, spec, 0, left)  # type: ignore[arg-type]
    (gave_up,) = [r for r in ledger.read(run) if r["event"] == "gave_up"]
    assert "not one Slurm gives" in gave_up["reason"] and no_client.read_text() == ""
    assert verdict(ledger.read(run)) == f"gave up: {gave_up['reason']}"


def test_a_drains_only_write_that_fails_leaves_another_launchers_requeue_standing(
        no_client: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher that sent the job on wrote its requeue; a later one (fenced off) fails
    to add its drains (a lock that timed out on NFS): the requeue still comes, and the run
    still goes on for what waits for it."""
    run = no_client.parents[1]
    exclusion.declare_bad(run, 0, 0, 1, {"host": "h2", "slurm_node": "n2"}, "lost: silent", drain=True)
    spec = type("Spec", (), {"bad_nodes": "drain"})()
    left = launch_slurm._continue(run, SLURM, 0, 0, 5, "requeue", owner=None)  # type: ignore[arg-type]
    launch_slurm._leave_to_host(run, spec, 0, left)  # type: ignore[arg-type]

    def refused(_self: object, _path: Path) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(HostActions, "write", refused)
    launch_slurm._leave_to_host(run, spec, 0, None)  # type: ignore[arg-type]
    assert HostActions.parse(no_client.read_text()).job == "12"  # type: ignore[union-attr]
    assert verdict(ledger.read(run)) is None


@pytest.mark.parametrize("action, host, needle", [
    ("requeue", True, "requeue: the batch script runs it after srun returns"),
    ("drain", True, "drain: the batch script runs it after srun returns"),
    ("requeue", False, "requeue: it is not done"),
    ("guard", True, "guard: it is not done"),
])
def test_the_launchers_line_says_where_the_action_goes(no_client: Path, monkeypatch: pytest.MonkeyPatch,
                                                       action: str, host: bool, needle: str) -> None:
    if not host:
        monkeypatch.delenv(hostside.ENV)
    assert hostside.missing(action).endswith(needle)


def test_without_a_client_or_host_block_the_run_gives_up_in_one_line(
        no_client: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hostside.ENV)
    run = no_client.parents[1]
    assert launch_slurm._continue(run, SLURM, 0, 0, 5, "requeue", owner=None) is None  # type: ignore[arg-type]
    assert launch_slurm._continue(run, SLURM, 0, 0, 5, "chain", owner=None) is None  # type: ignore[arg-type]
    reasons = [r["reason"] for r in ledger.read(run) if r["event"] == "gave_up"]
    assert len(reasons) == 2 and all("needs Slurm's client" in r for r in reasons)
    assert not no_client.read_text()


SRUN = """#!/bin/bash
# a launcher's decision, written as the launcher writes it (rename over the script's file)
[ -e "$HPCSHARD_HOST_ACTIONS" ] && [ ! -s "$HPCSHARD_HOST_ACTIONS" ] || exit 90
printf '%s' "$DECISION" > "$HPCSHARD_HOST_ACTIONS.new"
mv "$HPCSHARD_HOST_ACTIONS.new" "$HPCSHARD_HOST_ACTIONS"
exit 3
"""
SCONTROL = """#!/bin/bash
echo "$*" >> "$SCONTROL_LOG"
case "$*" in *"$FAIL_ONCE"*) [ -e "$SCONTROL_LOG.failed" ] || { touch "$SCONTROL_LOG.failed";
  echo "slurm_requeue error: Socket timed out on send/recv operation" >&2; exit 1; } ;; esac
case "$*" in *"$PENDING"*) echo "Job is pending execution" >&2; exit 1 ;; esac
case "$*" in *"$DENY"*) echo "slurm_update error: Access/permission denied" >&2; exit 1 ;; esac
case "$*" in *"$BLIP"*) echo "slurm_requeue error: Unable to contact slurm controller (connect failure)" >&2
  exit 1 ;; esac
case "$*" in *"$CANCEL"*) kill -TERM "$PPID" ;; esac  # (scancel, while the host block runs)
"""
SLEEP = """#!/bin/bash
echo "sleep $*" >> "$SCONTROL_LOG"
"""
SQUEUE = """#!/bin/bash
echo "squeue $*" >> "$SCONTROL_LOG"
printf '%s\\n' $SQUEUE_JOBS
"""


def host_block(tmp_path: Path, decision: str, fail_once: str = "never", pending: str = "never",
               array: str = "", deny: str = "never", blip: str = "never", cancel: str = "never",
               setup: tuple[str, ...] = (), squeue: str = "12",
               ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The whole rendered script, run by bash with a stand-in srun, scontrol and squeue
    (`squeue`: the jobs it lists on any node; by default this one alone)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("sleep", SLEEP), ("squeue", SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    req = SbatchRequest(job_name="x", nodes=2, gpus_per_node=0, run_dir=tmp_path / "run dir", array=array,
                        setup=list(setup))
    script = tmp_path / "job.sh"
    script.write_text(render(req, "python -m x", tmp_path / "submitit"))
    log = tmp_path / "scontrol.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "12",
           "SLURM_ARRAY_TASK_ID": "4", "SLURM_JOB_NUM_NODES": "2", "DECISION": decision,
           "SCONTROL_LOG": str(log), "FAIL_ONCE": fail_once, "PENDING": pending, "DENY": deny,
           "BLIP": blip, "CANCEL": cancel, "SQUEUE_JOBS": squeue}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_host_block_drains_then_requeues_what_the_launcher_wrote(tmp_path: Path) -> None:
    proc, calls = host_block(tmp_path, ACTIONS.text().replace("12_3", "12"))
    assert proc.returncode == 3, proc.stderr  # srun's: the job's exit code is the launchers'
    assert calls == ["update NodeName=n4 State=DRAIN Reason=hpcshard run: straggler",
                     "squeue -h -t R,S,CG -w n2,n5 -o %A", "update NodeName=n2,n5 State=DOWN Reason=lost",
                     "requeuehold 12", "update JobId=12 ExcNodeList=n2,gpu-07.rack1 NumNodes=2", "release 12"]
    assert (tmp_path / "run dir" / "launch" / "host-12.0").exists()
    assert "hpcshard (batch host): requeue 12" in proc.stderr


def test_host_block_sets_no_node_down_that_another_job_runs_on(tmp_path: Path) -> None:
    """The job did not have its nodes to itself (no --exclusive): a DOWN of its lost nodes
    would end the other jobs there too (Slurm fails every job on a DOWN node). They stay
    drained; Slurm marks them DOWN itself after SlurmdTimeout, if they are gone."""
    proc, calls = host_block(tmp_path, ACTIONS.text().replace("12_3", "12"), squeue="12 345")
    assert calls == ["update NodeName=n4 State=DRAIN Reason=hpcshard run: straggler",
                     "squeue -h -t R,S,CG -w n2,n5 -o %A", "requeuehold 12",
                     "update JobId=12 ExcNodeList=n2,gpu-07.rack1 NumNodes=2", "release 12"], proc.stderr
    assert "n2,n5 not set DOWN: job 345 runs there too" in proc.stderr


@pytest.mark.parametrize("decision, expected", [
    ("", []),  # the launchers had a client, or nothing to do: the file stays empty
    (HostActions("12").text()[:-4], []),  # not whole: never acted on
    (HostActions("12").text(), ["requeue 12"]),
    (HostActions("12", nodes=1).text(), ["requeuehold 12", "update JobId=12 NumNodes=1", "release 12"]),
])
def test_host_block_acts_on_a_whole_file_only(tmp_path: Path, decision: str, expected: list[str]) -> None:
    proc, calls = host_block(tmp_path, decision)
    assert proc.returncode == 3 and calls == expected, proc.stderr


def test_host_block_retries_a_blip_and_takes_pending_for_done(tmp_path: Path) -> None:
    proc, calls = host_block(tmp_path, HostActions("12").text(), fail_once="requeue")
    assert calls == ["requeue 12", "sleep 1", "requeue 12"] and "Socket timed out" in proc.stderr
    (tmp_path / "again").mkdir()
    proc, calls = host_block(tmp_path / "again", HostActions("12").text(), pending="requeue")
    assert proc.returncode == 3 and calls == ["requeue 12"]  # an earlier try took: not asked five times


def test_host_file_of_an_array_task_is_in_its_own_run_directory(tmp_path: Path) -> None:
    proc, calls = host_block(tmp_path, HostActions("3_4").text(), array="0-9%2")
    assert calls == ["requeue 3_4"], proc.stderr
    assert (tmp_path / "run dir" / "task-4" / "launch" / "host-12.0").exists()


def test_requeue_event_records_host() -> None:
    rec = events.record(events.Requeue(attempt=1, job="12", host=True))
    assert rec["host"] is True and "host" not in events.record(events.Requeue(attempt=1, job="12"))


def test_a_later_launchers_drains_keep_the_requeue_another_one_wrote(no_client: Path) -> None:
    """Two launchers of one attempt write: the one that sends the job on (`continue-N`) and
    one that ended otherwise (`host-N`: a node fenced off, e.g. one thawed after its peers
    declared it lost and went on). srun waits for the later one, whose drains-only write
    must not take the requeue away (the ledger already says the batch script requeues)."""
    run = no_client.parents[1]
    exclusion.declare_bad(run, 0, 0, 1, {"host": "h2", "slurm_node": "n2"}, "lost: silent", drain=True)
    spec = type("Spec", (), {"bad_nodes": "drain"})()
    left = launch_slurm._continue(run, SLURM, 0, 0, 5, "requeue", owner=None)  # type: ignore[arg-type]
    launch_slurm._leave_to_host(run, spec, 0, left)  # type: ignore[arg-type]
    exclusion.declare_bad(run, 0, 0, 0, {"host": "h1", "slurm_node": "n1"}, "straggler: slow", drain=True)
    launch_slurm._leave_to_host(run, spec, 0, None)  # type: ignore[arg-type]  # (the fenced one, later)
    actions = HostActions.parse(no_client.read_text())
    assert actions is not None and (actions.job, actions.exclude) == ("12", ["n2"])
    assert {(tuple(d.nodes), d.state) for d in actions.drains} == {(("n2",), "DRAIN"), (("n2",), "DOWN"),
                                                                  (("n1",), "DRAIN")}
    # and the other order: the requeue's writer keeps drains written before it
    no_client.write_text("")
    launch_slurm._leave_to_host(run, spec, 0, None)  # type: ignore[arg-type]
    launch_slurm._leave_to_host(run, spec, 0, left)  # type: ignore[arg-type]
    again = HostActions.parse(no_client.read_text())
    assert again is not None and again.job == "12" and len(again.drains) == 3


def test_host_block_takes_slurms_refusal_at_once(tmp_path: Path) -> None:
    """A drain refused (no operator rights: the default bad_nodes = drain, and a user may
    not) is Slurm's answer, as the launcher takes it (tried once): five tries and 15 s of
    sleeps a drain would push the requeue towards the time limit."""
    drains = [Drain(["n4"], "DRAIN", "slow"), Drain(["n2"], "DOWN", "lost")]
    proc, calls = host_block(tmp_path, HostActions("12", drains=drains).text(), deny="NodeName")
    assert calls == ["update NodeName=n4 State=DRAIN Reason=slow", "squeue -h -t R,S,CG -w n2 -o %A",
                     "update NodeName=n2 State=DOWN Reason=lost", "requeue 12"], proc.stderr
    assert "Access/permission denied" in proc.stderr


def test_host_block_releases_a_hold_that_may_have_taken(tmp_path: Path) -> None:
    """requeuehold without an answer (the controller away the whole while) may have taken:
    the release follows, or the job stays held for good (`cluster.requeue` does the same)."""
    proc, calls = host_block(tmp_path, HostActions("12", ["n2"]).text(), blip="requeuehold")
    assert calls.count("requeuehold 12") == 5 and calls[-1] == "release 12", proc.stderr
    (tmp_path / "refused").mkdir()
    proc, calls = host_block(tmp_path / "refused", HostActions("12", ["n2"]).text(), deny="requeuehold")
    assert calls == ["requeuehold 12"], proc.stderr  # refused: nothing is held


def test_a_job_cancelled_while_the_host_block_runs_is_not_requeued(tmp_path: Path) -> None:
    """scancel during the drains (SIGTERM to the batch script, then SIGKILL after KillWait):
    Slurm requeues a cancelled job that is still completing (measured on the local
    cluster: it ran again), so the script must not ask."""
    decision = HostActions("12", drains=[Drain(["n4"], "DRAIN", "slow")]).text()
    proc, calls = host_block(tmp_path, decision, cancel="NodeName")
    assert calls == ["update NodeName=n4 State=DRAIN Reason=slow"], proc.stderr
    assert "not requeued" in proc.stderr
    (tmp_path / "own").mkdir()  # the requeue's own SIGTERM does not stop what follows it
    proc, calls = host_block(tmp_path / "own", HostActions("12", ["n2"]).text(), cancel="requeuehold")
    assert calls == ["requeuehold 12", "update JobId=12 ExcNodeList=n2", "release 12"], proc.stderr


def test_host_block_retries_what_the_launcher_retries() -> None:
    from hpcshard.slurm import client

    text = (Path(__file__).parents[2] / "templates" / "sbatch.j2").read_text()
    block = text[text.index("{% block host %}"):]
    assert all(f'-e "{t}"' in block for t in client.TRANSIENT), client.TRANSIENT


def test_host_block_runs_under_a_setup_that_sets_errexit(tmp_path: Path) -> None:
    """`set -e` in a site's setup lines was harmless while srun ended the script; srun's
    status after a stop is the launchers' 75, and errexit would end the script there,
    the requeue the launchers left to it never done."""
    proc, calls = host_block(tmp_path, HostActions("12").text(), setup=("set -eu",))
    assert proc.returncode == 3 and calls == ["requeue 12"], proc.stderr
