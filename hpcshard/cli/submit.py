"""`hpcshard submit`, `render` and `resume`: build the request (settings, run directory,
RunSpec, sbatch text), check it, then hand it over (submitit on Slurm, the local
launcher otherwise). The job itself is checked in a subprocess (`runtime.preflight`):
this process never imports torch."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import click

from hpcshard import script, site
from hpcshard.cli.common import fail, follow_log, user_errors
from hpcshard.cli.options import (
    RESUME,
    SETS,
    script_options,
    setting_option,
    settings,
    shape_options,
    slurm_options,
    spare_options,
)
from hpcshard.config import parse_sets
from hpcshard.launch import backends
from hpcshard.rundir import lease, ledger, store
from hpcshard.rundir.ledger import bad_slurm_nodes, next_attempt
from hpcshard.rundir.metrics import METRICS, last_record
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.rankenv import REQUEUE_EXIT, STORAGE_EXIT
from hpcshard.rundir.spec import (
    RunSpec,
    check_resume,
    check_run_dir,
    create_run_dir,
    default_run_dir,
    job_ref,
    job_stem,
    probe_writable,
    read_spec,
)
from hpcshard.slurm.sbatch import SbatchRequest, render


def pick_backend(backend: str) -> str:
    """`auto`: Slurm when its commands are here and a controller answers, else local."""
    if backend != "auto":
        return backend
    from hpcshard.slurm import cluster

    return backends.SLURM if cluster.available() else backends.LOCAL


@click.command()
@click.argument("job", required=False)
@script_options
@shape_options()
@spare_options
@setting_option("backend")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="Where the run writes config, logs, metrics, checkpoints [default: runs/JOB-TIME].")
@click.option("--name", help="Run name [default: the job's name].")
@setting_option("max_requeues")
@setting_option("max_restarts")
@click.option("--follow", is_flag=True, help="Slurm: show rank 0's log until the job ends.")
@slurm_options
@RESUME
@SETS
def submit(job: str | None, nodes: int | None, run_dir: Path | None, name: str | None,
           follow: bool, resume: str, sets: tuple[str, ...], profile: str | None,
           module: str | None, args: tuple[str, ...], **opts: Any) -> None:
    """Run JOB (an hpcshard job file or module) on NODES x GPUS ranks, or any torchrun
    script as it is: `submit train.py -- ARGS`, `submit -m package.module -- ARGS`."""
    spec, run_dir, req = _prepare(job, nodes or 1, run_dir, name, resume, sets, profile, opts,
                                  module=module, args=args)
    create_run_dir(run_dir, spec.run_group)
    # Two commands given one new --run-dir at once both found it empty: one gets the run.
    claim = take_run(run_dir, "hpcshard submit")
    if req is not None:  # (built for a backend that queues the run)
        _submit_slurm(spec, run_dir, req, resume, follow, claim, fresh=True)
    _launch(spec, run_dir, resume, claim)


def take_run(run_dir: Path, what: str) -> lease.Owner:
    """This command takes the run (`rundir.lease`) until it hands it to the job it
    submits, or, on the local backend, until the run ends here; one line and exit 2 while
    another job or command owns it, or Slurm cannot say whether its job still runs."""
    from hpcshard.slurm import cluster

    try:
        claim = lease.take(run_dir, lease.Owner.of_process(what), cluster.job_alive)
    except lease.Busy as err:
        fail(err)
    except OSError as err:  # taking the lease is the command's first write into the run
        fail(ValueError(f"run directory {run_dir} is not writable ({err.strerror}); its lease "
                        "could not be taken: fix its permissions or mount"))
    lease.keep(run_dir, claim)  # renewed while this command holds it (hosts that cannot see it)
    return claim


@click.command("render")
@click.argument("job", required=False)
@script_options
@shape_options()
@spare_options
@click.option("--run-dir", type=click.Path(path_type=Path), help="As for submit.")
@click.option("--name", help="Run name [default: the job's name].")
@click.option("--check", is_flag=True, help="Also import the job and build its model on the meta "
              "device, as submit does (takes seconds: torch).")
@slurm_options
@SETS
def render_cmd(job: str | None, nodes: int | None, run_dir: Path | None, name: str | None,
               check: bool, sets: tuple[str, ...], profile: str | None, module: str | None,
               args: tuple[str, ...], **opts: Any) -> None:
    """Print the sbatch script that `submit --backend slurm` would submit (nothing runs,
    nothing is imported: it is instant)."""
    from hpcshard.slurm.submit import sbatch_text

    spec, run_dir, req = _prepare(job, nodes or 1, run_dir, name, "auto", sets, profile,
                                  {**opts, "backend": backends.SLURM}, check_cluster=False,
                                  check_job=check, module=module, args=args)
    assert req is not None
    click.echo(sbatch_text(req, run_dir.resolve()), nl=False)


def job_target(job: str | None, module: str | None, args: tuple[str, ...],
            ) -> tuple[str, str, dict[str, Any]]:
    """(what the run is named after, the job reference, the script) from the command line:
    an hpcshard job (file or module), or a script file / `-m` module run as it is."""
    if module:
        script.check_module(module)
        return module, module, {"kind": "module", "target": module,
                                "args": [*([job] if job is not None else []), *args]}
    if job is None:
        raise ValueError("nothing to run: give a job (jobs/charlm.py), a script "
                         "(train.py -- ARGS) or a module (-m package.module -- ARGS)")
    path = Path(job)
    if (job.endswith(".py") or path.exists()) and path.is_file() and not script.defines_job(path):
        return job, str(path.resolve()), {"kind": "file", "target": str(path.resolve()),
                                          "args": list(args)}
    if args:
        raise ValueError(f"{job} is an hpcshard job: it takes --set KEY=VALUE, not arguments "
                         f"({shlex.join(args)}); a plain script takes them after --")
    return job, job_ref(job), {}


def _prepare(job: str | None, nodes: int, run_dir: Path | None, name: str | None, resume: str,
             sets: tuple[str, ...], profile: str | None, opts: dict[str, Any],
             check_cluster: bool = True, check_job: bool = True, module: str | None = None,
             args: tuple[str, ...] = (),
             ) -> tuple[RunSpec, Path, SbatchRequest | None]:
    """Validate everything and build the request; nothing is created or submitted."""
    with user_errors():
        res = settings(profile, opts)
        v = res.values
        check_secrets(v["secrets"], v["env"], res.profile)
        label, ref, own = job_target(job, module, args)
        if own:
            if sets:
                raise ValueError(f"--set {sets[0]}: --set is for hpcshard jobs; pass a script's own "
                                 f"arguments after --, e.g. hpcshard submit {label} -- --lr 3e-4")
            if resume not in ("auto", "never"):
                raise ValueError(f"--resume {resume}: a script finds its own checkpoints "
                                 "(in $HPCSHARD_CHECKPOINT_DIR); use auto or never")
            own.update(cwd=str(Path.cwd()), signal=v["script_signal"], grace=v["script_grace"])
        run_dir = run_dir or default_run_dir(label, site.storage_root(res))
        check_run_dir(run_dir, v["run_group"])
        if resume not in ("auto", "never"):
            check_resume(run_dir, resume)
        # The profile's training settings under the command line's.
        train = {} if own else {**v["train"], **parse_sets(sets)}
        spec = run_spec(res, ref, train, nodes, pick_backend(v["backend"]), name or job_stem(label),
                        script=own)
        check_spares(spec)
        req = None
        if backends.of(spec).in_queue:
            req = SbatchRequest.from_settings(v, res.template_dirs, job_name=spec.name,
                                              nodes=spec.nodes, gpus=spec.gpus, run_dir=run_dir,
                                              spares=spec.spares, min_nodes=spec.min_nodes)
            # the template, before anything is made
            render(req, "true", RunPaths(run_dir).submitit, site.SETTINGS)
            if own and own["grace"] >= req.signal_lead_s:
                raise ValueError(f"--grace {own['grace']} is not below the notice's lead time "
                                 f"({req.signal_lead_s}s): the time limit would kill the script "
                                 "first; lower --grace or raise --signal-lead")
            if check_cluster:
                from hpcshard.slurm import cluster

                cluster.check_request(req)
                warn_storage(run_dir, nodes)
        if check_job and not own:
            spec.resolved = preflight(spec)
    return spec, run_dir, req


def run_spec(res: site.Resolved, ref: str, sets: dict[str, str], nodes: int, backend: str, name: str,
             **fields: Any) -> RunSpec:
    """The run the merged settings describe (a submit's, or one of a sweep's runs)."""
    v = res.values
    return RunSpec(**{**dict(job=ref, sets=sets, nodes=nodes, gpus=v["gpus_per_node"], backend=backend,
                             name=name, max_requeues=v["max_requeues"], requeue_policy=v["requeue_policy"],
                             max_restarts=v["max_restarts"], no_progress_restarts=v["no_progress_restarts"],
                             health_check=v["health_check"], spares=v["spares"], min_nodes=v["min_nodes"],
                             bad_nodes=v["bad_nodes"], run_group=v["run_group"], profile=res.profile),
                       **fields})


def check_secrets(names: list[str], env: dict[str, Any], profile: str | None) -> None:
    """Every secret the profile names is in this environment (the job takes it from there:
    Slurm hands the submitting environment to the job, the local backend its own), and none
    is also a value the script would export."""
    whose = f"profile {profile!r}" if profile else "the site configuration"
    for name in names:
        if name in env:
            raise ValueError(f"{name} is both a secret and an env value of {whose}: a secret's value "
                             "is never written into the script; drop it from env")
        if not os.environ.get(name):
            raise ValueError(f"{name} is not set in your environment, and {whose} names it as a "
                             f"secret the job needs; export {name} first (its value is never written)")


def warn_storage(run_dir: Path, nodes: int) -> None:
    node_local = ("/tmp", "/var/tmp", "/dev/shm", "/scratch/local")
    if nodes > 1 and str(run_dir.resolve()).startswith(node_local):
        click.echo(f"warning: {run_dir} looks node-local; with {nodes} nodes every node must see "
                   "the same run directory (checkpoints, logs): put it on shared storage", err=True)


def _submit_slurm(spec: RunSpec, run_dir: Path, req: SbatchRequest, resume: str,
                  follow: bool, claim: lease.Owner, fresh: bool = False) -> NoReturn:
    """Submit, then hand the run to the job; if sbatch refuses, a run directory made for
    this submission goes again."""
    from hpcshard.launch.slurm import node_main
    from hpcshard.slurm import cluster
    from hpcshard.slurm.submit import submit

    _warn_lead_time(run_dir, req)
    spec.slurm = {**asdict(req), "run_dir": str(req.run_dir)}
    _write_owned(spec, run_dir, claim)
    try:
        job_id = submit(req, run_dir.resolve(), node_main, str(run_dir.resolve()), spec.gpus,
                              next_attempt(run_dir), spec.max_requeues, resume,
                              "requeue" if req.requeue else spec.requeue_policy)
    except ValueError as err:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            lease.release(run_dir, claim)
        fail(err)
    spec = RunSpec.add_job(run_dir, job_id)
    # Last: the job's launchers wait for it (`launch.slurm.own_run`) before they train.
    if lease.hand_over(run_dir, claim, lease.Owner.of_job(job_id)) is None:
        with contextlib.suppress(ValueError):
            cluster.scancel(job_id)
        fail(ValueError(f"{run_dir} was taken over while job {job_id} was submitted (its lease: "
                        f"{lease.path(run_dir)}); job {job_id} is cancelled"))
    click.echo(f"submitted job {job_id}: {spec.nodes} node(s){_spares(spec)} x {spec.gpus} GPU(s), "
               + _what(spec))
    click.echo(f"run directory: {run_dir}")
    click.echo(f"logs: {run_dir / 'logs'}/rank-N.log, {run_dir / 'submitit'}/{job_id}_N_log.out")
    click.echo(f"follow: hpcshard submit ... --follow, or tail -f {run_dir / 'logs' / 'rank-0.log'}")
    if not follow:
        sys.exit(0)
    sys.exit(_follow(run_dir, job_id))


def _warn_lead_time(run_dir: Path, req: SbatchRequest) -> None:
    """The notice must leave time to save: compare with the last save this run measured."""
    last = store.committed(run_dir / store.CHECKPOINTS)
    seconds = last[-1].manifest.get("save_seconds", 0) if last else 0
    if seconds and req.signal_lead_s < seconds * 1.5:
        click.echo(f"warning: --signal-lead {req.signal_lead_s}s is short: the last checkpoint of "
                   f"this run took {seconds:.0f}s to save", err=True)


def _follow(run_dir: Path, job_id: str) -> int:
    """Print rank 0's log as it grows until Slurm says the job is over (requeues included)."""
    from hpcshard.slurm import cluster
    from hpcshard.slurm.states import JobState

    final = cluster.JobInfo.forgotten(job_id)

    def over() -> bool:  # a controller that does not answer is asked again, not taken for "over"
        nonlocal final
        answer = cluster.query_job(job_id)
        if answer.over is not None:
            final = answer.info or cluster.JobInfo.forgotten(job_id)
        return answer.over is True

    follow_log(RunPaths(run_dir).rank_log(0), over)
    click.echo(f"job {job_id}: {final.state_text or 'no longer known to Slurm'}")
    return 0 if final.state is JobState.COMPLETED else 1


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@shape_options()
@click.option("--spares", type=click.IntRange(min=0), help="Spare nodes [default: the run's].")
@click.option("--min-nodes", type=click.IntRange(min=0),
              help="Fewest nodes to go on with after a loss [default: the run's].")
@RESUME
@SETS
def resume(run_dir: Path, nodes: int | None, gpus: int | None, spares: int | None,
           min_nodes: int | None, resume: str, sets: tuple[str, ...]) -> None:
    """Continue the run in RUN_DIR from its newest checkpoint, on any shape."""
    with user_errors():
        read_spec(run_dir)  # (a directory that holds no run gets no lease)
    # The run is this command's from here: a job or command that owns it refuses this, and
    # nothing takes it over while the preflight runs (seconds).
    claim = take_run(run_dir, "hpcshard resume")
    try:
        req, spec = _resumed(run_dir, nodes, gpus, spares, min_nodes, resume, sets)
    except BaseException:  # the run is given back to whoever had it (a killed CLI's launchers)
        lease.release(run_dir, claim, restore=True)
        raise
    if req is not None:
        _submit_slurm(spec, run_dir, req, resume, False, claim)
    _launch(spec, run_dir, resume, claim)


def _resumed(run_dir: Path, nodes: int | None, gpus: int | None, spares: int | None,
             min_nodes: int | None, resume: str, sets: tuple[str, ...],
             ) -> tuple[SbatchRequest | None, RunSpec]:
    """The run's spec on its new shape (read now that this command owns the run), and
    the sbatch request on Slurm; every check of `resume`."""
    with user_errors():
        spec = read_spec(run_dir)
        if backends.of(spec).in_queue:  # the new job takes them from this environment again
            check_secrets(spec.slurm.get("secrets", []), spec.slurm.get("env", {}), spec.profile)
        over = backends.reaching(spec).over(spec, run_dir)
        if over is None:
            raise ValueError(f"Slurm did not answer whether job {spec.jobs[-1]} of {run_dir} is still "
                             "running, so nothing was submitted; try again once `scontrol ping` answers")
        if not over:
            raise ValueError(f"{run_dir} is still running; stop it first (hpcshard preempt "
                             f"{run_dir} saves and stops; hpcshard cancel stops now)")
        probe_writable(run_dir)
        check_resume(run_dir, resume)
        spec.nodes, spec.gpus = nodes or spec.nodes, gpus or spec.gpus
        spec.spares = spec.spares if spares is None else spares
        spec.min_nodes = spec.min_nodes if min_nodes is None else min_nodes
        check_spares(spec)
        spec.sets = {**spec.sets, **parse_sets(sets)}
        req = None
        if backends.of(spec).in_queue:  # the same sbatch settings, on the (new) shape
            from hpcshard.slurm import cluster

            old = spec.slurm
            per_gpu = old.get("cpus_per_task", 0) // max(1, old.get("gpus_per_node", 1))
            req = SbatchRequest(**{**old, "nodes": spec.nodes + spec.spares, "gpus_per_node": spec.gpus,
                                   "cpus_per_task": per_gpu * spec.gpus, "run_dir": run_dir.resolve(),
                                   "no_kill": spec.no_kill,
                                   "exclude": bad_slurm_nodes(run_dir)})
            render(req, "true", RunPaths(run_dir).submitit, site.SETTINGS)
            cluster.check_request(req)
        if not spec.script:
            spec.resolved = preflight(spec)
    return req, spec


def _write_owned(spec: RunSpec, run_dir: Path, claim: lease.Owner) -> None:
    """Write the spec this command built, as the run's owner: nobody else writes it while
    this command owns the run; one that lost the run meanwhile writes nothing."""
    if not lease.owns(run_dir, claim.token):
        fail(ValueError(f"{run_dir} was taken over while this command prepared it ({lease.path(run_dir)}); "
                        "nothing was written or submitted"))
    spec.write(run_dir)


def _launch(spec: RunSpec, run_dir: Path, resume: str, claim: lease.Owner) -> NoReturn:
    """The local backend: run it here, as the owner of the run, until it ends."""
    _write_owned(spec, run_dir, claim)
    click.echo(f"run {spec.name}: {spec.nodes} node(s){_spares(spec)} x {spec.gpus} rank(s), {_what(spec)}")
    click.echo(f"run directory: {run_dir}")
    from hpcshard.launch.local import run_local

    def requeued(attempt: int, count: int) -> None:
        click.echo(f"stopped on request with a committed checkpoint: requeued as attempt "
                   f"{attempt} ({count}/{spec.max_requeues})")

    try:
        code = run_local(run_dir.resolve(), spec.nodes, spec.gpus, spares=spec.spares, resume=resume,
                         max_requeues=spec.max_requeues, on_attempt=requeued, owner=claim.token)
    finally:
        taken = _taken_from(run_dir, claim)
        lease.release(run_dir, claim)
    if taken:  # its ranks stopped without committing more: the run is the new owner's
        click.echo(f"left the run: {taken} owns it now; nothing more was committed or cleaned")
        sys.exit(code)
    last = ledger.end_of(run_dir, next_attempt(run_dir) - 1) or {}
    _report(run_dir, code, last)
    if code != 0 and last.get("user_error"):
        # the ranks found bad input only they could check (a changed init_from, say)
        fail(ValueError(last.get("error", "bad input")))
    sys.exit(code)


def _taken_from(run_dir: Path, claim: lease.Owner) -> str:
    """Who took the run over from this command while it ran ("" if nobody did)."""
    with contextlib.suppress(OSError):
        if not lease.owns(run_dir, claim.token):
            try:
                now = lease.read(run_dir)
            except lease.Busy as err:
                return f"an owner it cannot read ({err})"
            return (now.what or now.name) if now is not None else "nobody"
    return ""


def check_spares(spec: RunSpec) -> None:
    """--min-nodes above --nodes asks for the impossible."""
    if spec.min_nodes > spec.nodes:
        raise ValueError(f"--min-nodes {spec.min_nodes} is more than --nodes {spec.nodes}; give at "
                         f"most {spec.nodes} (or 0: never fewer than --nodes)")


def _spares(spec: RunSpec) -> str:
    return f" + {spec.spares} spare(s)" if spec.spares else ""


def _what(spec: RunSpec) -> str:
    if spec.script:
        own = spec.script
        return (f"script {'-m ' if own['kind'] == 'module' else ''}"
                f"{shlex.join([own['target'], *own['args']])}")
    res = spec.resolved
    return (f"sharding {res['sharding']}, {res['blocks']} x {res['block']}, "
            f"{res['params'] / 1e6:.2f}M params")


def _report(run_dir: Path, code: int, end: dict[str, Any]) -> None:
    """What the run came to (`end`: its last attempt's end record, {} if none landed)."""
    train, test = last_record(run_dir, "loss"), last_record(run_dir, "eval_loss")
    if train:
        line = f"step {train['step']}: loss {train['loss']:.4f}"
        if test:
            line += f", eval loss {test['eval_loss']:.4f}"
        click.echo(line)
    if code == REQUEUE_EXIT:
        click.echo(f"stopped with a committed checkpoint; continue with: hpcshard resume {run_dir}")
        return
    if code == STORAGE_EXIT:  # what is full and what to do (the end record may not have landed)
        click.echo(end.get("how") or f"stopped: the run directory {run_dir} refused its writes "
                   "(full, over quota or read-only); free space, then hpcshard resume")
    metrics = run_dir / METRICS  # a script writes none
    outcome = "finished" if code == 0 else f"{'stopped' if code == STORAGE_EXIT else 'failed'} (exit {code})"
    click.echo(f"{outcome}: " + (f"metrics in {metrics}, " if metrics.exists() else "")
               + f"logs in {run_dir / 'logs'}")


def preflight(spec: RunSpec) -> dict[str, Any]:
    """Import the job and check it in a subprocess (torch stays out of the CLI process)."""
    return _preflight({"job": spec.job, "sets": spec.sets, "nodes": spec.nodes, "gpus": spec.gpus})


def preflight_many(specs: list[RunSpec], configs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """A sweep's runs (one job, a shape, several configurations), checked in one subprocess;
    a bad configuration is named in the error."""
    from hpcshard.rundir.sweep import label

    first = specs[0]
    request = {"job": first.job, "variants": [s.sets for s in specs], "nodes": first.nodes,
               "gpus": first.gpus}
    try:
        return list(_preflight(request)["variants"])
    except ValueError as err:
        index, sep, said = str(err).partition(": ")
        if not sep or not index.startswith("variant "):
            raise
        i = int(index.split()[1])
        raise ValueError(f"configuration {i} ({label(configs[i])}): {said}") from None


def _preflight(request: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "hpcshard.runtime.preflight"],
                          input=json.dumps(request), capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode == 2:
        raise ValueError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                         else "the job failed its preflight check")
    if proc.returncode:
        raise RuntimeError(f"preflight of {request['job']} crashed:\n{proc.stderr}")
    return dict(json.loads(proc.stdout))
