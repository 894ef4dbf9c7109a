"""A run inside an allocation the user already holds (`salloc -N 2 --gres=gpu:4`, then
`hpcshard run JOB` in its shell): no new job. The command starts one step with `srun`,
one task per node as the sbatch template's launch line does, and each task runs the same
launcher as a batch job's (`launch.node.run_node`: torchrun or the warm agent, the
supervisor, restarts inside the allocation, checkpoints). The way people debug at scale.

What differs from a batch job is what comes after a stop: there is no batch job to
requeue, so the policy is "stop and tell". A notice (Ctrl-C in the shell, salloc's own
`--signal`, the time limit coming, `hpcshard preempt`) stops the ranks at the next step
boundary with a checkpoint, and the command says how to go on (`hpcshard resume RUN`
inside a new allocation).

A run that is over ends its step even when a node of it froze (`StepEnd`): srun would wait
for the frozen node's task until Slurm marks the node DOWN (SlurmdTimeout, minutes), and
the command with it. The command, outside the step, cancels that step once the ledger
closes the attempt and the launchers kept have ended; never the allocation, and it sets
no node DOWN (a DOWN node ends an allocation made without --no-kill, the user's shell
with it).

The command's side (`run_held`) runs on the host of salloc's shell (a login node, or the
first node where the site runs the shell in a step); each node's side (`main`) in the
step's task. Stdlib only, as every launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcshard.errors import UserError
from hpcshard.launch import release
from hpcshard.launch.node import NodeEnv, run_node
from hpcshard.launch.slurm import coord_port, export, limit_ends, rdzv_port
from hpcshard.rundir import events, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.launchers import pid_file
from hpcshard.rundir.proc import clock
from hpcshard.rundir.rankenv import NOTICE, REQUEUE_EXIT, STORAGE_EXIT, RankEnv, signal_name
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm.env import Held, SlurmEnv
from hpcshard.slurm.steps import gpus_per_node, step_name

OUTSIDE = ("this runs inside an allocation you hold, and there is none here (no SLURM_JOB_ID): "
           "salloc -N 2 --gres=gpu:4, then hpcshard run JOB (or hpcshard resume RUN) in its shell; "
           "without one, hpcshard submit")


def held(environ: dict[str, str] | None = None) -> Held:
    """The allocation this shell holds, or the one-line refusal (exit 2, nothing made)."""
    found = Held.from_environ(environ)
    if found is None:
        raise UserError(OUTSIDE)
    if not found.nodes:
        raise UserError(f"allocation {found.job_id}: SLURM_JOB_NODELIST is empty or missing, so its "
                        "nodes are unknown; run hpcshard run in the shell salloc gives")
    if found.gpus_per_node is None:  # (salloc --gres=gpu:N exports nothing of them: Slurm knows)
        found = replace(found, gpus_per_node=gpus_per_node(found.job_id, timeout=30))
    return found


def shape(alloc: Held, nodes: int | None, spares: int, gpus: int | None) -> tuple[int, int | None]:
    """The run's nodes and GPUs per node in `alloc`: by default every node the allocation
    has (less the spares) and its GPUs per node where salloc said them; a shape larger than
    the allocation is refused in one line. `gpus` None: the caller's default (the profile's)."""
    have = len(alloc.nodes)
    wanted = have - spares if nodes is None else nodes
    where = f"allocation {alloc.job_id} has {have} node(s)"
    if wanted < 1:
        raise UserError(f"--spares {spares} leaves no node to train on: {where}")
    if wanted + spares > have:
        spare = f" + {spares} spare(s)" if spares else ""
        raise UserError(f"--nodes {wanted}{spare} is more than the allocation holds ({where}: "
                        f"{','.join(alloc.nodes)}); ask salloc for more, or run on fewer")
    if gpus is not None and alloc.gpus_per_node is not None and gpus > alloc.gpus_per_node:
        raise UserError(f"--gpus {gpus} is more than allocation {alloc.job_id} has on each node "
                        f"({alloc.gpus_per_node}); ask salloc for more (--gpus-per-node), or run on fewer")
    return wanted, gpus if gpus is not None else alloc.gpus_per_node


def notice_due(now: float, deadline: float | None, lead: int | None) -> bool:
    """Is it time for the time limit's notice (`lead` seconds before the allocation's
    `deadline`, both on this host's boot clock: `launch.slurm.limit_ends`)? The command
    sends it itself: an salloc without `--signal` would otherwise end in SIGTERM and SIGKILL
    (KillWait later) with nothing saved since the last periodic checkpoint. With salloc's
    own `--signal` the ranks get two notices; the second changes nothing."""
    return deadline is not None and lead is not None and now >= deadline - lead


def outcome(code: int, end: dict[str, object] | None) -> int:
    """The command's exit code: the attempt's end record where rank 0 wrote one, srun's
    code else. srun reports its tasks' highest exit code, so a node that failed (1) beside
    one that stopped on the notice (REQUEUE_EXIT, 75) would read as a stop: the ledger
    says what happened."""
    reason = (end or {}).get("reason")
    if reason == EndReason.STOP:
        return REQUEUE_EXIT
    if reason == EndReason.DONE:
        return 0
    if reason == EndReason.STORAGE:
        return STORAGE_EXIT
    return 128 - code if code < 0 else code  # (killed by a signal: the shell's spelling)


def srun_argv(alloc: Held, nodes: int, run_dir: Path, step: str) -> list[str]:
    """One task per node on `nodes` of the allocation's nodes, as the sbatch template's
    launch line; the step named after the run (`slurm.steps`), so that `status`, `preempt`
    and `cancel` reach it and nothing else the user runs in the allocation. `--overlap`
    where the shell itself is a step (use_interactive_step) that holds the nodes' CPUs."""
    return ["srun", "--unbuffered", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            f"--job-name={step}", "--input=none", *(["--overlap"] if alloc.step_id else []),
            sys.executable, "-u", "-m", "hpcshard.launch.allocation", str(run_dir)]


class Launchers:
    """Are the step's launchers up, each with its notice handler? Each writes its pid file
    (`rundir.launchers`) just after it installed the handler; one that differs from the
    file there before the step (an earlier launcher's, killed with -9) is this step's. Or
    the attempt's ranks started (its start record): the launchers that lived on are up."""

    def __init__(self, run_dir: Path, nodes: int, attempt: int) -> None:
        self.run_dir, self.attempt = run_dir, attempt
        self.paths = [pid_file(run_dir, k) for k in range(nodes)]
        self.before = [_text(p) for p in self.paths]
        self.up = False

    def ready(self) -> bool:
        if not self.up:
            self.up = all((now := _text(p)) is not None and now != was
                          for p, was in zip(self.paths, self.before, strict=True))
        if not self.up:
            self.up = any(r.get("event") == "start" and r.get("attempt") == self.attempt
                          for r in ledger.read(self.run_dir))
        return self.up


def waiting_on(records: list[dict[str, Any]], attempt: int, running: Collection[int]) -> list[int]:
    """The launchers (node numbers in the step) the step's end still waits for: those
    `running` (their pid file still reads) but the nodes this attempt lost, whose files
    stay where they froze."""
    lost = {int(r["node"]) for r in ledger.bad_node_records(records, attempt, lost=True) if "node" in r}
    return sorted(k for k in running if k not in lost)


SETTLE_S = 3.0
"""How long the kept launchers' pid files are seen gone before the step is cancelled: each
removes its file as it leaves `run_node`, then shuts its interpreter down; a task still
running when the step is cancelled is killed, and srun then reports 137 for the run."""


def end_due(closed_for: float | None, gone_for: float | None, wait_s: float, settle_s: float) -> bool:
    """End the step now? Once the attempt has been closed (`release.plan`) for `closed_for`
    seconds of this host's clock (None: not closed), and the kept launchers' pid files have
    been gone for `gone_for` seconds (None: one still reads, `waiting_on`) past `settle_s`;
    or they had `wait_s` to end: a launcher killed with -9 leaves its file behind, and one
    whose removal this host's NFS cache hides is seen gone a little later (an open
    revalidates it). No other host's clock or file decides when."""
    if closed_for is None:
        return False
    return (gone_for is not None and gone_for >= settle_s) or closed_for >= wait_s


class StepEnd:
    """Ends the run's step once the run is over while a lost node holds it (polled by
    `run_held` about once a second). Only what this host sees decides: the ledger (an open
    revalidates it on NFS), the kept launchers' pid files, and its own monotonic clock. A pid
    file counts as gone only once this host has seen it: the launchers write theirs on other
    hosts, and NFS may hide a new name from this one for up to a minute (its lookup cache),
    so a file never seen here says nothing of its launcher (it then has OTHERS_WAIT_S)."""

    def __init__(self, run_dir: Path, alloc: Held, step: str, attempt: int, launchers: int) -> None:
        self.run_dir, self.alloc, self.step, self.attempt = run_dir, alloc, step, attempt
        self.paths = [pid_file(run_dir, k) for k in range(launchers)]
        self.seen: set[int] = set()
        """The launchers whose pid file this host has read (looked for each poll until seen)."""
        self.closed: float | None = None
        """When (monotonic) this command first saw the attempt closed with lost nodes..."""
        self.gone: float | None = None
        """...and the kept launchers' pid files all gone."""
        self.done = False
        """It acted, or found nothing to act on: it looks no more."""

    def poll(self) -> None:
        if self.done:
            return
        present = {k for k, path in enumerate(self.paths) if _text(path) is not None}
        self.seen |= present
        records = ledger.read(self.run_dir)
        # (me "": the command is outside the step; where its shell runs on a node of the
        # allocation that froze, it froze too, and acts on nothing until thawed)
        decided = release.plan(records, self.attempt, self.alloc.nodes, "", held=True)
        if decided is None:  # (not over, or over no more: its times start again at a close)
            self.closed = self.gone = None
            return
        now = time.monotonic()
        self.closed = self.closed if self.closed is not None else now
        running = [k for k in range(len(self.paths)) if k not in self.seen or k in present]
        if waiting_on(records, self.attempt, running):
            self.gone = None
        elif self.gone is None:
            self.gone = now
        if end_due(now - self.closed, None if self.gone is None else now - self.gone, release.OTHERS_WAIT_S,
                   SETTLE_S):
            self.done = self._end(decided)

    def _end(self, decided: release.Release) -> bool:
        """Cancel the run's step (found by its name, as status, preempt and cancel find it)
        while the allocation still holds the lost nodes; False: ask again at the next poll
        (Slurm did not answer)."""
        from hpcshard.slurm import cluster
        from hpcshard.slurm.steps import run_steps

        steps = run_steps(self.alloc.job_id, self.step, timeout=30)
        if steps is None:
            return False
        # Not once the allocation has ended or let a lost node go (Slurm ended its task:
        # srun ends by itself), nor when the step is gone already.
        info = cluster.show_job(self.alloc.job_id, timeout=30) if steps else None
        return not steps or not release.holds(info, list(decided.lost)) or self._cancel(decided, steps)

    def _cancel(self, decided: release.Release, steps: list[str]) -> bool:
        from hpcshard.slurm import cluster

        lost, ended = ",".join(decided.lost), f"the run ended ({decided.outcome}) with lost node(s)"
        for step in steps:
            try:
                cluster.scancel(step)
            except cluster.SlurmError as err:
                _say(f"hpcshard: {ended} {lost}, but step {step} was not cancelled ({err}): srun waits for "
                     f"their tasks until Slurm marks them DOWN; `scancel {step}` ends it")
                continue
            with contextlib.suppress(OSError):
                ledger.append(self.run_dir, events.Cancel(attempt=self.attempt, job=step, reason=(
                    f"the run's attempt ended ({decided.outcome}) with lost node(s) {lost}: its step "
                    "cancelled by hpcshard run once its launchers had exited, not when Slurm marks them "
                    "DOWN")))
            _say(f"hpcshard: {ended} {lost}: cancelled step {step} (srun waited for their tasks); "
                 f"allocation {self.alloc.job_id} is still yours")
        return True


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _say(line: str) -> None:
    """A line to the user's terminal, which may be gone (ssh dropped: EIO)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def run_held(spec: RunSpec, run_dir: Path, resume: str, owner: str, *, lead: int | None,
             notice: str = NOTICE, environ: dict[str, str] | None = None) -> int:
    """Run the run as one step of the allocation this shell holds, until it ends; its exit
    code (`outcome`). Ctrl-C (or a TERM or HUP to this command) is the notice: the ranks
    stop at the next step boundary with a checkpoint; a second Ctrl-C stops them now.
    `lead`: seconds before the allocation's end that this command sends the notice itself."""
    alloc = held(environ)
    shape(alloc, spec.nodes, spec.spares, spec.gpus)
    if not spec.jobs or spec.jobs[-1] != alloc.job_id:
        spec = RunSpec.add_job(run_dir, alloc.job_id)
    attempt = ledger.next_attempt(run_dir)
    # On this host's clock: the step's launchers, on other hosts, ask Slurm for their own (`main`).
    deadline = limit_ends(alloc.job_id)
    ranks = RankEnv(attempt=attempt, resume=resume, notice=notice, lead=lead, owner=owner)
    name, tasks = step_name(spec.name, spec.created), spec.nodes + spec.spares
    argv = srun_argv(alloc, tasks, run_dir, name)
    up = Launchers(run_dir, tasks, attempt)
    ender = StepEnd(run_dir, alloc, name, attempt, tasks)
    # Its own session: the terminal's Ctrl-C comes to this command alone, which makes it
    # the notice (srun's own first Ctrl-C only prints its tasks' states, two within a
    # second kill them). srun forwards the signals it is sent to every task of the step.
    proc = subprocess.Popen(argv, env={**os.environ, **ranks.to_environ()}, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    asked: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only noted: the loop below says it and sends it (a print here, to a terminal
        # that hung up, would raise EIO before anything was sent).
        asked.append(signum)
        if len(asked) > 1:
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        due, sent, told = "", False, False
        while proc.poll() is None:
            if not due and asked:
                due = (f"stopping at the next step boundary with a checkpoint (sent {notice} to every "
                       "node); Ctrl-C again stops now, without one")
            elif not due and notice_due(clock(), deadline, lead):
                due = "allocation"
            # Not before every launcher has its handler: until then srun forwards a notice
            # to no task, or it kills a launcher that is still importing.
            if due and not sent and len(asked) < 2 and not up.ready() and not told:
                told = True
                _say("hpcshard: the step's launchers are still starting: the notice goes to them once they "
                     "are up (Ctrl-C again stops now, without a checkpoint)")
            if due and not sent and len(asked) < 2 and up.ready():
                sent = True
                if due == "allocation":
                    due = (f"allocation {alloc.job_id} ends in {(deadline or 0) - clock():.0f} s: sent "
                           f"the ranks {notice} (they save before it ends)")
                _say(f"hpcshard: {due}")
                proc.send_signal(signal.Signals[signal_name(notice)])
            with contextlib.suppress(OSError, ValueError):  # (a ledger line half-written: next poll)
                ender.poll()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return outcome(proc.returncode, ledger.end_of(run_dir, attempt))


def node_env(slurm: SlurmEnv, per_node: int) -> NodeEnv:
    """This node's place in the step (which may hold fewer nodes than the allocation): the
    rendezvous on the step's first node, its ports derived from the job and the step, so
    that two runs in one allocation, one after the other, do not meet each other's."""
    nodes = slurm.step_nodes or slurm.nodes
    step = int(slurm.step_id) if slurm.step_id.isdigit() else 0
    return NodeEnv(node_rank=slurm.step_rank, nnodes=len(nodes), per_node=per_node, rdzv_host=nodes[0],
                   rdzv_port=rdzv_port(slurm.job_id, step), run_id=f"{slurm.job_id}.{slurm.step_id}",
                   coord_port=coord_port(slurm.job_id, step))


def main(argv: list[str]) -> int:
    """`python -m hpcshard.launch.allocation RUN_DIR`: one node's launcher, in the step's
    task on that node. The command that started the step owns the run and passed the
    ranks' variables (HPCSHARD_*) through srun's environment, but for the deadline: a
    moment on one host's clock means nothing on another's, so each node asks Slurm for the
    time left itself, as a batch job's launchers do."""
    run = Path(argv[0])
    spec = RunSpec.read(run)
    slurm = SlurmEnv.from_environ()
    ranks = replace(RankEnv.from_environ(), deadline=limit_ends(slurm.job_id))
    export(ranks)
    return run_node(node_env(slurm, spec.gpus), run, stop_signal=ranks.notice_signal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
