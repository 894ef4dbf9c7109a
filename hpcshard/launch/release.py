"""A run that is over releases its allocation, a frozen node or not.

A job whose attempt lost a node (frozen, dead, cut off) and ended all the same (done on a
spare, or on fewer nodes; given up; continued in another job) does not end by itself: its
srun waits for the lost node's task, which never answers, and a job that ends anyway stays
COMPLETING while the controller waits for that node. Both last until Slurm marks the node
DOWN after SlurmdTimeout (300 s by default; 380 to 460 s measured here), holding every
node of the job, the run's continuation (`afterany`) and `submit --follow` with it.

Measured on the local cluster (3 nodes, --no-kill, the middle one frozen after the other
two tasks ended; seconds from the action to the job leaving RUNNING/COMPLETING):
- nothing: minutes (SlurmdTimeout);
- `scancel JOB.STEP`: srun gives up after KillWait + 2 s and exits 0, the batch script
  ends, the healthy nodes go idle, but the job stays COMPLETING (more than 100 s). A task
  still running then is SIGKILLed at once (srun exits 137: the job FAILS);
- `scancel --signal=KILL JOB.STEP`: hangs on the frozen slurmd, nothing ends;
- `scontrol update JobId=J NodeList=<the others>`: the frozen node leaves the job, but srun
  still waits for its task: the job stays RUNNING (more than 100 s);
- the two together (the node given up, then the step cancelled after the tasks left have
  exited): 7.4 to 9 s, COMPLETED (KillWait=5) in a bare job; but the controller ends the
  step as soon as the nodes kept have no task left, and a cancel that comes after it finds
  no step (seen with hpcshard's launchers), while srun still waits;
- `scontrol update NodeName=N State=DOWN` (operators only) once the healthy tasks have
  ended: 0.6 s, COMPLETED; it ends the step and gives the node up. It kills the whole
  step, healthy tasks included: never while they run.

So one launcher of the nodes left, once the others have ended, has it done from outside the
step: it writes a `release` line (`hostside.StepRelease`: the step, the job's exit code, the
nodes to set DOWN) to the batch script's host-actions file, and the script's watch (the
`host_setup` block of templates/sbatch.j2, exported as HPCSHARD_HOST_WATCH=1), which runs in
the batch step on the batch host, acts on it while srun still waits, 10 polls (10 s or
more) after the line shows up. With `bad_nodes = drain` (the run may set nodes' states, and
the lost ones are drained already) the lost nodes are set DOWN, and the job ends COMPLETED
within seconds of the run's end; else the step is cancelled: srun and the batch script end
and the healthy nodes are free again, but the job stays COMPLETING until Slurm marks the
lost node DOWN. The script then exits with the job's exit code (`rundir.chain.job_exit`: 0
for a run done or going on, 1 for one that ended otherwise), whatever srun says.

Not from a helper process of the launcher's where the script watches: under
`ProctrackType=proctrack/cgroup` (most sites) slurmstepd kills what is left in the step's
cgroup once the node's task has exited (Slurm's slurmstepd/mgr.c), the helper with it. Where
the script does not watch (a site template that replaced `host_setup`, a script from before
the watch), a launcher with Slurm's client still leaves that helper (`after_exit`, `main`),
which acts only where proctrack/linuxproc lets it outlive the task (the local cluster: no
cgroups in its container). `hpcshard run` inside an allocation the user holds has no batch
script: the command, which runs outside its step, cancels that step itself (`plan` with
`held`; `launch.allocation.StepEnd`), and sets no node DOWN (that would end an allocation
made without --no-kill, the user's shell with it).

Nothing of the run is lost (the attempt's end and its last checkpoint are
written before any launcher gets here)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcshard.launch import hostside
from hpcshard.rundir import events, launchers, ledger
from hpcshard.rundir.chain import job_exit
from hpcshard.rundir.events import EndReason
from hpcshard.slurm import cluster
from hpcshard.slurm.env import SlurmEnv, expand_nodelist

OTHERS_WAIT_S = 30.0
"""How long the releasing launcher waits for the other launchers of the nodes kept to end
(node 0's serves the launchers' store until the others have left, up to
`supervise.LINGER_S`): a task the step's cancel ends is one whose exit code srun reports."""
POLL_S = 0.5
CLOSING = ("end", "requeue", "chain", "guard", "gave_up")
"""The records that close an attempt (or say what came of its end)."""


@dataclass(frozen=True)
class Release:
    """What to do: give up `lost` and end the step on `keep`."""

    keep: tuple[str, ...]
    lost: tuple[str, ...]
    outcome: str
    """How the attempt ended, for the record (`done`, `gave_up`, `chain`, ...)."""


def plan(records: list[dict[str, Any]], attempt: int, nodes: list[str], me: str, *,
         held: bool = False) -> Release | None:
    """Should this job give up its lost nodes and end its step now? Only once this attempt
    is closed for this job: its last closing record is an end that no continuation follows
    in the same job (any but stop and fault, which are requeued or continued: their next
    record says which), a continuation job (`chain`) or a give-up; never a requeue (the same
    job goes on: `_down_lost`). Only for nodes of this job that the attempt lost (silent:
    frozen or dead; a node drained for a failed health check ends its launcher by itself),
    never from a lost node (one thawed late has nothing to say), nor when the batch node is
    lost (Slurm runs the batch script on the job's first node: that job is an orphan,
    `_orphaned`, and giving its batch node up is refused).

    `held`: a run inside an allocation the user holds (`hpcshard run`, `launch.allocation`):
    nothing requeues or continues it, so a stop and a fault's end close the attempt too, and
    no batch script runs on the first node (the command runs on salloc's host, outside the
    step), so that node is given up like any other. And there, a rank's report of its own
    crash (`crashed`) closes nothing: the command polls while the launchers still decide, and
    they answer it with a restart (a `start` once the newest checkpoint is loaded, a minute
    or more later) or with an end of their own."""
    closing = [r for r in records if r.get("event") in (*CLOSING, "start") and r.get("attempt") == attempt
               and not (held and crashed(r))]
    if not closing or closing[-1]["event"] == "start":
        return None  # (killed from outside: nothing says the run is over; an end a rank wrote
        # before the launchers restarted it, an error say, closed only the cycle before)
    last = closing[-1]
    if last["event"] in ("requeue", "guard"):
        return None
    if last["event"] == "end" and last.get("reason") in (EndReason.STOP, EndReason.FAULT) and not held:
        return None
    lost = sorted({str(r["slurm_node"]) for r in ledger.bad_node_records(records, attempt, lost=True)
                   if r.get("slurm_node") in nodes})
    if not lost or me in lost or (nodes[0] in lost and not held):
        return None
    outcome = str(last.get("reason", "")) if last["event"] == "end" else str(last["event"])
    return Release(keep=tuple(n for n in nodes if n not in lost), lost=tuple(lost), outcome=outcome)


def crashed(record: dict[str, Any]) -> bool:
    """Is `record` rank 0's end as its exception left it (`runtime.main._failed`: its own
    bug, or a peer's death), which its launchers have yet to answer? Not a user error (never
    restarted), nor a launcher's end (no cycle: a script's exit code, after the launchers)."""
    return (record.get("event") == "end" and record.get("reason") == EndReason.ERROR and "cycle" in record
            and not record.get("user_error"))


def release(run: Path, slurm: SlurmEnv, attempt: int, down: bool) -> None:
    """Carry out `plan` from one launcher of this job (the first to claim it), once the
    other launchers kept have ended. `down` (bad_nodes = drain: the run may set nodes'
    states): the lost nodes are set DOWN, which ends the step and gives them up at once;
    else the step is cancelled. Where the batch script watches (`hostside.watched`) it acts,
    from outside the step, and then exits with the job's exit code (`chain.job_exit` of the
    very records that say the attempt is closed, not this launcher's own: that is 0 where
    another launcher gave the run up, `slurm.task_exit`); else, with Slurm's client here, a
    helper this launcher leaves behind acts once it has exited (`after_exit`: only where
    proctrack/linuxproc lets the helper outlive the task)."""
    me = slurm.nodes[slurm.node_id] if slurm.node_id < len(slurm.nodes) else ""
    records = ledger.read(run)
    decided = plan(records, attempt, slurm.nodes, me)
    if decided is None or not slurm.step_id:
        return
    if not launchers.claim(run, f"release-{slurm.job_id}-{slurm.restart_count}"):
        return
    step, lost = f"{slurm.job_id}.{slurm.step_id}", ",".join(decided.lost)
    watched = hostside.watched()
    if not watched and not hostside.has_client("release"):
        print(f"hpcshard: attempt {attempt} ended ({decided.outcome}) with lost node(s) {lost}: "
              f"{hostside.missing('release')}; the job ends when Slurm marks them DOWN",
              file=sys.stderr, flush=True)
        return
    _others_end(run, slurm, decided.keep)
    reason = f"hpcshard {run.name}: lost: silent"
    if watched:
        watched = _to_script(hostside.StepRelease(step, job_exit(records), list(decided.lost) if down else [],
                                                  reason))
        if not watched and not hostside.has_client("release"):
            return
    # What was asked, not what came of it: the watch (or helper) acts after this launcher
    # has exited, and may find another job on a lost node, or Slurm may refuse the DOWN;
    # then it cancels the step instead, and says so in the batch log (or the helper's). A
    # `node_down` written here said "set DOWN" of nodes that never were.
    by = "the batch script" if watched else "a helper left by this launcher"
    asked = (f"{by} is asked to set {lost} DOWN (or, where another job runs there or Slurm refuses, to "
             f"cancel step {step})" if down else f"{by} is asked to cancel step {step}")
    with contextlib.suppress(OSError):
        ledger.append(run, events.Cancel(attempt=attempt, job=step, reason=(
            f"the run's attempt ended ({decided.outcome}) with lost node(s) {lost}: {asked} once the "
            "launchers have exited, not when Slurm marks them DOWN")))
    print(f"hpcshard: attempt {attempt} ended ({decided.outcome}) with lost node(s) {lost}: {asked}",
          file=sys.stderr, flush=True)
    if not watched:
        after_exit(slurm.job_id, slurm.step_id, lost if down else "", reason)


def _to_script(given: hostside.StepRelease) -> bool:
    """Write the release for the batch script's watch (merged with what the file holds);
    False when it could not be written."""
    try:
        hostside.HostActions(release=given).write(Path(hostside.host_file() or ""))
    except (OSError, ValueError, TimeoutError) as err:
        print(f"hpcshard: the release could not be written for the batch script ({err})",
              file=sys.stderr, flush=True)
        return False
    return True


_WAITING: list[subprocess.Popen[bytes]] = []
"""The helper `after_exit` started: its pipe stays open until this process exits."""
AFTER_EXIT_S = 10.0
"""How long the helper waits after the launcher's exit before it acts: the task's exit
status reaches srun first, and the other launchers of the nodes kept, whose pid files are
gone (`_others_end`) but which still write submitit's result and shut their interpreter
down, get the time to exit (a task still running when the step ends is killed, srun then
reports 137 and the finished run's job ends FAILED, holding back an afterok follower).
Nothing orders those exits; 10 s makes the race unlikely on slow shared storage, at 10 s
of the release's cost (against Slurm's SlurmdTimeout, 300 s by default, without it)."""


def after_exit(job_id: str, step: str, down: str, reason: str) -> None:
    """Once this launcher has exited, set the nodes `down` DOWN, or (none, or refused)
    cancel the step, from a helper it leaves behind (`main`). Not from the launcher itself:
    either one kills the step's tasks still running at once (measured: "task 0: Killed",
    srun exits 137 and the job FAILS, a TERM handler or not), and the launcher is one of
    them. The helper reads a pipe whose other end only this process holds: end of file is
    this process's exit."""
    try:
        _WAITING.append(subprocess.Popen(
            [sys.executable, "-m", "hpcshard.launch.release", job_id, step, down, reason],
            stdin=subprocess.PIPE, start_new_session=True))
    except OSError as err:
        print(f"hpcshard: step {job_id}.{step} is left to Slurm ({err}): the job ends when Slurm marks "
              "its lost nodes DOWN", file=sys.stderr, flush=True)


def holds(info: cluster.JobInfo | None, lost: list[str]) -> bool:
    """Does the job still hold what the helper is to give up? Not once it has ended, nor
    when a node to set DOWN is no longer one of its nodes: the job ended by itself while
    the helper waited, and the node, thawed, may be back in service and another job's (a
    DOWN would kill that job). Unknown (Slurm did not answer): as before, it acts."""
    if info is None:
        return True
    if not info.state.running:  # (its steps run or are ending: it holds its nodes)
        return False
    mine = set(expand_nodelist(info.nodes)) if info.nodes else set(lost)
    return all(node in mine for node in lost)


def main(argv: list[str] | None = None) -> int:
    """`python -m hpcshard.launch.release JOB STEP DOWN REASON`: once the launcher that
    started this has exited (end of file on stdin), set the nodes DOWN (comma-separated;
    none: ""), or cancel its step. Either kills this helper too (it is in the step):
    whatever it says after is not heard."""
    job_id, step, down, reason = (sys.argv[1:] if argv is None else argv)[:4]
    sys.stdin.buffer.read()
    time.sleep(AFTER_EXIT_S)
    if not holds(cluster.show_job(job_id, timeout=30), down.split(",") if down else []):
        return 0
    if down:
        why = cluster.shared(down.split(","), job_id)  # (a DOWN ends every job on the node)
        try:
            if not why:
                cluster.drain(down, reason, "DOWN")
                return 0
        except cluster.SlurmError as err:
            why = str(err)
        print(f"hpcshard: {down} not set DOWN ({why}); cancelling step {job_id}.{step}",
              file=sys.stderr, flush=True)
    try:
        cluster.end_step(job_id, step)
    except cluster.SlurmError as err:
        print(f"hpcshard: step {job_id}.{step} was not cancelled ({err}): the job ends when Slurm marks "
              "its lost nodes DOWN", file=sys.stderr, flush=True)
        return 1
    return 0


def _others_end(run: Path, slurm: SlurmEnv, keep: tuple[str, ...]) -> None:
    """Wait (up to OTHERS_WAIT_S) until the launchers of the nodes kept, but this one, have
    ended: each removes its pid file as it leaves `run_node` (`launchers.pid_file`, by its
    SLURM_NODEID, the node's place in the job's node list)."""
    others = [i for i, node in enumerate(slurm.nodes) if node in keep and i != slurm.node_id]
    deadline = time.monotonic() + OTHERS_WAIT_S
    while any(launchers.pid_file(run, i).exists() for i in others) and time.monotonic() < deadline:
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
