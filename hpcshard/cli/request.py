"""The one request builder that `render`, `submit`, `resume` and `sweep` share.

A request is built in three steps, each its own function:

1. `new`, `again` (resume) and `tasks` (a sweep) build the typed `Request` from the
   command's options, the merged settings and the job. They run nothing, create nothing,
   ask no scheduler: `render` prints what they built. What they read is the command line's
   input (the job file, the template, the run directory that must be new or is resumed).
2. `check` checks it against the world: the job imported and built on the meta device (in
   a subprocess, `runtime.preflight`: this process never imports torch), the cluster's
   partitions and limits.
3. `schedule` (and `schedule_array`, a sweep's tasks as job arrays) is the one place a
   request becomes a run on its backend (`launch.backends`): the spec written as the run's
   owner, the job submitted or run here, the run handed to it.

Bad input is a `ValueError` (`hpcshard.errors.UserError`) with the one line to show; the
command line's edge (`hpcshard.cli`) shows it and exits 2. Nothing here exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from hpcshard import script, site
from hpcshard.cli import snapshot
from hpcshard.cli.snapshot import Snapshot
from hpcshard.config import kept_sets, parse_sets
from hpcshard.errors import JobCrashed, UserError
from hpcshard.launch import backends
from hpcshard.rundir import lease, ledger, store
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.ledger import bad_slurm_nodes, next_attempt
from hpcshard.rundir.metrics import METRICS, last_record
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.rankenv import REQUEUE_EXIT, STORAGE_EXIT
from hpcshard.rundir.spec import (
    Code,
    Resolved,
    RunSpec,
    Script,
    check_resume,
    check_run_dir,
    default_run_dir,
    job_ref,
    job_stem,
    probe_writable,
)
from hpcshard.slurm.arrays import Part, dependency, plan
from hpcshard.slurm.sbatch import SbatchRequest, render

NO_RESUME = ("auto", "never")
"""The --resume values that name no checkpoint (a script finds its own)."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """What the command line names: an hpcshard job (file or module), or a script file or
    `-m` module run as it is."""

    label: str
    """What the run and its directory are named after."""
    ref: str
    """The job reference a rank imports (a file's absolute path, or a module)."""
    script: Script | None = None
    """A script run as it is (`RunSpec.script`, without where and how it is stopped, which
    the settings say); None for a job."""

    @classmethod
    def parse(cls, job: str | None, module: str | None = None, args: tuple[str, ...] = ()) -> Target:
        if module:
            script.check_module(module)
            return cls(label=module, ref=module, script=Script(
                kind="module", target=module, args=(*([job] if job is not None else []), *args)))
        if job is None:
            raise UserError("nothing to run: give a job (jobs/charlm.py), a script "
                            "(train.py -- ARGS) or a module (-m package.module -- ARGS)")
        path = Path(job)
        if (job.endswith(".py") or path.exists()) and path.is_file() and not script.defines_job(path):
            return cls(label=job, ref=str(path.resolve()),
                       script=Script(kind="file", target=str(path.resolve()), args=args))
        if args:
            raise UserError(f"{job} is an hpcshard job: it takes --set KEY=VALUE, not arguments "
                            f"({shlex.join(args)}); a plain script takes them after --")
        return cls(label=job, ref=job_ref(job))


@dataclass(kw_only=True)
class Request:
    """One run, as the command asked for it: its spec, its directory, and, on a backend
    that queues runs, the sbatch request (None on the local backend)."""

    spec: RunSpec
    run_dir: Path
    sbatch: SbatchRequest | None
    resume: str = "auto"
    fresh: bool = True
    """The run directory is made for this request: removed again if the scheduler refuses."""
    ask: snapshot.Ask | None = None
    """The snapshot of the job's code it asks for (None: the run's copy as it is, or `--code
    live`), read by `check` into `code`, which `schedule` copies into the run directory."""
    code: Snapshot | None = None

    @property
    def backend(self) -> backends.Backend:
        return backends.of(self.spec)


def pick_backend(name: str) -> str:
    """`auto`: Slurm when its commands are here and a controller answers, else local."""
    if name != "auto":
        return name
    from hpcshard.slurm import cluster

    return backends.SLURM if cluster.available() else backends.LOCAL


def new(res: site.Resolved, job: str | None, *, nodes: int, backend: str, module: str | None = None,
        args: tuple[str, ...] = (), run_dir: Path | None = None, name: str | None = None,
        resume: str = "auto", sets: tuple[str, ...] = ()) -> Request:
    """What `submit` and `render` ask for: a new run of `job` (or a script: `Target.parse`)
    on `nodes` nodes. `backend` "auto" is the one question asked of the world here, after
    every check of the input (`pick_backend`: does a Slurm controller answer)."""
    v = res.values
    check_secrets(v["secrets"], v["env"], res.profile)
    target = Target.parse(job, module, args)
    own = target.script
    if own:
        if sets:
            raise UserError(f"--set {sets[0]}: --set is for hpcshard jobs; pass a script's own "
                            f"arguments after --, e.g. hpcshard submit {target.label} -- --lr 3e-4")
        if resume not in NO_RESUME:
            raise UserError(f"--resume {resume}: a script finds its own checkpoints "
                            "(in $HPCSHARD_CHECKPOINT_DIR); use auto or never")
        own = replace(own, cwd=str(Path.cwd()), signal=v["script_signal"], grace=v["script_grace"])
    run_dir = run_dir or default_run_dir(target.label, site.storage_root(res))
    check_run_dir(run_dir, v["run_group"])
    if resume not in NO_RESUME:
        check_resume(run_dir, resume)
    # The profile's training settings under the command line's.
    train = {} if own else {**v["train"], **parse_sets(sets)}
    ask = _snapshot(res, target, run_dir)
    spec = run_spec(res, target.ref, train, nodes, pick_backend(backend), name or job_stem(target.label),
                    script=own)
    check_spares(spec)
    sbatch = None
    if backends.of(spec).in_queue:
        sbatch = _checked(SbatchRequest.from_settings(
            v, res.template_dirs, job_name=spec.name, nodes=spec.nodes, gpus=spec.gpus, run_dir=run_dir,
            spares=spec.spares, min_nodes=spec.min_nodes), run_dir)
        if own and own.grace >= sbatch.signal_lead_s:
            raise UserError(f"--grace {own.grace} is not below the notice's lead time "
                            f"({sbatch.signal_lead_s}s): the time limit would kill the script "
                            "first; lower --grace or raise --signal-lead")
    return Request(spec=spec, run_dir=run_dir, sbatch=sbatch, resume=resume, ask=ask)


def _snapshot(res: site.Resolved, target: Target, run_dir: Path) -> snapshot.Ask | None:
    """The snapshot of the job's workspace to take (None: `--code live`)."""
    if res.values["code"] == "live":
        return None
    source = target.script.target if target.script else target.ref
    return snapshot.Ask(source, _is_module(source, target.script), res.values["code_max_mb"], skip=(run_dir,))


def _is_module(source: str, script: Script | None) -> bool:
    """A script says what it is; a job's reference is a file as `job_ref` takes one."""
    if script is not None:
        return script.kind == "module"
    return not (source.endswith(".py") or Path(source).exists())


def again(spec: RunSpec, run_dir: Path, *, nodes: int | None = None, gpus: int | None = None,
          spares: int | None = None, min_nodes: int | None = None, sets: tuple[str, ...] = (),
          resume: str = "auto", code: str = "snapshot", code_max_mb: int = 100) -> Request:
    """What `resume` asks for: the run's spec on its (new) shape, and on Slurm the same sbatch
    settings as its last submission, sized for it, without the nodes it declared bad. `code`:
    the run's copy of its code (snapshot), a new copy of its source as it is now (current),
    or its source itself at every start (live)."""
    if code == "snapshot" and spec.code_lost:  # (the preflight would fail on the copy's old path)
        raise UserError(spec.code_lost)
    check_secrets_again(spec)
    probe_writable(run_dir)
    check_resume(run_dir, resume)
    spec.nodes, spec.gpus = nodes or spec.nodes, gpus or spec.gpus
    spec.spares = spec.spares if spares is None else spares
    spec.min_nodes = spec.min_nodes if min_nodes is None else min_nodes
    check_spares(spec)
    # (pinned into the sets: the preflight's new resolved config no longer shows its age)
    spec.sets = kept_sets({**spec.sets, **parse_sets(sets)}, spec.resolved.config)
    sbatch = None
    if backends.of(spec).in_queue:
        old = SbatchRequest.recorded(spec.slurm)
        if old is None:
            raise UserError(f"{run_dir}'s spec.json records no sbatch request for its {spec.backend} job; "
                            "submit the job again (hpcshard submit)")
        per_gpu = old.cpus_per_task // max(1, old.gpus_per_node)
        sbatch = _checked(replace(
            old, nodes=spec.nodes + spec.spares, gpus_per_node=spec.gpus, cpus_per_task=per_gpu * spec.gpus,
            run_dir=run_dir.resolve(), no_kill=spec.no_kill, exclude=bad_slurm_nodes(run_dir),
            dependency=""), run_dir)
    if code == "live" and spec.code is not None:
        _live(spec, spec.code)
    return Request(spec=spec, run_dir=run_dir, sbatch=sbatch, resume=resume, fresh=False,
                   ask=_current(spec, run_dir, code_max_mb) if code == "current" else None)


def _live(spec: RunSpec, code: Code) -> None:
    """`resume --code live`: the run imports its source again, as submitted."""
    if code.dir and spec.job.startswith(code.dir + os.sep):
        spec.job = code.source
        if spec.script is not None:
            spec.script = replace(spec.script, target=code.source)
    spec.code = None


def _current(spec: RunSpec, run_dir: Path, limit_mb: int) -> snapshot.Ask:
    """`resume --code current`: the run's source (what was submitted) read again."""
    source = spec.code.source if spec.code is not None else (spec.script.target if spec.script else spec.job)
    module = _is_module(source, spec.script)
    if not module and not Path(source).is_file():
        raise UserError(f"--code current: the run's source {source} is gone; resume with the run's "
                        "copy (--code snapshot), or submit the job again from where it is now")
    return snapshot.Ask(source, module, limit_mb, skip=(run_dir,))


@dataclass(kw_only=True)
class Tasks:
    """A sweep's request: one run per configuration, each in `root`/task-i, and on Slurm
    the job array that runs them all (None on the local backend; `schedule_array` splits
    it where the cluster's arrays take fewer tasks)."""

    runs: list[Request]
    array: SbatchRequest | None
    root: Path
    name: str

    @property
    def job(self) -> str:
        """The job reference every run imports."""
        return self.runs[0].spec.job

    @property
    def backend(self) -> str:
        return self.runs[0].spec.backend


def tasks(res: site.Resolved, job: str, configs: list[dict[str, str]], *, nodes: int, backend: str,
          root: Path | None = None, name: str | None = None, sets: tuple[str, ...] = (),
          max_parallel: int | None = None) -> Tasks:
    """What `sweep` asks for: `job` once per configuration. `backend` "auto" is resolved
    after every check of the input, as in `new`."""
    v = res.values
    check_secrets(v["secrets"], v["env"], res.profile)
    target = Target.parse(job)
    name = name or job_stem(target.label)
    root = root or default_run_dir(f"{job_stem(target.label)}-sweep", site.storage_root(res))
    if target.script:
        raise UserError(f"{target.label} is a plain script: a sweep sets an hpcshard job's config "
                        "(--grid KEY=...); loop over `hpcshard submit` for a script")
    if v["spares"] or v["min_nodes"]:
        raise UserError(f"--spares/--min-nodes ({v['spares']}/{v['min_nodes']}): a sweep's runs do not "
                        "take spares or shrink yet (a lost node requeues the run); drop them, or "
                        "submit the configuration alone")
    if v["requeue_policy"] != "requeue" and res.source("requeue_policy") == "command line":
        raise UserError(f"--requeue-policy {v['requeue_policy']}: a sweep's tasks are requeued "
                        "each by itself (requeue); drop the option")
    check_run_dir(root, v["run_group"])
    ask = _snapshot(res, target, root)
    common = {**v["train"], **parse_sets(sets)}
    backend = pick_backend(backend)
    specs = [run_spec(res, target.ref, {**common, **config}, nodes, backend, f"{name}-{i}",
                      requeue_policy="requeue") for i, config in enumerate(configs)]
    check_spares(specs[0])
    array = None
    if backends.BACKENDS[backend].in_queue:
        one = specs[0]
        array = _checked(replace(
            SbatchRequest.from_settings(v, res.template_dirs, job_name=name, nodes=one.nodes, gpus=one.gpus,
                                        run_dir=root, spares=one.spares, min_nodes=one.min_nodes),
            requeue=True, array=f"0-{len(configs) - 1}" + (f"%{max_parallel}" if max_parallel else "")),
            root)
    from hpcshard.rundir.sweep import Sweep

    runs = [Request(spec=s, run_dir=Sweep.task_dir(root, i), sbatch=array, ask=ask)
            for i, s in enumerate(specs)]
    return Tasks(runs=runs, array=array, root=root, name=name)


def check_secrets_again(spec: RunSpec) -> None:
    """A run resumed on a backend that queues it: its new job takes the secrets from this
    environment again."""
    if backends.of(spec).in_queue:
        old = SbatchRequest.recorded(spec.slurm)
        if old is not None:
            check_secrets(old.secrets, old.env, spec.profile)


def _checked(sbatch: SbatchRequest, run_dir: Path) -> SbatchRequest:
    """The template rendered once (its errors now, before anything is made)."""
    render(sbatch, "true", RunPaths(run_dir).submitit, site.SETTINGS)
    return sbatch


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
            raise UserError(f"{name} is both a secret and an env value of {whose}: a secret's value "
                            "is never written into the script; drop it from env")
        if not os.environ.get(name):
            raise UserError(f"{name} is not set in your environment, and {whose} names it as a "
                            f"secret the job needs; export {name} first (its value is never written)")


def check_spares(spec: RunSpec) -> None:
    """--min-nodes above --nodes asks for the impossible."""
    if spec.min_nodes > spec.nodes:
        raise UserError(f"--min-nodes {spec.min_nodes} is more than --nodes {spec.nodes}; give at "
                        f"most {spec.nodes} (or 0: never fewer than --nodes)")


# -- 2. checked against the world ------------------------------------------------------------


def check(requests: list[Request], *, cluster: bool = True, job: bool = True,
          configs: list[dict[str, str]] | None = None) -> None:
    """Check `requests` (one run, or a sweep's with its `configs`) against the cluster (its
    partitions and limits) and the job (imported and built in a subprocess); each spec gets
    what the job resolved to (`RunSpec.resolved`)."""
    first = requests[0]
    first.backend.ready(first.spec)
    if cluster and first.sbatch is not None:
        from hpcshard.slurm import cluster as slurm

        slurm.check_request(first.sbatch)
        if first.fresh:
            warn_storage(first.sbatch.run_dir, first.spec.nodes)
    if not job:
        return
    if first.ask is not None:  # the workspace as it is now: what the run will run
        taken = first.ask.take()
        for one in requests:
            one.code = taken
    if first.spec.script:
        return
    if configs is None:
        first.spec.resolved = Resolved.of(preflight(first.spec, first.code))
        return
    many = preflight_many([r.spec for r in requests], configs, first.code)
    for one, resolved in zip(requests, many, strict=True):
        one.spec.resolved = Resolved.of(resolved)


def warn_storage(run_dir: Path, nodes: int) -> None:
    node_local = ("/tmp", "/var/tmp", "/dev/shm", "/scratch/local")
    if nodes > 1 and str(run_dir.resolve()).startswith(node_local):
        click.echo(f"warning: {run_dir} looks node-local; with {nodes} nodes every node must see "
                   "the same run directory (checkpoints, logs): put it on shared storage", err=True)


def preflight(spec: RunSpec, code: Snapshot | None = None) -> dict[str, Any]:
    """Import the job and check it in a subprocess (torch stays out of the CLI process): the
    code the run will run, from where its ranks will import it (`_code`)."""
    return _preflight({**_code(spec, code), "sets": spec.sets, "nodes": spec.nodes, "gpus": spec.gpus,
                       "min_nodes": spec.min_nodes, "here": backends.of(spec).here})


def _code(spec: RunSpec, code: Snapshot | None) -> dict[str, Any]:
    """The job and its import path for a preflight: a snapshot just taken (a new run's, a
    `resume --code current`'s) is its workspace as it is, the run's copy else."""
    if code is not None:
        return {"job": code.source, "path": code.live}
    return {"job": spec.job, "path": list(spec.code.path) if spec.code else []}


def preflight_many(specs: list[RunSpec], configs: list[dict[str, str]],
                   code: Snapshot | None = None) -> list[dict[str, Any]]:
    """A sweep's runs (one job, a shape, several configurations), checked in one subprocess;
    a bad configuration is named in the error."""
    from hpcshard.rundir.sweep import label

    first = specs[0]
    request = {**_code(first, code), "variants": [s.sets for s in specs], "nodes": first.nodes,
               "gpus": first.gpus, "here": backends.of(first).here}
    try:
        return list(_preflight(request)["variants"])
    except ValueError as err:
        index, sep, said = str(err).partition(": ")
        if not sep or not index.startswith("variant "):
            raise
        i = int(index.split()[1])
        raise UserError(f"configuration {i} ({label(configs[i])}): {said}") from None


def _preflight(request: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "hpcshard.runtime.preflight"],
                          input=json.dumps(request), capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode == UserError.exit_code:
        raise UserError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                        else "the job failed its preflight check")
    if proc.returncode:
        raise JobCrashed(f"preflight of {request['job']} crashed:\n{proc.stderr}")
    return dict(json.loads(proc.stdout))


# -- 3. scheduled ---------------------------------------------------------------------------


def take_run(run_dir: Path, what: str) -> lease.Owner:
    """This command takes the run (`rundir.lease`) until it hands it to the job it
    submits, or, on the local backend, until the run ends here; one line and exit 2 while
    another job or command owns it, or Slurm cannot say whether its job still runs."""
    from hpcshard.slurm import cluster

    try:
        claim = lease.take(run_dir, lease.Owner.of_process(what), cluster.job_alive)
    except lease.Busy as err:
        raise UserError(str(err)) from None
    except OSError as err:  # taking the lease is the command's first write into the run
        raise UserError(f"run directory {run_dir} is not writable ({err.strerror}); its lease "
                        "could not be taken: fix its permissions or mount") from None
    lease.keep(run_dir, claim)  # renewed while this command holds it (hosts that cannot see it)
    return claim


def schedule(req: Request, claim: lease.Owner, *, follow: bool = False,
             submitted: Callable[[str], None] | None = None) -> int:
    """Hand the run to its backend as the owner of its directory: submitted (Slurm: the
    job then owns the run) or run here until it ends (local); the command's exit code.
    `submitted`: told the job id once the job is queued and the run handed to it (before
    `follow`: a chain's steps go after it)."""
    if req.code is not None:  # (the run is this command's: nothing else writes in it now)
        try:
            snapshot.write(req.code, req.run_dir, req.spec)
        except UserError:
            _give_back(req, claim)
            raise
    if req.sbatch is None:
        return _run_here(req, claim)
    _warn_lead_time(req.run_dir, req.sbatch)
    req.spec.slurm = req.sbatch.record()
    _write_owned(req.spec, req.run_dir, claim)
    first = next_attempt(req.run_dir)  # (the job's first attempt: older ones are other jobs')
    try:
        job_id = req.backend.submit(req.spec, req.run_dir, req.sbatch, req.resume)
    except ValueError:
        _give_back(req, claim)
        raise
    spec = RunSpec.add_job(req.run_dir, job_id)
    # Last: the job's launchers wait for it (`launch.slurm.own_run`) before they train.
    if lease.hand_over(req.run_dir, claim, lease.Owner.of_job(job_id)) is None:
        with contextlib.suppress(ValueError):
            req.backend.cancel_job(job_id)
        raise UserError(f"{req.run_dir} was taken over while job {job_id} was submitted (its lease: "
                        f"{lease.path(req.run_dir)}); job {job_id} is cancelled")
    click.echo(f"submitted job {job_id}: {spec.nodes} node(s){_spares(spec)} x {spec.gpus} GPU(s), "
               + describe(spec))
    click.echo(f"run directory: {req.run_dir}")
    _echo_code(spec)
    click.echo(f"logs: {req.backend.logs(req.run_dir, job_id)}")
    paths = RunPaths(req.run_dir)
    click.echo(f"follow: hpcshard submit ... --follow, or tail -f {paths.rank_log(0)}")
    if submitted is not None:
        submitted(job_id)
    return _follow(req.run_dir, job_id, req.spec.profile, first) if follow else 0


def _give_back(req: Request, claim: lease.Owner) -> None:
    """Nothing was started: a run directory made for the request goes, an existing run is
    given back to whoever had it."""
    if req.fresh:
        shutil.rmtree(req.run_dir, ignore_errors=True)
    else:
        lease.release(req.run_dir, claim, restore=True)


def array_plan(count: int, max_parallel: int | None) -> list[Part]:
    """The job arrays a sweep of `count` tasks is submitted as: one, or, past what the
    cluster's arrays take, several throttled together (`slurm.arrays.plan`)."""
    from hpcshard.slurm import cluster

    return plan(count, cluster.max_array_size(), max_parallel or 0)


def schedule_array(requests: list[Request], root: Path, parts: list[Part]) -> tuple[list[str], list[str]]:
    """A sweep's tasks as the job arrays `parts` plans (`array_plan`): each task's spec
    written and its directory taken before sbatch (a task may start at once), each handed
    to its task's job after; the tasks' job ids and the arrays'. The later arrays' log
    links are made before any array is queued (a storage that takes none refuses the
    sweep whole). sbatch refused, or Ctrl-C between the arrays: the arrays it took before
    are cancelled and the sweep's directory goes again."""
    from hpcshard.rundir.sweep import Sweep

    array = requests[0].sbatch
    assert array is not None
    claims = []
    for req in requests:
        req.spec.slurm = replace(array, run_dir=req.run_dir.resolve(), array="").record()
        req.spec.write(req.run_dir)
        claims.append(take_run(req.run_dir, "hpcshard sweep"))
    ids: list[str] = []
    arrays: list[str] = []
    try:
        try:
            for k, part in enumerate(parts[1:], start=1):
                Sweep.link_tasks(root, k, part.first, part.count)
        except OSError as err:
            raise UserError(f"{Sweep.array_dir(root, 1)}: {err.strerror or err}: a sweep of more runs than "
                            "one job array takes links each later array's task directories to the "
                            "sweep's (their batch logs); put the sweep on storage that takes symbolic "
                            "links (--sweep-dir), or split it into sweeps of at most "
                            f"{parts[0].count}") from None
        for k, part in enumerate(parts):
            ids += _submit_part(requests[part.first:part.first + part.count], root, array, k, part, arrays)
            arrays.append(ids[-1].split("_")[0])
    except (ValueError, KeyboardInterrupt) as err:
        for job in arrays:
            with contextlib.suppress(ValueError):
                requests[0].backend.cancel_job(job)
        shutil.rmtree(root, ignore_errors=True)
        if not arrays or isinstance(err, (UserError, KeyboardInterrupt)):
            raise
        raise UserError(f"array {len(arrays) + 1} of {len(parts)} (tasks {parts[len(arrays)].first} to "
                        f"{parts[len(arrays)].tasks[-1]}): {err}; the {len(arrays)} array(s) submitted "
                        "before it are cancelled and the sweep's directory removed") from None
    for req, claim, job_id in zip(requests, claims, ids, strict=True):
        RunSpec.add_job(req.run_dir, job_id)
        if lease.hand_over(req.run_dir, claim, lease.Owner.of_job(job_id)) is None:
            req.backend.cancel_job(job_id)  # another command took the task's directory meanwhile
            click.echo(f"warning: {req.run_dir} was taken over while the array was "
                       f"submitted: task {job_id} cancelled", err=True)
    return ids, arrays


def _submit_part(requests: list[Request], root: Path, array: SbatchRequest, k: int, part: Part,
                 arrays: list[str]) -> list[str]:
    """Array `k` of a sweep: its tasks' job ids. Its batch logs go to its tasks'
    directories: the sweep's own for the first array, links to them for the others
    (`Sweep.link_tasks`, made before); it waits for the arrays `part.after` names
    (submitted before it)."""
    from hpcshard.rundir.sweep import Sweep

    where = Sweep.array_dir(array.run_dir, k) if k else array.run_dir
    return requests[0].backend.submit_array([r.spec for r in requests], [r.run_dir for r in requests],
                                            replace(array, array=part.spec, run_dir=where), root,
                                            dependency([arrays[j] for j in part.after]))


def _warn_lead_time(run_dir: Path, req: SbatchRequest) -> None:
    """The notice must leave time to save: compare with the last save this run measured."""
    last = store.committed(run_dir / store.CHECKPOINTS)
    seconds = last[-1].manifest.get("save_seconds", 0) if last else 0
    if seconds and req.signal_lead_s < seconds * 1.5:
        click.echo(f"warning: --signal-lead {req.signal_lead_s}s is short: the last checkpoint of "
                   f"this run took {seconds:.0f}s to save", err=True)


FOLLOW_GRACE_S = 10.0
"""How long `--follow` waits, once the run's ledger says it ended, for Slurm to say its
job ended too (a few seconds when nothing holds it; `follow_log`)."""


def _follow(run_dir: Path, job_id: str, profile: str | None = None, first_attempt: int = 0) -> int:
    """Print rank 0's log as it grows until Slurm says the job is over (requeues included),
    or the run has ended (`ledger.finished`, from the job's first attempt on): one scontrol
    a poll, the profile's `poll_s` apart (doubling while the job's state stays the same, up
    to `poll_max_s`), the ledger read every second. A run done while its job is still
    held (a lost node's task: `launch.release`) is done: exit 0, the job's state said."""
    from hpcshard.cli.common import follow_log, poll_backoff
    from hpcshard.slurm import cluster
    from hpcshard.slurm.states import JobState

    final = cluster.JobInfo.forgotten(job_id)
    ended: list[dict[str, Any]] = []

    def over() -> tuple[bool, str]:  # a controller that does not answer is asked again, not "over"
        nonlocal final
        answer = cluster.query_job(job_id)  # (one scontrol a poll)
        if answer.over is not None:
            final = answer.info or cluster.JobInfo.forgotten(job_id)
        return answer.over is True, f"{answer.said.value} {answer.info.state_text if answer.info else ''}"

    def run_ended() -> bool:
        with contextlib.suppress(OSError, ValueError):
            if (record := ledger.finished(ledger.read(run_dir), first_attempt)) is not None:
                ended.append(record)
        return bool(ended)

    follow_log(RunPaths(run_dir).rank_log(0), over, poll_backoff(profile), ended=run_ended,
               grace=FOLLOW_GRACE_S)
    if ended and not final.state.over and final.state is not JobState.UNKNOWN:
        done = ended[-1].get("reason") == EndReason.DONE
        click.echo(f"job {job_id}: {final.state_text} (the run "
                   + ("is done" if done else "gave up") + "; Slurm is still ending the job)")
        return 0 if done else 1
    if final.state is JobState.UNKNOWN:  # forgotten between two polls (a backed-off one may
        # come after MinJobAge): accounting keeps how it ended (one sacct, at the end only)
        final = cluster.job_state(job_id) or final
    click.echo(f"job {job_id}: {final.state_text or 'no longer known to Slurm'}")
    return 0 if final.state is JobState.COMPLETED else 1


def _echo_code(spec: RunSpec) -> None:
    if spec.code is not None:
        click.echo(f"code: {spec.code.summary}")


def _write_owned(spec: RunSpec, run_dir: Path, claim: lease.Owner) -> None:
    """Write the spec this command built, as the run's owner: nobody else writes it while
    this command owns the run; one that lost the run meanwhile writes nothing."""
    if not lease.owns(run_dir, claim.token):
        raise UserError(f"{run_dir} was taken over while this command prepared it ({lease.path(run_dir)}); "
                        "nothing was written or submitted")
    spec.write(run_dir)


def _run_here(req: Request, claim: lease.Owner) -> int:
    """The local backend: run it here, as the owner of the run, until it ends."""
    spec, run_dir = req.spec, req.run_dir
    _write_owned(spec, run_dir, claim)
    click.echo(f"run {spec.name}: {spec.nodes} node(s){_spares(spec)} x {spec.gpus} rank(s), "
               + describe(spec))
    click.echo(f"run directory: {run_dir}")
    _echo_code(spec)

    def requeued(attempt: int, count: int) -> None:
        click.echo(f"stopped on request with a committed checkpoint: requeued as attempt "
                   f"{attempt} ({count}/{spec.max_requeues})")

    try:
        code = req.backend.run(spec, run_dir, req.resume, claim.token, requeued)
    finally:
        taken = _taken_from(run_dir, claim)
        lease.release(run_dir, claim)
    if taken:  # its ranks stopped without committing more: the run is the new owner's
        click.echo(f"left the run: {taken} owns it now; nothing more was committed or cleaned")
        return code
    last = ledger.end_of(run_dir, next_attempt(run_dir) - 1) or {}
    _report(run_dir, code, last, req.backend)
    if code != 0 and last.get("user_error"):
        # the ranks found bad input only they could check (a changed init_from, say)
        raise UserError(last.get("error", "bad input"))
    return code


def _report(run_dir: Path, code: int, end: dict[str, Any], backend: backends.Backend) -> None:
    """What the run came to (`end`: its last attempt's end record, {} if none landed)."""
    train, test = last_record(run_dir, "loss"), last_record(run_dir, "eval_loss")
    if train:
        line = f"step {train['step']}: loss {train['loss']:.4f}"
        if test:
            line += f", eval loss {test['eval_loss']:.4f}"
        click.echo(line)
    if code == REQUEUE_EXIT:
        click.echo(f"stopped with a committed checkpoint; continue with: {backend.go_on(run_dir)}")
        return
    if code == STORAGE_EXIT:  # what is full and what to do (the end record may not have landed)
        click.echo(end.get("how") or f"stopped: the run directory {run_dir} refused its writes "
                   "(the launchers' line above says how); fix the storage, then hpcshard resume")
    metrics = run_dir / METRICS  # a script writes none
    outcome = "finished" if code == 0 else f"{'stopped' if code == STORAGE_EXIT else 'failed'} (exit {code})"
    click.echo(f"{outcome}: " + (f"metrics in {metrics}, " if metrics.exists() else "")
               + f"logs in {RunPaths(run_dir).logs}")


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


def _spares(spec: RunSpec) -> str:
    return f" + {spec.spares} spare(s)" if spec.spares else ""


def describe(spec: RunSpec) -> str:
    """The run in a few words: the script it runs, or the job's sharding and size."""
    if spec.script:
        return spec.script.command
    res = spec.resolved
    hybrid = res.sharding == "hybrid" and res.shard
    mesh = f" (replicate {res.replicate} x shard {res.shard})" if hybrid else ""
    return f"sharding {res.sharding}{mesh}, {res.blocks} x {res.block}, {res.params / 1e6:.2f}M params"
