"""The `hpcshard` command. Runs on login nodes and laptops: click, jinja2 and the stdlib
only, never torch at import (a test enforces it), so `hpcshard --help` is instant."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click

from hpcshard import __version__
from hpcshard.config import parse_sets
from hpcshard.runs import (
    RunSpec,
    check_run_dir,
    create_run_dir,
    default_run_dir,
    job_ref,
    last_record,
    preflight,
)

BACKENDS = ("auto", "local")


class UserError(click.ClickException):
    """Bad input: one line, exit code 2, nothing started."""

    exit_code = 2


def fail(err: Exception) -> NoReturn:
    raise UserError(str(err)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcshard")
def main() -> None:
    """Train FSDP2/HSDP jobs on many GPU nodes, and keep them alive there."""


def pick_backend(backend: str) -> str:
    """`auto` is the local backend until a Slurm backend is configured."""
    return "local" if backend == "auto" else backend


@main.command()
@click.argument("job")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes (emulated nodes under the local backend).")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs per node: one rank each (CPU processes when there is no GPU).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="local: N emulated nodes on this machine.")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="Where the run writes config, logs and metrics [default: runs/JOB-TIME].")
@click.option("--name", help="Run name [default: the job's name].")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a config field of the job (repeatable), e.g. --set steps=100.")
def submit(job: str, nodes: int, gpus: int, backend: str, run_dir: Path | None,
           name: str | None, sets: tuple[str, ...]) -> None:
    """Run JOB (a job file or module) on NODES x GPUS ranks."""
    try:
        ref = job_ref(job)
        run_dir = run_dir or default_run_dir(job)
        check_run_dir(run_dir)
        spec = RunSpec(job=ref, sets=parse_sets(sets), nodes=nodes, gpus=gpus,
                       backend=pick_backend(backend), name=name or Path(job).stem)
        spec.resolved = preflight(spec)
    except ValueError as err:
        fail(err)
    except RuntimeError as err:
        click.echo(str(err), err=True)
        sys.exit(1)
    create_run_dir(run_dir)
    spec.write(run_dir)
    res = spec.resolved
    click.echo(f"run {spec.name}: {nodes} node(s) x {gpus} rank(s), sharding {res['sharding']}, "
               f"{res['blocks']} x {res['block']}, {res['params'] / 1e6:.2f}M params")
    click.echo(f"run directory: {run_dir}")
    from hpcshard.launch.local import run_local

    code = run_local(run_dir.resolve(), nodes, gpus)
    _report(run_dir, code)
    sys.exit(code)


def _report(run_dir: Path, code: int) -> None:
    train, test = last_record(run_dir, "loss"), last_record(run_dir, "eval_loss")
    if train:
        line = f"step {train['step']}: loss {train['loss']:.4f}"
        if test:
            line += f", eval loss {test['eval_loss']:.4f}"
        click.echo(line)
    click.echo(f"{'finished' if code == 0 else f'failed (exit {code})'}: "
               f"metrics in {run_dir / 'metrics.jsonl'}, logs in {run_dir / 'logs'}")


if __name__ == "__main__":
    main()
