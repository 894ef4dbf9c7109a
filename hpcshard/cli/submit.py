"""`hpcshard submit`, `render` and `resume`: each builds its request with `cli.request`
(the builder `sweep` shares), checks it, and, but for `render`, schedules it (submitit on
Slurm, the local launcher otherwise). The job itself is checked in a subprocess
(`runtime.preflight`): this process never imports torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from hpcshard.cli import chain, request
from hpcshard.cli.options import (
    NAME,
    RESUME,
    RUN_DIR,
    SETS,
    script_options,
    setting_option,
    settings,
    shape_options,
    slurm_options,
    spare_options,
)
from hpcshard.errors import UserError
from hpcshard.launch import backends
from hpcshard.rundir import lease
from hpcshard.rundir.spec import RunSpec, create_run_dir, read_spec


@click.command()
@click.argument("job", required=False)
@script_options
@shape_options()
@spare_options
@setting_option("backend")
@RUN_DIR
@NAME
@setting_option("max_requeues")
@setting_option("max_restarts")
@setting_option("code")
@click.option("--follow", is_flag=True, help="Slurm: show rank 0's log until the run or its job ends.")
@slurm_options
@chain.chain_options
@RESUME
@SETS
def submit(job: str | None, nodes: int | None, run_dir: Path | None, name: str | None,
           follow: bool, resume: str, sets: tuple[str, ...], profile: str | None,
           module: str | None, args: tuple[str, ...], after: str | None, then: tuple[str, ...],
           **opts: Any) -> None:
    """Run JOB (an hpcshard job file or module) on NODES x GPUS ranks, or any torchrun
    script as it is: `submit train.py -- ARGS`, `submit -m package.module -- ARGS`.
    `--after RUN_OR_JOB` queues it behind another run; `--then export-hf=DIR` exports it
    once it has ended done, `--then eval` evaluates it."""
    res = settings(profile, opts)
    req = request.new(res, job, module=module, args=args, nodes=nodes or 1, backend=res.values["backend"],
                      run_dir=run_dir, name=name, resume=resume, sets=sets)
    waits, steps = chain.plan(after, then, req.sbatch is not None)
    if req.sbatch is not None and waits is not None and waits.job:
        req.sbatch.dependency = f"{waits.kind}:{waits.job}"
    request.check([req])
    create_run_dir(req.run_dir, req.spec.run_group)
    # Two commands given one new --run-dir at once both found it empty: one gets the run.
    claim = request.take_run(req.run_dir, "hpcshard submit")
    chain.record(req.run_dir, waits, steps)
    code = request.schedule(req, claim, follow=follow,
                            submitted=lambda job_id: chain.submitted(req.run_dir, waits, job_id))
    sys.exit(chain.run_here(req.run_dir, code) if req.sbatch is None and steps and code == 0 else code)


@click.command("render")
@click.argument("job", required=False)
@script_options
@shape_options()
@spare_options
@RUN_DIR
@NAME
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

    req = request.new(settings(profile, opts), job, module=module, args=args, nodes=nodes or 1,
                      backend=backends.SLURM, run_dir=run_dir, name=name, sets=sets)
    request.check([req], cluster=False, job=check)
    assert req.sbatch is not None
    click.echo(sbatch_text(req.sbatch, req.run_dir.resolve()), nl=False)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@shape_options()
@click.option("--spares", type=click.IntRange(min=0), help="Spare nodes [default: the run's].")
@click.option("--min-nodes", type=click.IntRange(min=0),
              help="Fewest nodes to go on with after a loss [default: the run's].")
@click.option("--code", type=click.Choice(["snapshot", "current", "live"]), default="snapshot",
              show_default=True, help="The run's copy of its code (snapshot), a new copy of the job's "
              "source as it is now (current), or no copy: each start imports the source (live).")
@RESUME
@SETS
def resume(run_dir: Path, nodes: int | None, gpus: int | None, spares: int | None,
           min_nodes: int | None, code: str, resume: str, sets: tuple[str, ...]) -> None:
    """Continue the run in RUN_DIR from its newest checkpoint, on any shape."""
    read_spec(run_dir)  # (a directory that holds no run gets no lease)
    # The run is this command's from here: a job or command that owns it refuses this, and
    # nothing takes it over while the preflight runs (seconds).
    claim = request.take_run(run_dir, "hpcshard resume")
    try:
        spec = read_spec(run_dir)  # read again, now that this command owns the run
        request.check_secrets_again(spec)  # before Slurm is asked anything
        _check_over(spec, run_dir)
        req = request.again(spec, run_dir, nodes=nodes, gpus=gpus, spares=spares, min_nodes=min_nodes,
                            sets=sets, resume=resume, code=code,
                            code_max_mb=settings(spec.profile or None, {}).values["code_max_mb"]
                            if code == "current" else 0)
        request.check([req])
    except BaseException:  # the run is given back to whoever had it (a killed CLI's launchers)
        lease.release(run_dir, claim, restore=True)
        raise
    moved = (lambda job: chain.resumed(run_dir, job)) if req.sbatch is not None else None
    sys.exit(request.schedule(req, claim, submitted=moved))


def _check_over(spec: RunSpec, run_dir: Path) -> None:
    """Nothing of the run may still run: resume would start a second one beside it."""
    over = backends.reaching(spec).over(spec, run_dir)
    if over is None:
        raise UserError(f"Slurm did not answer whether job {spec.jobs[-1]} of {run_dir} is still "
                         "running, so nothing was submitted; try again once `scontrol ping` answers")
    if not over:
        raise UserError(f"{run_dir} is still running; stop it first (hpcshard preempt "
                         f"{run_dir} saves and stops; hpcshard cancel stops now)")
