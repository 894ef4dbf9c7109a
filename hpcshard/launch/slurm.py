"""Inside a Slurm allocation: what submitit runs on every node (`node_main`, a name that
queued and chained jobs unpickle: it must not move), the rendezvous, and what happens
after a clean stop (requeue, a continuation job, or nothing)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from hpcshard.launch import hostside
from hpcshard.launch.node import NodeEnv, run_node
from hpcshard.launch.release import release
from hpcshard.rundir import events, launchers, lease, ledger
from hpcshard.rundir.chain import job_exit
from hpcshard.rundir.files import write_atomic, written
from hpcshard.rundir.launchers import attempt_file
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.proc import clock
from hpcshard.rundir.rankenv import DEADLINE_VARS, NOTICE, REQUEUE_EXIT, RankEnv
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm import cluster
from hpcshard.slurm.env import SlurmEnv, expand_nodelist
from hpcshard.slurm.sbatch import SbatchRequest, ranged_script
from hpcshard.slurm.submit import job_paths

__all__ = ["SlurmEnv", "expand_nodelist", "coord_port", "node_env", "node_main", "rdzv_port"]


def rdzv_port(job_id: str, restart: int) -> int:
    """A port for this job's rendezvous on its first node, below Linux's ephemeral range.

    Derived from the job id, so every node computes the same one without talking, two jobs
    sharing a node differ, and a requeued attempt does not meet its predecessor's store.
    """
    digits = int(re.sub(r"\D", "", job_id) or 0)
    return 20000 + (digits * 7 + restart * 3) % 10000


def coord_port(job_id: str, restart: int) -> int:
    """Where node 0's launcher serves the launchers' store (`launch.coord`): derived like
    the rendezvous port, half the range away from it."""
    return 20000 + (rdzv_port(job_id, restart) - 20000 + 5000) % 10000


def limit_ends(job_id: str) -> float | None:
    """When the job's time limit ends, on this host's boot clock (`RankEnv.deadline`): the
    controller's time left (`cluster.time_left`, a duration) counted from the moment it was
    asked, which is no later than the moment scontrol read its clock for RunTime (a slow
    answer makes the deadline earlier, never later). None: no limit known."""
    asked = clock()
    left = cluster.time_left(job_id)
    return None if left is None else asked + left


def export(ranks: RankEnv) -> None:
    """This launcher's ranks' variables, into its environment (its ranks and every later
    restart's inherit them), without a deadline that came with the environment."""
    for name in DEADLINE_VARS:
        os.environ.pop(name, None)
    os.environ.update(ranks.to_environ())


def node_env(slurm: SlurmEnv, per_node: int) -> NodeEnv:
    """This node's place in the job: the rendezvous on the allocation's first node."""
    return NodeEnv(node_rank=slurm.node_id, nnodes=len(slurm.nodes), per_node=per_node,
                   rdzv_host=slurm.nodes[0], rdzv_port=rdzv_port(slurm.job_id, slurm.restart_count),
                   run_id=f"{slurm.job_id}-{slurm.restart_count}",
                   coord_port=coord_port(slurm.job_id, slurm.restart_count))


def _resubmit(run_dir: Path, job_id: str, *args: str, ranged: bool = False) -> str:
    """Submit job `job_id`'s script again (with sbatch `args`, a dependency on it among
    them), excluding the run's bad nodes. `ranged`: for a range of node counts (`--nodes=N-M`
    among `args`), without the script's task counts (`sbatch.ranged_script`). Returns the new id."""
    old = job_paths(RunPaths(run_dir).submitit, job_id)
    bad = ledger.bad_slurm_nodes(run_dir)
    script = Path(old.submission_file)
    if ranged:  # (byte for byte but for the directives: any encoding, the mode kept)
        script = script.with_name(f"{job_id}_ranged_submission.sh")
        text = Path(old.submission_file).read_bytes().decode("utf-8", "surrogateescape")
        with written(script, mode=Path(old.submission_file).stat().st_mode & 0o777) as f:
            f.write(ranged_script(text).encode("utf-8", "surrogateescape"))
    # (SBATCH_USE_MIN_NODES, which a user's shell hands the job, would hold a range to N)
    new = cluster.sbatch(*args, *([f"--exclude={','.join(bad)}"] if bad else []), str(script),
                         unset=("SBATCH_USE_MIN_NODES",) if ranged else ())
    # Under its own id, what submitit wrote for the first job: the pickle it unpickles, and
    # the script the next continuation is submitted from. (It cannot start before they are
    # there: it waits for this job to end (its dependency), or it was submitted held.)
    now = job_paths(old.folder, new)
    shutil.copy(old.submitted_pickle, now.submitted_pickle)
    shutil.copy(script, now.submission_file)
    return new


def chain(run_dir: Path, job_id: str, attempt: int, owner: lease.Owner, after: bool = True) -> str:
    """Submit a continuation of this job that starts when it ends (`afterany`): the same
    script and submitit pickle under a new job id, and hand it the run (`owner`: this
    job's lease). Returns the new id. `after=False`: at once, on other nodes (this job is
    an orphan, cancelled next: see `_orphaned`)."""
    # At once: held until what it starts from is written (its pickle, its attempt number,
    # the run's lease), or it could start before and find none of it.
    new = _resubmit(run_dir, job_id, f"--dependency=afterany:{job_id}" if after else "--hold")
    chained = attempt_file(run_dir, new)
    chained.parent.mkdir(exist_ok=True)
    write_atomic(chained, f"{attempt}\n")
    RunSpec.add_job(run_dir, new)
    if lease.hand_over(run_dir, owner, lease.Owner.of_job(new)) is None:
        with contextlib.suppress(ValueError):
            cluster.scancel(new)
        raise ValueError(f"the run was taken over by {_owner_name(run_dir)}: continuation {new} cancelled")
    _carry(run_dir, job_id, new)
    if not after:
        try:
            cluster.release(new)
        except cluster.SlurmError as err:
            raise ValueError(f"continuation {new} stays held ({err}); `scontrol release {new}` "
                             "starts it") from None
    return new


def _carry(run_dir: Path, old: str, new: str) -> None:
    """What waits for the run (`submit --after`, `--then`) waits for its new job now."""
    from hpcshard.launch.then import carry

    for line in carry(run_dir, old, new):
        print(f"hpcshard: {line}", file=sys.stderr, flush=True)


def _owner_name(run_dir: Path) -> str:
    owner = lease.read(run_dir)
    return owner.what or owner.name if owner else "nobody"


GUARD_WAIT_S = 60.0
"""How long a guard's other launchers wait for the one that takes the run over."""


def guard(run_dir: Path, job_id: str) -> str:
    """Submit job `job_id`'s guard: the same script, held until the job ends in a failed
    state (afternotok) and dropped by Slurm when it completes (kill-on-invalid-dep). A job
    with --no-kill outlives a failed node except the one running its batch script: Slurm
    then kills the batch step and the job FAILS, with no requeue (measured: `scontrol
    update State=DOWN` of the batch node, JobLaunchFailure); a chain's job (--no-requeue)
    is never requeued when a node fails. The guard then takes the run over from its last
    checkpoint. Returns the guard's id."""
    spec = RunSpec.read(run_dir)
    fewest = min(spec.nodes, spec.min_nodes or spec.nodes)
    # A node less (the failed one) may leave no room for the spares: fewer are taken then,
    # and all of them where they are idle (`sbatch.ranged_script`: Slurm gave a guard the least
    # count while idle nodes waited, and a run on spares then had none).
    new = _resubmit(run_dir, job_id, f"--dependency=afternotok:{job_id}", "--kill-on-invalid-dep=yes",
                    f"--nodes={fewest}-{spec.nodes + spec.spares}", ranged=True)
    write_atomic(launchers.guard_file(run_dir, new), f"{job_id}\n")
    return new


def _drop_guards(run: Path, job_id: str) -> None:
    """The job was continued: its guard would only start to find nothing to do."""
    for guard_id in launchers.guards(run):
        if launchers.guarded_job(run, guard_id) == job_id:
            with contextlib.suppress(ValueError):
                cluster.scancel(guard_id)


def _take_over(run: Path, slurm: SlurmEnv, guarded: str, first_attempt: int, max_requeues: int
               ) -> int | None:
    """A guard job started: its job ended in a failed state. It takes the run over (as a
    continuation: the next attempt, from the last checkpoint) only when that job still
    owned the run (`rundir.lease`: not resumed or continued meanwhile) and Slurm says it is
    over, nobody cancelled it, its attempt never closed (no end, requeue, continuation or
    give-up: it was killed from outside), and the run's continuations have not reached
    `max_requeues` (a take-over is one: a run that fails the same way every time must not
    take itself over forever). One launcher decides; the others wait for its word. Returns
    the attempt the guard trains as, or None (it does nothing)."""
    # (the winner's word is in the guard file, not in a file new to this host: `decide_guard`)
    decided = launchers.guard_decision(run, slurm.job_id)
    chained = attempt_file(run, slurm.job_id)
    if decided is None and slurm.restart_count and chained.exists():
        # (a guard that took over before its word went into the guard file, then requeued:
        # its attempt file is long there, no name new to this host)
        return int(chained.read_text())
    if decided is None and not launchers.claim(run, f"take-over-{slurm.job_id}"):
        deadline = time.monotonic() + GUARD_WAIT_S
        while (decided := launchers.guard_decision(run, slurm.job_id)) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)
    if decided is not None:  # (another launcher of this guard decided; or this job restarted)
        return decided[0]
    info = cluster.show_job(guarded, timeout=30)
    state = info.state_text if info else ""
    led = ledger.read(run)
    attempt = max((int(r["attempt"]) for r in led), default=0)
    # Only what came after the attempt's newest start closes it: a rank's `end` (error) of a
    # cycle that the launchers then restarted in place is history, not the attempt's end.
    starts = [i for i, r in enumerate(led) if r["event"] == "start" and r.get("attempt") == attempt]
    since = led[starts[-1]:] if starts else led
    closed = [r["event"] for r in since if r.get("attempt") == attempt
              and r["event"] in ("end", "requeue", "chain", "gave_up", "guard")]
    owner = lease.read(run)
    why = (f"job {guarded} no longer owns the run ({_owner_name(run)} does)"
           if owner is not None and owner.name != lease.Owner.of_job(guarded).name else
           "its job is no longer the run's newest" if not RunSpec.read(run).newest_job(guarded) else
           f"job {guarded} ended {state}" if info is not None and info.state.ended_on_purpose else
           f"attempt {attempt} ended ({closed[0]})" if closed else
           f"the cap of {max_requeues} continuations is reached"
           if _continuations(led, first_attempt) >= max_requeues else "")
    if not why:
        try:
            lease.take(run, lease.Owner.of_job(slurm.ref), cluster.job_alive)
        except lease.Busy as err:
            why = str(err)
    if why:
        print(f"hpcshard: guard {slurm.job_id} not needed: {why}", file=sys.stderr, flush=True)
        if "cap of" in why:
            ledger.append(run, events.GaveUp(attempt=attempt, reason=f"guard job {slurm.job_id} did not "
                                             f"take the run over: {why}"))
        launchers.decide_guard(run, slurm.job_id, None, why)
        return None
    ledger.append(run, events.Guard(attempt=attempt, job=guarded, next=slurm.job_id,
                                    state=state or "unknown"))
    RunSpec.add_job(run, slurm.job_id)
    _carry(run, guarded, slurm.job_id)
    write_atomic(chained, f"{attempt + 1}\n")
    launchers.decide_guard(run, slurm.job_id, attempt + 1)
    print(f"hpcshard: job {guarded} ended {state or 'without a word'} while training: "
          f"guard job {slurm.job_id} takes the run over", file=sys.stderr, flush=True)
    return attempt + 1


def _continuations(led: list[dict[str, object]], first_attempt: int) -> int:
    """Continuations since this submission (requeues, continuation jobs, guard take-overs):
    `hpcshard resume` starts a fresh count."""
    return sum(1 for r in led if r["event"] in ("requeue", "chain", "guard")
               and int(str(r["attempt"])) >= first_attempt)


def own_run(run: Path, ref: str) -> lease.Owner | None:
    """This job's lease on the run (`rundir.lease`), or None when another job or command
    owns it (this job then exits without touching the run). A job the command that
    submitted it has not named the owner yet (sbatch returned a moment ago) waits for it;
    a run without an owner (released, or made by an older hpcshard) is taken."""
    me = lease.Owner.of_job(ref)
    deadline = time.monotonic() + lease.SUBMIT_WAIT_S
    while True:
        try:
            current = lease.read(run)
        except (lease.Busy, OSError) as err:  # unreadable: nobody may take it
            print(f"hpcshard: job {ref} exits: {err}", file=sys.stderr, flush=True)
            return None
        if current is not None and current.name == me.name:
            return current
        submitting = (current is not None and current.kind == "process" and current.process is not None
                      and current.process.alive() is not False)
        if submitting and time.monotonic() < deadline:
            time.sleep(0.5)
            continue
        if current is None or current.kind == "process":  # (one that never named this job)
            try:
                return lease.take(run, me, cluster.job_alive)
            except lease.Busy as err:
                if current is None:
                    continue  # another launcher of this job took it first
                print(f"hpcshard: job {ref} exits: {err}", file=sys.stderr, flush=True)
                return None
        print(f"hpcshard: job {ref} does not own {run} ({current.what or current.name} does); "
              "exiting", file=sys.stderr, flush=True)
        return None


def node_main(run_dir: str, per_node: int, first_attempt: int, max_requeues: int,
              resume: str = "auto", policy: str = "requeue") -> int:
    """What submitit runs in each task: one per node. Returns the node's exit code."""
    slurm = SlurmEnv.from_environ()
    run = Path(run_dir)
    taken: int | None = None
    if launchers.guard_file(run, slurm.job_id).exists():  # (a guard: it takes the run over, or not)
        taken = _take_over(run, slurm, launchers.guarded_job(run, slurm.job_id), first_attempt, max_requeues)
        if taken is None:
            return 0
    owner = own_run(run, slurm.ref)
    if owner is None:
        return 0
    spec = RunSpec.read(run)
    client = hostside.has_client()
    if not client:  # (a container without Slurm's client: what goes on without it, `hostside`)
        print(hostside.missing("requeue") + ("" if hostside.has_client("chain") else
                                             "; no guard or continuation job") + "; no deadline from Slurm",
              file=sys.stderr, flush=True)
    if spec.guarded:
        try:  # (a run directory that refuses the claim: the supervisor's probe says why)
            if launchers.claim(run, f"guard-{slurm.job_id}"):
                guard(run, slurm.job_id)
        except (OSError, ValueError) as err:  # the run goes on, unguarded
            print(f"hpcshard: no guard job ({err}); a failure of the batch node will end the run",
                  file=sys.stderr, flush=True)
    if not spec.newest_job(slurm.ref):
        print(f"hpcshard: job {slurm.ref} is not the run's newest job; exiting", file=sys.stderr)
        return 0
    chained = attempt_file(run, slurm.job_id)
    if taken is not None:  # (a guard's other launchers never look its attempt file up: NFS)
        attempt, fresh = taken + slurm.restart_count, False
    else:
        attempt = (int(chained.read_text()) if chained.exists() else first_attempt) + slurm.restart_count
        fresh = slurm.restart_count == 0 and not chained.exists()
    # The profile's notice (--signal in the sbatch script): the ranks listen for it too.
    sbatch = SbatchRequest.recorded(spec.slurm)
    ranks = RankEnv(attempt=attempt, resume=resume if fresh else "auto",
                    restart_count=slurm.restart_count, notice=sbatch.signal if sbatch else NOTICE,
                    deadline=limit_ends(slurm.ref),
                    lead=sbatch.signal_lead_s if sbatch else None, owner=owner.token)
    export(ranks)
    # submitit installed its own SIGUSR2 handler (checkpoint, then requeue from global rank
    # 0 with its own timeout bookkeeping). run_node replaces it: the notice goes to the ranks.
    code = run_node(node_env(slurm, per_node), run, stop_signal=ranks.notice_signal)
    # One launcher sends the job on: node 0's, unless it was lost.
    if code == REQUEUE_EXIT:
        _await_end(run, attempt, END_WAIT_S + spec.grace_s)
    sent_on = code == REQUEUE_EXIT and _sends_on(run, attempt, slurm.node_id)
    if sent_on:
        orphan = _orphaned(run, slurm, attempt) if policy == "chain" else ""
        left = _continue(run, slurm, attempt, first_attempt, max_requeues, policy, owner, after=not orphan)
        if orphan:
            _end_orphan(run, slurm, attempt, orphan)
        if client:
            try:
                _down_lost(run, spec, attempt, slurm.job_id)
            except OSError as err:  # (the ledger unreadable: Slurm marks them DOWN in its time)
                print(f"hpcshard: the lost nodes could not be looked up ({err}); Slurm marks them DOWN "
                      "itself after SlurmdTimeout", file=sys.stderr, flush=True)
        else:
            _leave_to_host(run, spec, attempt, left)
    elif code != REQUEUE_EXIT and not client and _claimed(run, f"host-{attempt}"):
        _leave_to_host(run, spec, attempt, None)  # (drains the run deferred, if any)
    exit_code = _task_exit(run, code, sent_on)
    if exit_code and _claimed(run, f"unguard-{slurm.job_id}"):
        _drop_guards(run, slurm.job_id)  # (the run is over: a guard would start to do nothing)
    # A job whose attempt lost a node does not end by itself (`launch.release`): not requeued,
    # one launcher gives the lost nodes up and ends the step once the others have ended, by
    # way of the batch script (a helper of its own where the script does not watch).
    try:
        release(run, slurm, attempt, down=spec.bad_nodes == "drain")
    except OSError as err:  # (the run directory unreadable: Slurm ends the step in its time)
        print(f"hpcshard: the step's release could not be planned ({err}); the job ends when Slurm "
              "marks its lost nodes DOWN", file=sys.stderr, flush=True)
    if exit_code:
        # Out through submitit (which exits 0 whatever this returns; an exception it would
        # record as the job's result first): the task's, srun's and the batch script's exit
        # code, so the job ends FAILED.
        raise SystemExit(exit_code)
    return code


def _sends_on(run: Path, attempt: int, node_id: int) -> bool:
    """Does this launcher send the job on? The first to claim it does. Where the run
    directory refuses the claim, node 0's launcher does, alone: a notice ended the run's
    wait for its storage and the decision was a requeue (`Supervisor._wait_for_storage`),
    while the storage still takes no file. The claim raised out of every launcher, nobody
    sent the job on, and a time limit's job ended TIMEOUT, which is never requeued. (Node 0
    lost as well: nobody does.)"""
    try:
        return launchers.claim(run, f"continue-{attempt}")
    except OSError as err:
        print(f"hpcshard: continue-{attempt}: the run directory refused its claim ({err}); "
              f"{'this launcher, node 0,' if node_id == 0 else 'node 0'} sends the job on",
              file=sys.stderr, flush=True)
        return node_id == 0


def _note(run: Path, event: events.Event) -> None:
    """`ledger.append` on the way out: one line where the storage refuses it (the job is
    sent on, or not, all the same; the attempt's record is what is lost)."""
    try:
        ledger.append(run, event)
    except OSError as err:
        print(f"hpcshard: the ledger refused its {event.KIND} record ({err})", file=sys.stderr, flush=True)


def _claimed(run: Path, name: str) -> bool:
    """`launchers.claim` on the way out; False, in one line, where the run directory refuses
    it (the run stopped for its storage, whose own line came first): what the claim guards
    is left undone (a guard job left finds the attempt closed, or stops on the same storage)."""
    try:
        return launchers.claim(run, name)
    except OSError as err:
        print(f"hpcshard: {name}: the run directory refused its claim ({err}); left undone",
              file=sys.stderr, flush=True)
        return False


def task_exit(job: int | None, code: int, sent_on: bool) -> int:
    """This launcher's task's exit code, from the job's (`chain.job_exit` of the ledger it
    read; None: unreadable) and its own `code`. srun exits with its tasks' highest, the
    batch script with srun's: one task's 1 ends the job FAILED (a site's KillOnBadExit
    would also end the step at once), so a task says 1 only when the run ended, and ended
    here. Not a launcher whose ranks finished, or that left the run while the others went
    on (fenced off, left out, disowned: `code` 0): the ledger may say "error" then (rank 0's
    end of the cycle the others restart from), or be another job's. Nor one whose ranks
    stopped for a continuation (REQUEUE_EXIT) unless it sent the job on (`sent_on`: its
    requeue, continuation or give-up is written by then): the others read the ledger
    before that record, a bare stop."""
    if code == 0 or (code == REQUEUE_EXIT and not sent_on):
        return 0
    if job is None:  # (the ledger unreadable: this launcher's own outcome)
        return 0 if code == REQUEUE_EXIT else 1
    return job


def _task_exit(run: Path, code: int, sent_on: bool) -> int:
    """`task_exit` of what the ledger says now."""
    try:
        job: int | None = job_exit(ledger.read(run))
    except OSError as err:
        print(f"hpcshard: the ledger could not be read for the job's exit code ({err})", file=sys.stderr,
              flush=True)
        job = None
    return task_exit(job, code, sent_on)


def _leave_to_host(run: Path, spec: RunSpec, attempt: int, requeue: events.Requeue | None) -> None:
    """Without Slurm's client here: write what `_continue` and `_down_lost` would have run
    (the requeue it left to the batch script, the attempt's deferred drains, its lost
    nodes DOWN) for the batch script, which runs it once srun returns (`hostside`)."""
    excluded = [] if requeue is None or isinstance(requeue.excluded, events.Unset) else requeue.excluded
    nodes = None if requeue is None or isinstance(requeue.nodes, events.Unset) else requeue.nodes
    path = hostside.host_file()
    try:  # (a value bash could split, e.g. a node name Slurm never gives: refused, not a traceback)
        actions = hostside.decide(run.name, ledger.bad_nodes(run, attempt), requeue.job if requeue else "",
                                  excluded, nodes, down_lost=spec.bad_nodes == "drain")
        if not (actions.job or actions.drains):
            return
        if path is None:  # (a requeue is left to a script that has the host side only)
            print(hostside.missing("drain"), file=sys.stderr, flush=True)
            return
        actions.write(Path(path))
    except (OSError, ValueError) as err:
        if requeue is None:  # (drains only: whatever the run did, it did; another launcher's
            # requeue already in the file stands, and a give-up here would end a run it continues)
            print(f"hpcshard: the batch script's drains could not be written ({err}); drain the "
                  "run's bad nodes by hand (`hpcshard status` lists them)", file=sys.stderr, flush=True)
            return
        ledger.append(run, events.GaveUp(attempt=attempt, reason=f"the batch script's actions could not be "
                                         f"written ({err}); continue with `hpcshard resume {run}`"))


def _orphaned(run: Path, slurm: SlurmEnv, attempt: int) -> str:
    """The job's batch node if this attempt lost it, else "". Such a --no-kill job never
    ends by itself (measured: that node frozen, then DOWN, the job stays RUNNING on the
    nodes left, and a continuation after it waits forever); cancelled, Slurm still holds it
    about 60 s while its step sits on the frozen node (measured in the chaos soak: 82-86 s
    from the stop to training again). So its continuation starts at once, on other nodes,
    without waiting for it: nothing of it writes to the run any more (every launcher left
    has stopped, the lost one is marked DOWN next), and only the newest job may train."""
    info = cluster.show_job(slurm.ref, timeout=30)
    batch = info.batch_host if info else ""
    lost = {r.get("slurm_node") for r in ledger.bad_nodes(run, attempt, lost=True)}
    return batch if batch and batch in lost else ""


def _end_orphan(run: Path, slurm: SlurmEnv, attempt: int, batch: str) -> None:
    """Cancel an orphaned job (`_orphaned`) now that its continuation is submitted, and
    before its lost nodes are marked DOWN (`_down_lost`: Slurm then KILLs every process of
    the step, this launcher and whatever it started). The cancel's TERM is ignored from
    here on."""
    ledger.append(run, events.Cancel(attempt=attempt, job=slurm.ref,
                                     reason=f"its batch node {batch} was lost: it cannot end by itself"))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ValueError):
        cluster.scancel(slurm.ref)


def _down_lost(run: Path, spec: RunSpec, attempt: int, job_id: str) -> None:
    """After the job is sent on: the nodes this attempt lost are frozen or dead, and a job
    with a task on one stays COMPLETING (its requeue held, its continuation waiting) until
    Slurm marks the node DOWN after SlurmdTimeout (300 s by default; measured here: 380 to
    460 s). With `bad_nodes = drain`, mark them DOWN now: the requeued job runs again 0.6 s
    later (measured). Not while the run trains: DOWN kills the whole job step, the healthy
    nodes' tasks included (srun exits 137). A job that is not requeued (the run done on a
    spare, continued in another job, given up) is released by `launch.release`, once its
    launchers have exited. Never a node another job runs on too: a DOWN ends every job on
    it, other users' where the job shares its nodes (`cluster.shared`)."""
    if spec.bad_nodes != "drain":
        return
    lost = sorted({r["slurm_node"] for r in ledger.bad_nodes(run, attempt, lost=True) if r.get("slurm_node")})
    if not lost:
        return
    shared = cluster.shared(lost, job_id)
    if shared:
        why = f"not set DOWN: {shared}; Slurm marks them DOWN itself after SlurmdTimeout"
        ledger.append(run, events.NodeDown(attempt=attempt, slurm_node=",".join(lost), error=why))
        print(f"hpcshard: lost node(s) {','.join(lost)} {why}", file=sys.stderr, flush=True)
        return
    # Recorded first and in one call: marking a node of this job DOWN kills this very
    # launcher (the whole step), so nothing after it runs (one call per node downed one).
    for node in lost:
        ledger.append(run, events.NodeDown(attempt=attempt, slurm_node=node))
    try:
        cluster.drain(",".join(lost), f"hpcshard {run.name}: lost: silent", "DOWN")
    except cluster.SlurmError as err:
        ledger.append(run, events.NodeDown(attempt=attempt, slurm_node=",".join(lost), error=str(err)))


def _fewer_nodes(run: Path, slurm: SlurmEnv, attempt: int, bad: list[str]) -> int | None:
    """With the run's bad nodes excluded, can the partition still hold the job? None: as
    it is. Fewer: without (some of) its spares, or down to `min_nodes`. 0: not at all:
    the run gives up (recorded) instead of waiting in the queue forever."""
    spec = RunSpec.read(run)
    info = cluster.show_job(slurm.ref, timeout=30)
    partition = info.partition if info else ""
    usable = cluster.usable_nodes(partition, bad) if partition else None
    wanted = len(slurm.nodes)
    if usable is None or usable >= wanted:
        return None
    fewest = min(spec.nodes, spec.min_nodes or spec.nodes)
    if usable >= fewest:
        return usable
    ledger.append(run, events.GaveUp(
        attempt=attempt, reason=f"the run's bad nodes ({','.join(bad)}) leave partition {partition} "
        f"{usable} usable node(s); it needs {fewest}: continue elsewhere with "
        f"`hpcshard resume {run} --nodes N`"))
    return 0


END_WAIT_S = 10.0
"""How long a launcher gives the attempt's end record before it may send the job on, beyond
a script's grace period (`_await_end`)."""
END_POLL_S = 0.5


def _await_end(run: Path, attempt: int, within: float) -> None:
    """The attempt is closed by its cycle's leader: rank 0 of an hpcshard job, or for a
    script the leader's launcher (node 0's unless it was lost or left out,
    `node._script_outcome`) once its own ranks exit, a save on the notice taking up to the
    script's grace. A requeue kills the job's every process: a launcher whose ranks exited
    first and that won the claim to send the job on cut that record off (seen on a busy
    machine: an attempt with a start and a requeue, no end), and with it a save still under
    way. Every launcher gives the record up to `within` seconds (the leader finds its own at
    once); none decides by it: a lost leader writes none, and NFS may show it late. The
    ledger is read again only when its size changed (a thousand launchers polling it whole
    on NFS for a script's grace would be a flood of reads)."""
    deadline, size = time.monotonic() + within, -1
    while True:
        with contextlib.suppress(OSError):
            now = (run / ledger.LEDGER).stat().st_size
            if now != size:
                size = now
                if ledger.end_of(run, attempt) is not None:
                    return
        if time.monotonic() >= deadline:
            return
        time.sleep(END_POLL_S)


def _bad_nodes(run: Path) -> list[str]:
    """`ledger.bad_slurm_nodes`, or none where the ledger cannot be read: the job is sent on
    with the ExcNodeList it has, and a node the run declared bad that it lands on again sits
    the attempt out (`exclusion.declared_before`)."""
    try:
        return ledger.bad_slurm_nodes(run)
    except (OSError, ValueError):
        return []


def not_continued(policy: str, done: int, max_requeues: int, way: hostside.Way) -> str:
    """Why a stopped job is not sent on (its policy, the cap of continuations, no way to
    reach Slurm from here), or "" when it is."""
    if policy == "none":
        return "the requeue policy is none"
    if done >= max_requeues:
        return f"the cap of {max_requeues} is reached"
    if way is hostside.Way.NONE:
        return (f"{policy} needs Slurm's client in the launcher's environment, and it has none (a "
                "container: bind the client in" + (")" if policy == "chain" else
                                                   ", or render the script with a `host` block)"))
    return ""


def _continue(run: Path, slurm: SlurmEnv, attempt: int, first_attempt: int, max_requeues: int,
              policy: str, owner: lease.Owner, after: bool = True) -> events.Requeue | None:
    """Send the job on as `policy` says. Returns the requeue it left to the batch script
    (no Slurm client here, `hostside`), else None."""
    try:
        done = _continuations(ledger.read(run), first_attempt)
    except (OSError, ValueError) as err:  # (the storage a notice ended the run's wait for)
        done = attempt - first_attempt  # (each continuation since this submission took one attempt)
        print(f"hpcshard: the ledger could not be read ({err}): {done} continuation(s) counted from the "
              "attempt's number", file=sys.stderr, flush=True)
    action = "chain" if policy == "chain" else "requeue"
    way = hostside.way(action, hostside.has_client(action), hostside.host_file())
    why = not_continued(policy, done, max_requeues, way)
    if why:
        _note(run, events.GaveUp(attempt=attempt, reason=why))
        print(f"hpcshard: not continued: {why}; continue with `hpcshard resume {run}`",
              file=sys.stderr, flush=True)
        return None
    if way is hostside.Way.HOST:  # (Slurm's state cannot be asked: the job had its nodes)
        bad = _bad_nodes(run)
        left = events.Requeue(attempt=attempt, job=slurm.ref, host=True, excluded=bad or events.UNSET)
        _note(run, left)
        print(f"hpcshard: requeue of job {slurm.ref} left to the batch script (no Slurm client here)",
              file=sys.stderr, flush=True)
        return left
    if policy == "chain":
        try:
            new = chain(run, slurm.job_id, attempt + 1, owner, after=after)
        except (OSError, ValueError) as err:
            _note(run, events.GaveUp(attempt=attempt, reason=f"chain failed: {err}"))
            return None
        _note(run, events.Chain(attempt=attempt, job=slurm.job_id, next=new,
                                at_once=events.UNSET if after else True))
        _drop_guards(run, slurm.job_id)
        print(f"hpcshard: continuation job {new} submitted "
              + (f"(afterany:{slurm.job_id})" if after else "(at once: this job is cancelled)"),
              file=sys.stderr, flush=True)
        return None
    by = cluster.requeued_by_other(slurm.ref, slurm.restart_count)
    if by:  # e.g. Lightning's own SIGUSR1 handler runs `scontrol requeue`: never twice
        _note(run, events.Requeue(attempt=attempt, job=slurm.ref, by="the job itself", state=by))
        print(f"hpcshard: job {slurm.ref} was already requeued ({by}); not requeued again",
              file=sys.stderr, flush=True)
        return None
    bad = _bad_nodes(run)
    fewer = _fewer_nodes(run, slurm, attempt, bad) if bad else None
    if fewer == 0:
        return None
    try:
        note = cluster.requeue(slurm.ref, exclude=bad, nodes=fewer)  # retried through a controller's blip
    except cluster.SlurmError as err:
        why = f"requeue failed: {err}; continue with `hpcshard resume {run}`"
        _note(run, events.GaveUp(attempt=attempt, reason=why))
        print(f"hpcshard: not continued: {why}", file=sys.stderr, flush=True)
        return None
    _note(run, events.Requeue(attempt=attempt, job=slurm.ref, error=note or None,
                              excluded=bad or events.UNSET, nodes=fewer or events.UNSET))
    print(f"hpcshard: requeued job {slurm.ref}" + (f" ({note})" if note else ""),
          file=sys.stderr, flush=True)
    return None
