"""Where a run's processes live, behind one interface: the local backend (emulated nodes as
processes of this host, `launch.local`) and Slurm (a batch job whose launchers run on
compute nodes, `launch.slurm`). What the login node's commands do to a run that already
exists (is it over, what does the scheduler say of it, send it a notice, cancel it) goes
through `reaching(spec)`, what the launchers need to know through `of(spec)`; nothing else
compares a run's backend name. Starting a run is here too: `run` (local: the launcher
runs here until the run ends) and `submit` (Slurm: the job is queued), called from the one
place a request is scheduled (`cli.request.schedule`).

Login-node code: the stdlib and `hpcshard.slurm` (imported when a Slurm run asks), never
torch or click. A user error is a ValueError with the one line to show.
"""

from __future__ import annotations

import contextlib
import signal
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hpcshard.rundir import lease, proc
from hpcshard.rundir.launchers import guards, launchers, signal_launchers
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.rankenv import NOTICE, short_name
from hpcshard.rundir.spec import RunSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from hpcshard.slurm.cluster import JobInfo
    from hpcshard.slurm.sbatch import SbatchRequest

LOCAL, SLURM, ALLOCATION = "local", "slurm", "allocation"
"""The backends' names, as RunSpec.backend and `--backend` spell them (allocation: `hpcshard
run` inside an allocation the user holds)."""


class Backend:
    """The local backend: the run's launchers are processes of this host (pid files in the
    run directory), owned by the command that started them."""

    name: ClassVar[str] = LOCAL
    in_queue: ClassVar[bool] = False
    """A scheduler queues the run's jobs: requeues, guards and continuation jobs are its."""
    here: ClassVar[bool] = True
    """The run's ranks run on this host (a preflight may check what only they can use)."""
    asks_slurm: ClassVar[bool] = False
    """Whether the run is over is Slurm's word: one call per question (`logs -f` paces them)."""

    def run(self, spec: RunSpec, run_dir: Path, resume: str, owner: str,
            on_attempt: Callable[[int, int], None] | None = None) -> int:
        """Run it here, on emulated nodes, until it ends (requeued here after a clean stop,
        `on_attempt` told of each); its exit code. `owner`: the lease token of the command
        that owns the run."""
        from hpcshard.launch.local import run_local

        return run_local(run_dir.resolve(), spec.nodes, spec.gpus, spares=spec.spares, resume=resume,
                         max_requeues=spec.max_requeues, on_attempt=on_attempt, owner=owner)

    def ready(self, spec: RunSpec) -> None:
        """Can the run start from here, on its shape? A ValueError with the one line to
        show where not (checked before the preflight: nothing is made or started)."""

    def submit(self, spec: RunSpec, run_dir: Path, sbatch: SbatchRequest, resume: str) -> str:
        """Queue the run as a job; its id. Only a backend that queues runs does."""
        raise NotImplementedError(f"the {self.name} backend queues nothing; it runs the run (`run`)")

    def submit_array(self, specs: list[RunSpec], run_dirs: list[Path], array: SbatchRequest,
                     root: Path, after: str = "") -> list[str]:
        """Queue several runs as one job array (held by the dependency `after`, if any);
        their job ids. Only a backend that queues runs does."""
        raise NotImplementedError(f"the {self.name} backend queues nothing; it runs each run (`run`)")

    def logs(self, run_dir: Path, job: str | None = None) -> str:
        """Where the run's logs are, in one line."""
        return f"{RunPaths(run_dir).logs}/rank-N.log"

    def cancel_job(self, job: str) -> None:
        """Cancel one scheduler job of the run. Only a backend that queues runs has them."""
        raise NotImplementedError(f"the {self.name} backend has no jobs to cancel")

    def job(self, spec: RunSpec) -> str | None:
        """The run's newest scheduler job (None: none, or no scheduler)."""
        return None

    def state(self, spec: RunSpec) -> JobInfo | None:
        """What the scheduler says of the newest job (None: no scheduler)."""
        return None

    def history(self, spec: RunSpec) -> list[dict[str, Any]] | None:
        """Accounting's runs of every job of the run (None: no scheduler or no accounting)."""
        return None

    def over(self, spec: RunSpec, run_dir: Path) -> bool | None:
        """Nothing of the run is running (None: the scheduler did not answer)."""
        return not launchers(run_dir)

    def ended(self, spec: RunSpec, run_dir: Path) -> bool | None:
        """Over, and nothing will start another attempt by itself (None: the scheduler did
        not answer): what `logs -f` waits for. Here, between two attempts (a requeue) no
        launcher runs while the command that owns the run starts the next one."""
        return self.over(spec, run_dir) and not _owner_runs(run_dir)

    def notice(self, spec: RunSpec) -> str:
        """The signal the run's ranks take for a stop notice (USR2, ...)."""
        return NOTICE

    def go_on(self, run_dir: Path) -> str:
        """How the user continues a run that stopped with a checkpoint, as a command."""
        return f"hpcshard resume {run_dir}"

    def notify(self, spec: RunSpec, run_dir: Path, name: str) -> str:
        """Send the run the notice signal `name` (SIGUSR2, ...), as Slurm would."""
        sent = signal_launchers(run_dir, getattr(signal, name))
        if not sent:
            raise ValueError(f"no running launcher in {run_dir} (nothing to preempt); "
                             "is the run still going?")
        return f"sent {name} to {sent} node launcher(s) of {run_dir}"

    def cancel(self, spec: RunSpec, run_dir: Path) -> str:
        """Stop the run now, without a checkpoint."""
        sent = signal_launchers(run_dir, signal.SIGTERM)
        if not sent and _signal_owner(run_dir, signal.SIGTERM):
            # Between two attempts (a requeue on the local backend) no launcher runs: the
            # command that owns the run starts no other one once it has this.
            return f"cancelled {run_dir} between two attempts (its command will start no other)"
        if not sent:
            raise ValueError(f"no running launcher in {run_dir}; nothing to cancel")
        return f"cancelled {sent} node launcher(s) of {run_dir}"


class Slurm(Backend):
    """Slurm: the run's launchers are a batch job's steps on compute nodes (their pids mean
    nothing here); Slurm delivers signals and keeps the job's state."""

    name: ClassVar[str] = SLURM
    in_queue: ClassVar[bool] = True
    here: ClassVar[bool] = False
    asks_slurm: ClassVar[bool] = True

    def run(self, spec: RunSpec, run_dir: Path, resume: str, owner: str,
            on_attempt: Callable[[int, int], None] | None = None) -> int:
        raise NotImplementedError("a Slurm run runs in its job (`submit`), not here")

    def submit(self, spec: RunSpec, run_dir: Path, sbatch: SbatchRequest, resume: str) -> str:
        """sbatch the run's job through submitit (every node's launcher: `launch.slurm`);
        sbatch's own message when it refuses (ValueError)."""
        from hpcshard.launch.slurm import node_main
        from hpcshard.rundir.ledger import next_attempt
        from hpcshard.slurm.submit import submit

        policy = "requeue" if sbatch.requeue else spec.requeue_policy
        return submit(sbatch, run_dir.resolve(), node_main,
                      *_node_args(spec, run_dir, next_attempt(run_dir), resume, policy))

    def submit_array(self, specs: list[RunSpec], run_dirs: list[Path], array: SbatchRequest,
                     root: Path, after: str = "") -> list[str]:
        """A sweep's runs as one job array (`array.array`) written in `root`: task i runs
        specs[i] in run_dirs[i], from its newest checkpoint, requeued by itself; the tasks'
        job ids (ARRAY_i). `after`: the array waits for these jobs (sbatch --dependency)."""
        from hpcshard.launch.slurm import node_main
        from hpcshard.slurm.submit import submit_array

        tasks = [_node_args(spec, d, 0, "auto", "requeue") for spec, d in zip(specs, run_dirs, strict=True)]
        return submit_array(array, root.resolve(), node_main, tasks, after)

    def logs(self, run_dir: Path, job: str | None = None) -> str:
        paths = RunPaths(run_dir)
        return f"{paths.logs}/rank-N.log, {paths.submitit}/{job or '%j'}_N_log.out"

    def cancel_job(self, job: str) -> None:
        """Cancel one job of the run (a job submitted for a run another command took
        meanwhile); scancel's message when it fails (ValueError)."""
        from hpcshard.slurm import cluster

        cluster.scancel(job)

    def job(self, spec: RunSpec) -> str | None:
        return spec.jobs[-1] if spec.jobs else None

    def state(self, spec: RunSpec) -> JobInfo | None:
        from hpcshard.slurm import cluster

        job = spec.jobs[-1]
        return cluster.job_state(job, since=spec.created) or cluster.JobInfo.forgotten(job)

    def history(self, spec: RunSpec) -> list[dict[str, Any]] | None:
        from hpcshard.slurm import cluster

        runs = cluster.history(list(spec.jobs), since=spec.created)
        return None if runs is None else [asdict(r) for r in runs]

    def over(self, spec: RunSpec, run_dir: Path) -> bool | None:
        """Slurm says the newest job ended, or has forgotten it; None when it does not
        answer, never taken for over (`resume` would start a second job on a live run).
        Not accounting's word either: it may lag the controller."""
        from hpcshard.slurm import cluster

        return cluster.query_job(spec.jobs[-1]).over

    def notice(self, spec: RunSpec) -> str:
        """Its job's `--signal` (the profile's `signal`)."""
        from hpcshard.slurm.sbatch import SbatchRequest

        recorded = SbatchRequest.recorded(spec.slurm)
        return recorded.signal if recorded is not None else NOTICE

    def notify(self, spec: RunSpec, run_dir: Path, name: str) -> str:
        from hpcshard.slurm import cluster

        # Slurm delivers the signal to every process of the job's steps, as its own notice does.
        cluster.scancel("--signal", short_name(name), spec.jobs[-1])
        return f"sent {name} to Slurm job {spec.jobs[-1]} ({run_dir})"

    def cancel(self, spec: RunSpec, run_dir: Path) -> str:
        from hpcshard.slurm import cluster

        for job in guards(run_dir):  # first: a cancelled job is what a guard waits for
            with contextlib.suppress(ValueError):  # one that ran or Slurm dropped
                cluster.scancel(job)
        cluster.scancel(spec.jobs[-1])
        return f"cancelled Slurm job {spec.jobs[-1]} ({run_dir})"


class Allocation(Slurm):
    """An allocation the user holds (`hpcshard run` in salloc's shell): the run is one step
    of it (`launch.allocation`), run by the command until it ends, not a job of its own.
    Slurm answers for the step (`slurm.steps`: found by the run's step name), and what is
    sent to the run goes to that step alone, never to the allocation or the user's other
    steps. No requeue: a stop ends the command, which says how to go on."""

    name: ClassVar[str] = ALLOCATION
    in_queue: ClassVar[bool] = False

    def run(self, spec: RunSpec, run_dir: Path, resume: str, owner: str,
            on_attempt: Callable[[int, int], None] | None = None) -> int:
        """Start the step in the allocation this shell holds and wait for it; the notice
        comes the profile's `signal_lead` before the allocation ends (`run_held`)."""
        from hpcshard import site
        from hpcshard.launch.allocation import run_held

        values = site.resolve(site.load(), spec.profile or None, {}).values
        return run_held(spec, run_dir, resume, owner, lead=values["signal_lead"])

    def ready(self, spec: RunSpec) -> None:
        """This shell holds an allocation, and the run's shape fits in it."""
        from hpcshard.launch.allocation import held, shape

        shape(held(), spec.nodes, spec.spares, spec.gpus)

    def submit(self, spec: RunSpec, run_dir: Path, sbatch: SbatchRequest, resume: str) -> str:
        raise NotImplementedError("a run inside an allocation runs as its step (`run`), not as a job")

    def logs(self, run_dir: Path, job: str | None = None) -> str:
        return f"{RunPaths(run_dir).logs}/rank-N.log"

    def go_on(self, run_dir: Path) -> str:
        """`resume` inside an allocation (this one while it lasts), with the nodes the run
        found bad left out of a new one."""
        from hpcshard.rundir.ledger import bad_slurm_nodes

        spec, bad = RunSpec.read(run_dir), bad_slurm_nodes(run_dir)
        exclude = f" --exclude={','.join(bad)}" if bad else ""
        return (f"hpcshard resume {run_dir} inside an allocation (this one while it lasts, or a new one: "
                f"salloc -N {spec.nodes + spec.spares}{exclude} ...)")

    def state(self, spec: RunSpec) -> JobInfo | None:
        return super().state(spec) if spec.jobs else None

    def _steps(self, spec: RunSpec) -> list[str] | None:
        from hpcshard.slurm.steps import run_steps, step_name

        return run_steps(spec.jobs[-1], step_name(spec.name, spec.created)) if spec.jobs else []

    def over(self, spec: RunSpec, run_dir: Path) -> bool | None:
        """No step of the run runs in its newest allocation (None: Slurm did not answer)."""
        steps = self._steps(spec)
        return None if steps is None else not steps

    def ended(self, spec: RunSpec, run_dir: Path) -> bool | None:
        return self.over(spec, run_dir)  # (nothing requeues it)

    def notice(self, spec: RunSpec) -> str:
        return NOTICE

    def _signal_steps(self, spec: RunSpec, run_dir: Path, name: str, what: str) -> list[str]:
        from hpcshard.slurm import cluster

        steps = self._steps(spec)
        if steps is None:
            raise ValueError(f"Slurm did not answer whether {run_dir} still runs in allocation "
                             f"{spec.jobs[-1]}; try again when `scontrol ping` answers")
        if not steps:
            raise ValueError(f"no step of {run_dir} runs in allocation {spec.jobs[-1] if spec.jobs else '?'} "
                             f"(nothing to {what}); is the run still going?")
        for step in steps:
            cluster.scancel(*(("--signal", short_name(name)) if name else ()), step)
        return steps

    def notify(self, spec: RunSpec, run_dir: Path, name: str) -> str:
        steps = self._signal_steps(spec, run_dir, name, "preempt")
        return f"sent {name} to step {', '.join(steps)} of allocation {spec.jobs[-1]} ({run_dir})"

    def cancel(self, spec: RunSpec, run_dir: Path) -> str:
        steps = self._signal_steps(spec, run_dir, "", "cancel")
        return f"cancelled step {', '.join(steps)} ({run_dir}); allocation {spec.jobs[-1]} is still yours"


def _node_args(spec: RunSpec, run_dir: Path, attempt: int, resume: str, policy: str) -> tuple[Any, ...]:
    """`launch.slurm.node_main`'s arguments for one run's job (a submit's, an array task's)."""
    return (str(run_dir.resolve()), spec.gpus, attempt, spec.max_requeues, resume, policy)


BACKENDS: dict[str, Backend] = {b.name: b for b in (Backend(), Slurm(), Allocation())}


def of(spec: RunSpec) -> Backend:
    """The run's backend, as it was submitted with (a name neither knows, in a spec.json
    written by something else: the local backend, which asks no scheduler)."""
    return BACKENDS.get(spec.backend, BACKENDS[LOCAL])


def reaching(spec: RunSpec) -> Backend:
    """The backend that reaches the run's processes from this host. A Slurm run none of
    whose jobs was submitted yet (a sweep's task before its array, an sbatch that refused)
    has no job to ask: only processes of this host could be its, as on the local backend."""
    backend = of(spec)
    return backend if not backend.in_queue or backend.job(spec) is not None else BACKENDS[LOCAL]


def _owner_runs(run_dir: Path) -> bool:
    """Is the process that owns the run (`rundir.lease`) running on this host? A lease that
    does not parse is no one's word: not taken for a live owner."""
    try:
        owner = lease.read(run_dir)
    except (lease.Busy, OSError):
        return False
    return owner is not None and owner.process is not None and owner.process.alive() is True


def _signal_owner(run_dir: Path, sig: int) -> bool:
    """Signal the local process that owns the run (`rundir.lease`), if it runs on this host."""
    try:
        owner = lease.read(run_dir)
    except (lease.Busy, OSError):
        return False
    return owner is not None and owner.process is not None and proc.signal(asdict(owner.process), sig)
