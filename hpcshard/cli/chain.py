"""`submit --after RUN_OR_JOB`, `--then export-hf=DIR` and `--then eval`: chains of runs (`rundir.chain`
holds the record and the decisions, `launch.then` the steps). Here: the options, what the
command line names (a run directory, or a Slurm job id and the run it belongs to), the
checks that refuse a chain before anything is submitted, and what `status` shows."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hpcshard.errors import UserError
from hpcshard.rundir import ledger
from hpcshard.rundir.chain import (
    After,
    Chain,
    Then,
    depend_on_run,
    parse_after,
    parse_then,
    status_lines,
    verdict,
)
from hpcshard.rundir.spec import SPEC, read_spec

F = Callable[..., Any]


def chain_options(f: F) -> F:
    f = click.option("--then", "then", multiple=True, metavar="export-hf=DIR|eval",
                     help="After the run has ended done, as a Slurm job of its own: export its final "
                          "checkpoint as a Hugging Face directory (ckpt export --hf), or evaluate it on "
                          "the run's held-out data (eval: the loss goes to its metrics). Local "
                          "backend: right after the run, here.")(f)
    return click.option("--after", metavar="[KIND:]RUN_OR_JOB",
                        help="Slurm: start once a run (its directory: after the run has ended, through "
                             "its requeues and continuation jobs) or a Slurm job has ended; KIND is "
                             "afterok (default: ended done), afterany or afternotok.")(f)


def plan(after: str | None, then: tuple[str, ...], queued: bool) -> tuple[After | None, list[Then]]:
    """What the options ask for, checked before anything is made or submitted."""
    steps = parse_then(then)
    if any(s.what == "export-hf" for s in steps) and importlib.util.find_spec("transformers") is None:
        raise UserError("--then export-hf: needs the transformers package (pip install 'hpcshard[hf]')")
    if after is None:
        return None, steps
    if not queued:
        raise UserError(f"--after {after}: the local backend runs one command at a time; run the "
                        "commands one after the other (or submit with --backend slurm)")
    return resolve(after), steps


def resolve(text: str) -> After:
    """`--after [KIND:]RUN_OR_JOB` against the world: the run directory (or the run a job
    id belongs to) and the job to wait for (`chain.depend_on_run`); a bare Slurm job as it
    is. One line and exit 2 for an unknown job or a missing run directory."""
    from hpcshard.slurm import cluster

    kind, target = parse_after(text)
    path = Path(target)
    if not path.is_dir() and re.fullmatch(r"\d+(_\d+)?", target):
        asked = cluster.query_job(target)
        if asked.said is cluster.Said.NO_SUCH_JOB:
            raise UserError(f"--after {text}: Slurm does not know job {target}")
        if asked.info is None:
            raise UserError(f"--after {text}: Slurm did not answer about job {target} ({asked.error}); "
                            "nothing was submitted")
        if asked.info.array_job == target:  # a whole job array (a sweep's): Slurm waits for every task
            return After(kind=kind, target=target, job=target)
        run = Path(asked.info.stdout).parent.parent if asked.info.stdout else None  # RUN/logs/slurm-%j
        if run is None or not (run / SPEC).is_file():
            if asked.over and kind == "afterok" and asked.info.exit_code not in ("", "0:0"):
                raise UserError(f"--after {text}: job {target} ended {asked.info.state_text}, so this "
                                "would never start; use afterany:")
            return After(kind=kind, target=target, job=target)
        path = run
    if not path.is_dir():
        raise UserError(f"--after {text}: {target} is neither a run directory nor a Slurm job id")
    spec = read_spec(path)
    newest = spec.jobs[-1] if spec.jobs else None
    ended = verdict(ledger.read(path))
    over = cluster.query_job(newest).over if newest and ended is None else None
    job = depend_on_run(kind, target, ended, newest, over)
    return After(kind=kind, target=target, job=job, run=str(path.resolve()))


def record(run_dir: Path, after: After | None, steps: list[Then]) -> None:
    """The new run's chain.json, before its job is submitted."""
    if after is not None or steps:
        Chain(after=after, then=steps).write(run_dir)


def submitted(run_dir: Path, after: After | None, job: str) -> None:
    """Job `job` of a new run is queued: its `--then` steps after it, and the run it waits
    for told (a continuation of that run moves this job's dependency onto its new job)."""
    from hpcshard.launch.then import submit_steps

    if after is not None and after.run and after.job:
        Chain.update(Path(after.run), lambda c: c.followers.append(
            {"job": job, "kind": after.kind, "run": str(run_dir.resolve())}))
        _catch_up(Path(after.run), after, job)
    ids = submit_steps(run_dir, job)
    for new, step in zip(ids, Chain.read(run_dir).then, strict=True):
        if new:
            click.echo(f"then: {step.label} as job {new}, once the run has ended done")
        else:
            click.echo(f"warning: then: {step.label}: {step.said}; the run is queued as job {job} all the "
                       "same: once it has ended done, run the step by hand", err=True)


def _catch_up(up: Path, after: After, job: str) -> None:
    """The run `job` waits for went on under a newer job between `resolve` and the
    follower's registration (a continuation or a take-over moves only the followers it
    finds, and records its job before it looks): `job` is moved onto the newest here. A
    continuation after the registration finds it, so nothing falls between the two."""
    from hpcshard.slurm import cluster

    jobs = read_spec(up).jobs
    newest = jobs[-1] if jobs else after.job
    if newest == after.job:
        return
    try:
        cluster.depend(job, f"{after.kind}:{newest}")
    except ValueError as err:
        click.echo(f"warning: {up} went on as job {newest}, and job {job} still waits on job "
                   f"{after.job}: {err}; `scontrol update JobId={job} Dependency={after.kind}:{newest}` "
                   "moves it", err=True)


def resumed(run_dir: Path, job: str) -> None:
    """`resume` carried the run on as job `job`: what still waits for the run waits for
    it (as a continuation moves it, `launch.then.carry`). A run `--after` it with afterok
    on a job that stopped without finishing would otherwise wait for ever
    (DependencyNeverSatisfied); one that started or ended meanwhile has nothing to move."""
    from hpcshard.launch.then import move

    for follower, err in move(run_dir, job):
        if follower.get("run"):  # (a `--then` job has long started: nothing to say)
            click.echo(f"note: {follower['run']} (job {follower['job']}) was not moved onto job "
                       f"{job}: {err}", err=True)


def run_here(run_dir: Path, code: int) -> int:
    """The local backend: the run has ended here; its `--then` steps run now."""
    from hpcshard.launch.then import run_step

    for i in range(len(Chain.read(run_dir).then)):
        code = run_step(run_dir, i, slurm=False) or code
    return code


def lines(run_dir: Path) -> list[str]:
    """What `status RUN` shows of its chain (one squeue/sacct for every job named)."""
    chain = Chain.read(run_dir)
    jobs = [j for j in ([chain.after.job] if chain.after else []) if j]
    jobs += [t.jobs[-1] for t in chain.then if t.jobs] + [f["job"] for f in chain.followers if f.get("run")]
    if not jobs:
        return status_lines(chain, {})
    from hpcshard.cli.common import job_states

    return status_lines(chain, job_states(sorted(set(jobs))))
