"""`hpcshard ckpt`: list a run's checkpoints, export one as a full state dict (torch only
inside `export`, which reads the shards in this process)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from hpcshard.cli.common import fail, read_run
from hpcshard.rundir import store


@click.group()
def ckpt() -> None:
    """Inspect and export checkpoints."""


@ckpt.command("list")
@click.argument("run_dir", type=click.Path(path_type=Path))
def ckpt_list(run_dir: Path) -> None:
    """Every checkpoint of RUN_DIR: step, status, size, world, age."""
    read_run(run_dir)
    entries = store.scan(run_dir / store.CHECKPOINTS)
    if not entries:
        click.echo(f"no checkpoints in {run_dir / store.CHECKPOINTS}")
        return
    click.echo(f"{'step':>8}  {'status':<10} {'size':>10}  {'world':>5}  {'mesh':<8} {'age':>5}  reason")
    for c in entries:
        m = c.manifest
        status = "committed" if c.committed else "invalid"
        click.echo(f"{c.step:>8}  {status:<10} {c.bytes / 1e6:>8.1f}MB  {m.get('world', '-'):>5}  "
                   f"{str(m.get('mesh', '-')):<8} {store.age(m['time']) if 'time' in m else '-':>5}  "
                   f"{m.get('reason', c.problem)}")


@ckpt.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step [default: newest].")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="File to write: .safetensors, or .pt/.pth/.bin for torch.save.")
def ckpt_export(run_dir: Path, step: int | None, out: Path) -> None:
    """Write a full, unsharded model state dict from a checkpoint of RUN_DIR."""
    read_run(run_dir)
    if out.suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        fail(ValueError(f"--out {str(out)!r}: writing .safetensors needs the safetensors package "
                        "(pip install 'hpcshard[hf]' or pip install safetensors); or export to a .pt file"))
    from hpcshard.runtime.export import export  # torch: only for this command

    try:
        ckpt = export(run_dir, step, out)
    except ValueError as err:
        fail(err)
    click.echo(f"wrote {out} from {ckpt.path} (step {ckpt.step})")
