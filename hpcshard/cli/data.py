"""`hpcshard data prepare`: a corpus (text files, JSONL, Parquet, a local Hugging Face
dataset) tokenized into shards of tokens with a manifest, here over --workers processes or
as a Slurm job array (--array N). The work is `hpcshard.runtime.prepare`'s, imported when
the command runs (it needs numpy and the tokenizer libraries; `--help` does not)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpcshard.cli.options import settings, slurm_options

if TYPE_CHECKING:
    from hpcshard.runtime.prepare import PrepareConfig
    from hpcshard.slurm.sbatch import SbatchRequest

SLURM_DIR = "slurm"
"""Under the output's work folder (.prepare): the array's submitit folder and task logs."""


@click.group()
def data() -> None:
    """Prepare training data: token shards from text."""


@data.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--tokenizer", required=True, type=click.Path(path_type=Path),
              help="A tokenizer.json, or a local directory with a tokenizer (save_pretrained's).")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path),
              help="Where the shards and manifest.json go: a new or empty directory (or this same "
              "request's, to resume).")
@click.option("--format", "fmt", default="auto", show_default=True,
              type=click.Choice(["auto", "text", "jsonl", "parquet", "hf"]),
              help="The source's format; auto: told by the file names (a saved dataset by its files).")
@click.option("--field", default="text", show_default=True,
              help="The JSONL key, Parquet column or dataset column with the text.")
@click.option("--pattern", default="*", show_default=True,
              help="Glob for the files of a SOURCE directory (**/*.txt: recursive).")
@click.option("--split", default="train", show_default=True, help="The split of a dataset with several.")
@click.option("--eos", default="auto", show_default=True,
              help="Token ending each document: auto (the tokenizer's, if it has one), none, or a token.")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=100_000_000, show_default=True,
              help="About how many tokens a shard holds (whole documents).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes tokenizing at once (per array task with --array).")
@click.option("--array", "tasks", type=click.IntRange(min=1),
              help="Run as a Slurm job array of this many tasks (the site's template and profile).")
@click.option("--render", is_flag=True,
              help="With --array: print the sbatch script; submit and write nothing.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="A progress bar on stderr.")
@slurm_options
def prepare(source: Path, tokenizer: Path, output: Path, fmt: str, field: str, pattern: str, split: str,
            eos: str, shard_tokens: int, workers: int, tasks: int | None, render: bool, progress: bool,
            profile: str | None, **opts: Any) -> None:
    """Tokenize SOURCE (a text file or directory of them, .jsonl, .parquet, or a local Hugging
    Face dataset) into OUTPUT/shard-NNNNN.bin/.idx and OUTPUT/manifest.json. Interrupted, the
    same command again finishes the shards that are missing."""
    from hpcshard.runtime.prepare import PrepareConfig
    from hpcshard.runtime.sources import SourceSpec

    cfg = PrepareConfig(source=SourceSpec(path=str(source), format=fmt, field=field, pattern=pattern,
                                          split=split),
                        tokenizer=str(tokenizer), output=str(output), eos=eos, shard_tokens=shard_tokens,
                        workers=workers, progress=progress)
    if render and not tasks:
        raise click.UsageError("--render prints the job array's script: give --array N too")
    if tasks:
        _array(cfg, tasks, render, profile, opts)
        return
    from hpcshard.runtime.prepare import prepare as run

    result = run(cfg)  # (a bad record: what this call made is removed there, under its lock)
    for note in result.notes:
        click.echo(note, err=True)
    click.echo(f"{output}: {result.documents:,} document(s), {result.tokens:,} token(s) in {result.shards} "
               f"shard(s) ({result.written} written, {result.skipped} already done) "
               f"in {result.seconds:.1f} s")


def array_request(cfg: PrepareConfig, tasks: int, profile: str | None, opts: dict[str, Any]) -> SbatchRequest:
    """The job array: `tasks` one-node tasks without GPUs, --workers CPUs each, on the
    site's template and profile (partition, account, time, environment, container)."""
    from hpcshard.runtime.prepare import STATE
    from hpcshard.slurm.sbatch import SbatchRequest

    res = settings(profile, opts)
    base = SbatchRequest.from_settings(res.values, res.template_dirs,
                                       job_name=f"prepare-{Path(cfg.output).name}", nodes=1, gpus=0,
                                       run_dir=Path(cfg.output) / STATE / SLURM_DIR)
    return replace(base, cpus_per_task=cfg.workers, array=f"0-{tasks - 1}")


def _array(cfg: PrepareConfig, tasks: int, render: bool, profile: str | None, opts: dict[str, Any]) -> None:
    """Plan here (bad input refused before anything is written), then submit one task per
    share of the shards (task i: shards i, i + N, ...); the last to finish writes the
    manifest. `--render`: the script only."""
    from hpcshard.runtime.prepare import check_again, make_state, save_plan, start, take_lock
    from hpcshard.slurm.submit import sbatch_text

    req = array_request(cfg, tasks, profile, opts)
    out = Path(cfg.output)
    text = sbatch_text(req, req.run_dir)  # the template's errors now, before anything is made
    source, _tok, request, bounds = start(cfg)
    shards = len(bounds) - 1
    if (out / "manifest.json").is_file() and not render:
        click.echo(f"{out}: already prepared ({shards} shard(s)); nothing to submit")
        return
    if render:
        click.echo(text, nl=False)
        return
    from hpcshard.runtime.prepare import run_task
    from hpcshard.slurm import cluster
    from hpcshard.slurm.submit import submit_array

    cluster.check_request(req)
    made = make_state(out)
    lock = take_lock(out)  # the plan saved as `prepare` saves it: no run writing here meanwhile
    try:
        bounds = check_again(out, request, bounds)  # a run that started here while this one planned
        shards = len(bounds) - 1
        save_plan(out, request, bounds, source)
        for i in range(tasks):  # sbatch opens each task's log; it makes no folder for it
            (req.run_dir / f"task-{i}" / "logs").mkdir(parents=True, exist_ok=True)
        try:
            ids = submit_array(req, req.run_dir, run_task, [(str(out.resolve()), i, tasks, cfg.workers)
                                                             for i in range(tasks)])
        except ValueError:  # not submitted: nothing kept of a directory this call made
            if made:
                shutil.rmtree(out, ignore_errors=True)
            raise
    finally:
        lock.close()
    click.echo(f"submitted job array {ids[0].split('_')[0]} (0-{tasks - 1}): {shards} shard(s) of "
               f"{source.count():,} document(s), task i writes shards i, i+{tasks}, ...")
    click.echo(f"logs: {req.run_dir}/task-N/logs; done when {out / 'manifest.json'} exists "
               "(a task that failed: the same command again, or here without --array)")
