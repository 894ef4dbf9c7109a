"""What the command modules share: finding a run, following a log,
tables (login node: click and the stdlib)."""

from __future__ import annotations

import codecs
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpcshard.rundir.spec import RunSpec, read_spec

if TYPE_CHECKING:
    from hpcshard.slurm.cluster import JobInfo


def run_dir_of(target: str) -> Path:
    """A run directory as given, or the one a Slurm job id (ARRAY_TASK for a sweep's
    task) writes its log into."""
    path = Path(target)
    if path.is_dir() or not re.fullmatch(r"\d+(_\d+)?", target):
        return path
    from hpcshard.slurm import cluster

    info = cluster.job_state(target)
    if info is not None and info.stdout:
        return Path(info.stdout).parent.parent  # RUN_DIR/logs/slurm-%j.out
    submitted = cluster.submitted_from(target)  # forgotten by scontrol: accounting's
    if submitted is None:
        raise ValueError(f"Slurm does not know job {target}; give the run directory instead")
    task = target.partition("_")[2]
    return submitted / f"task-{task}" if task else submitted


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns as wide as their widest cell; the last column runs free."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    for row in [headers, *rows]:
        cells = [f"{str(c):<{w}}" for c, w in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, str(row[-1])]).rstrip())


def spec_of(target: str) -> tuple[Path, RunSpec]:
    """The run a command names (RUN_DIR or a Slurm job id), or a one-line error."""
    run_dir = run_dir_of(target)
    return run_dir, read_spec(run_dir)


def job_states(jobs: list[str], since: float | None = None) -> dict[str, str]:
    """Each job's state: from accounting in one call where the cluster keeps it (the
    newest run of each), else from scontrol, job by job; "unknown" where neither knows it
    (or Slurm does not answer)."""
    if not jobs:
        return {}
    from hpcshard.slurm import cluster

    runs = cluster.history(jobs, since=since)
    found = {r.job: r.state for r in runs or []}  # a pending array's tasks are one row: A_[2-3]
    return {job: found.get(job) or _state_text(cluster.job_state(job)) for job in jobs}


def _state_text(info: JobInfo | None) -> str:
    return info.state_text if info is not None else "unknown"


def follow_log(log: Path, done: Callable[[], bool | None], interval: float = 1.0) -> None:
    """Print `log` as it grows until `done()` is true (then print what is left); None (not
    known: Slurm did not answer) is asked again. Read as bytes and decoded across reads: a
    read that ends inside a character finishes it with the next; a byte that is not UTF-8
    is shown as U+FFFD, not an error."""
    pos = 0
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    while True:
        over = done()
        if log.exists():
            with log.open("rb") as f:
                f.seek(pos)
                chunk = decode(f.read(), final=bool(over))
                pos = f.tell()
            if chunk:
                click.echo(chunk, nl=False)
        if over:
            return
        time.sleep(interval)


class FiniteFloat(click.FloatRange):
    """click's FloatRange, without nan and inf (a range check lets nan through: every
    comparison with it is false)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = float(super().convert(value, param, ctx))
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number
