"""The `hpcshard` command. Runs on login nodes and laptops: click, jinja2 and the stdlib
only, never torch at import (a test enforces it), so `hpcshard --help` is instant."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from hpcshard import __version__, checkpoints
from hpcshard.config import parse_sets, signal_names
from hpcshard.ledger import REQUEUE_EXIT
from hpcshard.runs import (
    RunSpec,
    check_resume,
    check_run_dir,
    create_run_dir,
    default_run_dir,
    job_ref,
    last_record,
    preflight,
    probe_writable,
    read_spec,
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


def _shape_options(default: int | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--gpus", type=click.IntRange(min=1), default=default,
                         show_default=default is not None,
                         help="GPUs per node: one rank each (CPU processes when there is no GPU).")(f)
        return click.option("--nodes", type=click.IntRange(min=1), default=default,
                            show_default=default is not None,
                            help="Nodes (emulated nodes under the local backend).")(f)
    return wrap


SETS = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                    help="Override a config field of the job (repeatable), e.g. --set steps=100.")
RESUME = click.option("--resume", "resume", default="auto", show_default=True,
                      metavar="auto|never|STEP|PATH",
                      help="Checkpoint to start from: the newest (auto), none, a step of this "
                      "run, or a checkpoint directory of another run.")


@main.command()
@click.argument("job")
@_shape_options(1)
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="local: N emulated nodes on this machine.")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="Where the run writes config, logs, metrics, checkpoints [default: runs/JOB-TIME].")
@click.option("--name", help="Run name [default: the job's name].")
@click.option("--max-requeues", type=click.IntRange(min=0), default=10, show_default=True,
              help="Restarts after stop requests (preemptions) before the run gives up.")
@RESUME
@SETS
def submit(job: str, nodes: int, gpus: int, backend: str, run_dir: Path | None,
           name: str | None, max_requeues: int, resume: str, sets: tuple[str, ...]) -> None:
    """Run JOB (a job file or module) on NODES x GPUS ranks."""
    try:
        ref = job_ref(job)
        run_dir = run_dir or default_run_dir(job)
        check_run_dir(run_dir)
        if resume not in ("auto", "never"):
            check_resume(run_dir, resume)
        spec = RunSpec(job=ref, sets=parse_sets(sets), nodes=nodes, gpus=gpus,
                       backend=pick_backend(backend), name=name or Path(job).stem,
                       max_requeues=max_requeues)
        spec.resolved = preflight(spec)
    except ValueError as err:
        fail(err)
    except RuntimeError as err:
        click.echo(str(err), err=True)
        sys.exit(1)
    create_run_dir(run_dir)
    _launch(spec, run_dir, resume)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_shape_options(None)
@RESUME
@SETS
def resume(run_dir: Path, nodes: int | None, gpus: int | None, resume: str,
           sets: tuple[str, ...]) -> None:
    """Continue the run in RUN_DIR from its newest checkpoint, on any shape."""
    try:
        spec = read_spec(run_dir)
        probe_writable(run_dir)
        check_resume(run_dir, resume)
        spec.nodes, spec.gpus = nodes or spec.nodes, gpus or spec.gpus
        spec.sets = {**spec.sets, **parse_sets(sets)}
        spec.resolved = preflight(spec)
    except ValueError as err:
        fail(err)
    except RuntimeError as err:
        click.echo(str(err), err=True)
        sys.exit(1)
    _launch(spec, run_dir, resume)


def _launch(spec: RunSpec, run_dir: Path, resume: str) -> NoReturn:
    spec.write(run_dir)
    res = spec.resolved
    click.echo(f"run {spec.name}: {spec.nodes} node(s) x {spec.gpus} rank(s), sharding "
               f"{res['sharding']}, {res['blocks']} x {res['block']}, {res['params'] / 1e6:.2f}M params")
    click.echo(f"run directory: {run_dir}")
    from hpcshard.launch.local import run_local

    def requeued(attempt: int, count: int) -> None:
        click.echo(f"stopped on request with a committed checkpoint: requeued as attempt "
                   f"{attempt} ({count}/{spec.max_requeues})")

    code = run_local(run_dir.resolve(), spec.nodes, spec.gpus, resume=resume,
                     max_requeues=spec.max_requeues, on_attempt=requeued)
    _report(run_dir, code)
    sys.exit(code)


def _report(run_dir: Path, code: int) -> None:
    train, test = last_record(run_dir, "loss"), last_record(run_dir, "eval_loss")
    if train:
        line = f"step {train['step']}: loss {train['loss']:.4f}"
        if test:
            line += f", eval loss {test['eval_loss']:.4f}"
        click.echo(line)
    if code == REQUEUE_EXIT:
        click.echo(f"stopped with a committed checkpoint; continue with: hpcshard resume {run_dir}")
        return
    click.echo(f"{'finished' if code == 0 else f'failed (exit {code})'}: "
               f"metrics in {run_dir / 'metrics.jsonl'}, logs in {run_dir / 'logs'}")


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--signal", "signame", default="USR2", show_default=True,
              help="The notice to send; the job's stop_signals decide what it listens to.")
def preempt(run_dir: Path, signame: str) -> None:
    """Send a preemption notice to the run in RUN_DIR (local backend), as Slurm would.

    The ranks agree to stop at the next step boundary, commit a checkpoint and exit;
    the launcher then requeues the run, which resumes where it stopped.
    """
    try:
        sig = getattr(signal, signal_names(signame)[0])
    except ValueError as err:
        fail(err)
    launchers = sorted((run_dir / "launch").glob("node-*.pid"))
    sent = 0
    for pid_path in launchers:
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(pid_path.read_text()), sig)
            sent += 1
    if not sent:
        fail(ValueError(f"no running launcher in {run_dir} (nothing to preempt); "
                        "is the run still going?"))
    click.echo(f"sent {sig.name} to {sent} node launcher(s) of {run_dir}")


@main.group()
def ckpt() -> None:
    """Inspect and export checkpoints."""


@ckpt.command("list")
@click.argument("run_dir", type=click.Path(path_type=Path))
def ckpt_list(run_dir: Path) -> None:
    """Every checkpoint of RUN_DIR: step, status, size, world, age."""
    entries = checkpoints.scan(run_dir / checkpoints.CHECKPOINTS)
    if not entries:
        click.echo(f"no checkpoints in {run_dir / checkpoints.CHECKPOINTS}")
        return
    click.echo(f"{'step':>8}  {'status':<10} {'size':>10}  {'world':>5}  {'mesh':<8} {'age':>5}  reason")
    for c in entries:
        m = c.manifest
        status = "committed" if c.committed else "invalid"
        click.echo(f"{c.step:>8}  {status:<10} {c.bytes / 1e6:>8.1f}MB  {m.get('world', '-'):>5}  "
                   f"{str(m.get('mesh', '-')):<8} {checkpoints.age(m['time']) if 'time' in m else '-':>5}  "
                   f"{m.get('reason', c.problem)}")


@ckpt.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step [default: newest].")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="File to write: .safetensors, or .pt/.pth/.bin for torch.save.")
def ckpt_export(run_dir: Path, step: int | None, out: Path) -> None:
    """Write a full, unsharded model state dict from a checkpoint of RUN_DIR."""
    from hpcshard.runtime.export import export  # torch: only for this command

    try:
        read_spec(run_dir)
        ckpt = export(run_dir, step, out)
    except ValueError as err:
        fail(err)
    click.echo(f"wrote {out} from {ckpt.path} (step {ckpt.step})")


if __name__ == "__main__":
    main()
