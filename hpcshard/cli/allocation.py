"""`hpcshard run`: a run inside an allocation you already hold (`salloc -N 2
--gres=gpu:4`, then `hpcshard run JOB` in its shell). The request is `submit`'s (one
builder, `cli.request`), on the `allocation` backend: the run is a step of the
allocation (`launch.allocation`), run here until it ends, with the same launchers,
supervision and checkpoints as a batch job's, and a normal run directory (`status`,
`logs`, `plot`, `resume`). A stop is not requeued: the command says how to go on."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from hpcshard.cli import request
from hpcshard.cli.options import (
    NAME,
    PROFILE,
    RESUME,
    RUN_DIR,
    SETS,
    script_options,
    setting_option,
    settings,
    shape_options,
    spare_options,
)
from hpcshard.launch import backends
from hpcshard.launch.allocation import held, shape
from hpcshard.rundir.spec import create_run_dir


@click.command()
@click.argument("job", required=False)
@script_options
@shape_options()
@spare_options
@RUN_DIR
@NAME
@setting_option("max_restarts")
@setting_option("code")
@PROFILE
@RESUME
@SETS
def run(job: str | None, nodes: int | None, run_dir: Path | None, name: str | None, resume: str,
        sets: tuple[str, ...], profile: str | None, module: str | None, args: tuple[str, ...],
        **opts: Any) -> None:
    """Run JOB (or a script: `run train.py -- ARGS`) on the nodes of the allocation this
    shell holds, as one srun step: no new job. NODES defaults to every node of the
    allocation (less --spares), GPUS to its GPUs per node. Ctrl-C stops at the next step
    boundary with a checkpoint (twice: now); `hpcshard resume RUN` in an allocation goes on."""
    alloc = held()  # first: outside an allocation nothing is read, made or asked
    res = settings(profile, opts)
    nodes, gpus = shape(alloc, nodes, res.values["spares"], opts.get("gpus"))
    if opts.get("gpus") is None and gpus is not None:  # the allocation's, over the profile's
        res = settings(profile, {**opts, "gpus": gpus})
    req = request.new(res, job, module=module, args=args, nodes=nodes, backend=backends.ALLOCATION,
                      run_dir=run_dir, name=name, resume=resume, sets=sets)
    request.check([req])  # (the shape against the allocation again: the profile's GPUs)
    create_run_dir(req.run_dir, req.spec.run_group)
    claim = request.take_run(req.run_dir, "hpcshard run")
    sys.exit(request.schedule(req, claim))
