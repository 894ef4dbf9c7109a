"""Operating runs: status, logs, cancel, ls, plot, preempt, checkpoints (login node).

Registered on the `hpcshard` group by `hpcshard.cli`. Stdlib and click; Slurm through its
client commands; torch only inside `ckpt export`, matplotlib only inside `plot`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import click

from hpcshard import checkpoints
from hpcshard.cliutil import fail, run_dir_of
from hpcshard.config import signal_names
from hpcshard.runs import RunSpec, read_metrics, read_spec, train_records
from hpcshard.status import attempts, report

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _spec_of(target: str) -> tuple[Path, RunSpec]:
    try:
        run_dir = run_dir_of(target)
        return run_dir, read_spec(run_dir)
    except ValueError as err:
        fail(err)


def _slurm_state(spec: RunSpec) -> dict[str, str] | None:
    if spec.backend != "slurm" or not spec.jobs:
        return None
    from hpcshard import slurm

    return slurm.job_state(spec.jobs[-1])


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--signal", "signame",
              help="The notice to send [default: the run's (its profile's `signal`), else USR2].")
def preempt(run_dir: Path, signame: str | None) -> None:
    """Send a preemption notice to the run in RUN_DIR (local backend), as Slurm would.

    The ranks agree to stop at the next step boundary, commit a checkpoint and exit;
    the launcher then requeues the run, which resumes where it stopped.
    """
    try:
        spec = read_spec(run_dir)
        sig = getattr(signal, signal_names(signame or spec.slurm.get("signal", "USR2"))[0])
    except ValueError as err:
        fail(err)
    if spec.backend == "slurm" and spec.jobs:
        # The launchers run on compute nodes: their pids mean nothing here. Slurm delivers
        # the signal to every process of the job's steps, as its own notice does.
        _scancel(["--signal", sig.name.removeprefix("SIG"), spec.jobs[-1]])
        click.echo(f"sent {sig.name} to Slurm job {spec.jobs[-1]} ({run_dir})")
        return
    launchers = sorted((run_dir / "launch").glob("node-*.pid"))
    sent = 0
    for pid_path in launchers:
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError, FileNotFoundError):
            os.kill(int(pid_path.read_text()), sig)
            sent += 1
    if not sent:
        fail(ValueError(f"no running launcher in {run_dir} (nothing to preempt); "
                        "is the run still going?"))
    click.echo(f"sent {sig.name} to {sent} node launcher(s) of {run_dir}")


@click.command()
@click.argument("target")
def status(target: str) -> None:
    """Slurm state and training progress of a run (RUN_DIR, or a Slurm JOB id)."""
    run_dir, spec = _spec_of(target)
    for line in report(run_dir, asdict(spec), _slurm_state(spec)):
        click.echo(line)


@click.group()
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


def _scancel(args: list[str]) -> None:
    try:
        proc = subprocess.run(["scancel", *args], capture_output=True, text=True)
    except OSError as err:
        fail(ValueError(f"cannot run scancel ({err.strerror}); run this where Slurm's commands are"))
    if proc.returncode:
        fail(ValueError(f"scancel {' '.join(args)}: {proc.stderr.strip()}"))


def follow_log(log: Path, done: Callable[[], bool], interval: float = 1.0) -> None:
    """Print `log` as it grows until `done()` is true (then print what is left)."""
    pos = 0
    while True:
        finished = done()
        if log.exists():
            with log.open() as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            if chunk:
                click.echo(chunk, nl=False)
        if finished:
            return
        time.sleep(interval)


def finished(spec: RunSpec, run_dir: Path) -> bool:
    """Nothing of this run is running: its Slurm job is over, or no local launcher lives
    (a pid file left by a launcher killed with -9 does not count)."""
    state = _slurm_state(spec)
    if state is not None:
        return state.get("JobState", "") in FINAL_STATES or not state
    for pid_path in (run_dir / "launch").glob("node-*.pid"):
        try:
            os.kill(int(pid_path.read_text()), 0)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            continue
        except PermissionError:
            return False  # alive, someone else's
        return False
    return True


@click.command()
@click.argument("target")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends.")
def logs(target: str, rank: int, follow: bool) -> None:
    """Print a rank's log of a run (RUN_DIR or Slurm JOB id)."""
    run_dir, spec = _spec_of(target)
    log = run_dir / "logs" / f"rank-{rank}.log"
    if not log.exists() and not follow:
        ranks = sorted(p.stem for p in (run_dir / "logs").glob("rank-*.log"))
        fail(ValueError(f"no log for rank {rank} in {run_dir / 'logs'}; there are: "
                        f"{', '.join(ranks) or 'none yet'}"))
    follow_log(log, (lambda: True) if not follow else (lambda: finished(spec, run_dir)))


@click.command()
@click.argument("target")
def cancel(target: str) -> None:
    """Stop a run now, without a checkpoint (see `preempt` for a clean stop)."""
    run_dir, spec = _spec_of(target)
    if spec.backend == "slurm" and spec.jobs:
        _scancel([spec.jobs[-1]])
        click.echo(f"cancelled Slurm job {spec.jobs[-1]} ({run_dir})")
        return
    pids = sorted((run_dir / "launch").glob("node-*.pid"))
    for pid_path in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError, FileNotFoundError):
            os.kill(int(pid_path.read_text()), signal.SIGTERM)
    if not pids:
        fail(ValueError(f"no running launcher in {run_dir}; nothing to cancel"))
    click.echo(f"cancelled {len(pids)} node launcher(s) of {run_dir}")


@click.command("ls")
@click.argument("root", type=click.Path(path_type=Path), required=False)
@click.option("-n", "limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--profile", help="List the storage root of this profile [default: the configured one].")
def ls(root: Path | None, limit: int, profile: str | None) -> None:
    """Recent runs under ROOT (default: the profile's storage_root, else ./runs), newest first."""
    if root is None:
        from hpcshard import site

        try:
            root = site.storage_root(site.resolve(site.load(), profile))
        except ValueError as err:
            fail(err)
    runs = sorted((p.parent for p in root.glob("*/spec.json")), key=lambda p: p.stat().st_mtime,
                  reverse=True)[:limit]
    if not runs:
        click.echo(f"no runs under {root}")
        return
    click.echo(f"{'run':<32} {'backend':<7} {'shape':>5} {'step':>11} {'loss':>7} {'state':<9} age")
    for run_dir in runs:
        spec = RunSpec.read(run_dir)
        total = spec.resolved.get("config", {}).get("steps", "?")
        train = train_records(read_metrics(run_dir))
        rows = attempts(run_dir)
        state = rows[-1].reason if rows else "new"
        step = f"{train[-1]['step'] if train else 0}/{total}"
        loss = f"{train[-1]['loss']:.3f}" if train else "-"
        click.echo(f"{run_dir.name:<32} {spec.backend:<7} {f'{spec.nodes}x{spec.gpus}':>5} {step:>11} "
                   f"{loss:>7} {state:<9} {checkpoints.age(spec.created)}")


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="PNG to write [default: RUN_DIR/plot.png].")
def plot(run_dir: Path, out: Path | None) -> None:
    """Loss and tokens/s over steps, with attempt boundaries marked, as a PNG."""

    try:
        read_spec(run_dir)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ValueError as err:
        fail(err)
    except ImportError:
        fail(ValueError("plot needs matplotlib: pip install 'hpcshard[plot]'"))
    records = read_metrics(run_dir)
    train = train_records(records)
    if not train:
        fail(ValueError(f"{run_dir} has no training metrics yet"))
    evals = [r for r in records if r.get("eval_loss") is not None and "event" not in r]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax2.plot([r["step"] for r in train], [r.get("tokens_per_s") or 0 for r in train], color="tab:green")
    for a in attempts(run_dir)[1:]:  # where each requeued attempt picked up
        for ax in (ax1, ax2):
            ax.axvline(a.loaded or 0, color="tab:red", linestyle="--", linewidth=1)
        ax1.annotate(f"attempt {a.number}", (a.loaded or 0, ax1.get_ylim()[1]), fontsize=8,
                     color="tab:red", va="top")
    ax1.set_ylabel("loss (nats/token)")
    ax1.legend()
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax1.set_title(f"{run_dir.name}")
    fig.tight_layout()
    target = out or run_dir / "plot.png"
    fig.savefig(target, dpi=110)
    click.echo(f"wrote {target}")
