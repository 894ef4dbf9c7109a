"""`hpcshard ckpt`: list a run's checkpoints, export one as a full state dict (torch only
inside `export`, which reads the shards in this process)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from hpcshard.errors import UserError
from hpcshard.rundir import store
from hpcshard.rundir.spec import read_spec


@click.group()
def ckpt() -> None:
    """Inspect and export checkpoints."""


@ckpt.command("list")
@click.argument("run_dir", type=click.Path(path_type=Path))
def ckpt_list(run_dir: Path) -> None:
    """Every checkpoint of RUN_DIR: step, status, size, world, age; also what interrupted
    saves and deletions left behind, and quarantined checkpoints (`.tmp`, `.deleting.tmp`,
    `.corrupt` directories: they take room, and are never loaded)."""
    read_spec(run_dir)
    root = run_dir / store.CHECKPOINTS
    entries = sorted([*store.scan(root), *store.leftovers(root)], key=lambda c: (c.step, c.path.name))
    if not entries:
        click.echo(f"no checkpoints in {root}")
        return
    click.echo(f"{'step':>8}  {'status':<10} {'size':>10}  {'world':>5}  {'mesh':<8} {'age':>5}  reason")
    for c in entries:
        m = c.manifest
        click.echo(f"{c.step:>8}  {_status(c):<10} {_size(c) / 1e6:>8.1f}MB  {m.get('world', '-'):>5}  "
                   f"{str(m.get('mesh', '-')):<8} {store.age(m['time']) if 'time' in m else '-':>5}  "
                   f"{m.get('reason', c.problem)}" + ("" if c.path.name == store.step_name(c.step)
                                                      else f" [{c.path.name}]"))


def _status(c: store.Checkpoint) -> str:
    if c.committed:
        return "committed"
    name = c.path.name
    return ("deleting" if name.endswith(store.DELETING) else "corrupt" if name.endswith(store.CORRUPT)
            else "invalid")


def _size(c: store.Checkpoint) -> int:
    """The manifest's bytes, or what the directory holds now (an entry without a manifest)."""
    if c.bytes:
        return c.bytes
    try:
        return sum(p.stat().st_size for p in c.path.iterdir() if p.is_file())
    except OSError:  # being deleted as we look
        return 0


@ckpt.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step [default: newest].")
@click.option("--out", type=click.Path(path_type=Path),
              help="File to write: .safetensors, or .pt/.pth/.bin for torch.save (small models).")
@click.option("--hf", "hf_dir", type=click.Path(path_type=Path),
              help="Directory to write for Hugging Face's from_pretrained: config.json, the run's "
                   "tokenizer, sharded safetensors with an index (streamed file by file).")
@click.option("--adapter", "adapter_dir", type=click.Path(path_type=Path),
              help="Directory to write a LoRA run's adapter to, in PEFT's format "
                   "(PeftModel.from_pretrained on the init_from model).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="With --hf or --adapter: the weights' dtype [default: init_from's, else fp32].")
@click.option("--shard-size", default="5GB", show_default=True,
              help="With --hf: the largest safetensors file.")
def ckpt_export(run_dir: Path, step: int | None, out: Path | None, hf_dir: Path | None,
                adapter_dir: Path | None, dtype: str | None, shard_size: str) -> None:
    """Write full, unsharded weights from a checkpoint of RUN_DIR: one file (--out), a
    Hugging Face model directory (--hf; LoRA adapters merged in), or a LoRA run's adapter
    in PEFT's format (--adapter)."""
    read_spec(run_dir)
    if sum(x is not None for x in (out, hf_dir, adapter_dir)) != 1:
        raise UserError("give one of --out FILE, --hf DIR or --adapter DIR")
    if dtype and out is not None:
        raise UserError("--dtype goes with --hf or --adapter; --out writes the weights in fp32")
    if shard_size != "5GB" and hf_dir is None:
        raise UserError("--shard-size goes with --hf")
    needs = {"--out": "safetensors", "--hf": "transformers", "--adapter": "peft"}
    flag = "--out" if out is not None else "--hf" if hf_dir is not None else "--adapter"
    if (flag != "--out" or out.suffix == ".safetensors") and importlib.util.find_spec(needs[flag]) is None:  # type: ignore[union-attr]
        raise UserError(f"{flag}: needs the {needs[flag]} package (pip install 'hpcshard[hf]')"
                        + ("; or export to a .pt file" if flag == "--out" else ""))
    from hpcshard.runtime.export import export, export_adapter, export_hf  # torch: only here

    if adapter_dir is not None:
        ckpt = export_adapter(run_dir, step, adapter_dir, dtype or "")
        click.echo(f"wrote {adapter_dir} (PEFT adapter) from {ckpt.path} (step {ckpt.step})")
        return
    if hf_dir is not None:
        with click.progressbar(length=1, label="writing", file=None) as bar:
            def done(i: int, n: int) -> None:
                bar.length = n
                bar.update(1)
            ckpt, files = export_hf(run_dir, step, hf_dir, dtype or "", shard_size, done)
        click.echo(f"wrote {hf_dir} ({files} safetensors file(s)) from {ckpt.path} (step {ckpt.step})")
        return
    assert out is not None
    ckpt = export(run_dir, step, out)
    click.echo(f"wrote {out} from {ckpt.path} (step {ckpt.step})")
