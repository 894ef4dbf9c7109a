"""What the command modules share: finding a run, following a log,
tables (login node: click and the stdlib)."""

from __future__ import annotations

import codecs
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpcshard.rundir.spec import RunSpec, read_spec

if TYPE_CHECKING:
    from hpcshard.slurm.cluster import JobInfo
    from hpcshard.slurm.poll import Backoff


def run_dir_of(target: str) -> Path:
    """A run directory as given, or the one a Slurm job id (ARRAY_TASK for a sweep's
    task) writes its log into."""
    path = Path(target)
    if path.is_dir() or not re.fullmatch(r"\d+(_\d+)?", target):
        return path
    from hpcshard.slurm import cluster

    info = cluster.job_state(target)
    if info is not None and info.stdout:
        run = Path(info.stdout).parent.parent  # RUN_DIR/logs/slurm-%j.out
        # (a split sweep's later array: SWEEP/.array-K/task-I, a link to the sweep's task)
        return Path(os.path.normpath(run.parent / os.readlink(run))) if run.is_symlink() else run
    submitted = cluster.submitted_from(target)  # forgotten by scontrol: accounting's
    if submitted is None:
        raise ValueError(f"Slurm does not know job {target}; give the run directory instead")
    if "_" not in target:
        return submitted
    from hpcshard.rundir.sweep import Sweep, is_sweep

    task = Sweep.read(submitted).task_of(target) if is_sweep(submitted) else None
    return submitted / f"task-{target.partition('_')[2] if task is None else task}"


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
    """Each job's state in at most two calls, whatever their number: accounting's (the
    newest run of each, an array's pending tasks included) where the cluster keeps it, then
    one squeue for the jobs it does not have (no accounting, or not recorded yet);
    "unknown" where neither knows it (or Slurm does not answer)."""
    if not jobs:
        return {}
    from hpcshard.slurm import cluster, poll

    runs = cluster.history(jobs, since=since)
    found = {r.job: r.state for r in runs or []}
    rest = [job for job in jobs if not found.get(job)]
    queued = poll.queue_states(rest) or {}
    return {job: found.get(job) or _state_text(queued.get(job)) for job in jobs}


def _state_text(info: JobInfo | None) -> str:
    return info.state_text if info is not None else "unknown"


def poll_backoff(profile: str | None = None) -> Backoff:
    """The site's polling interval (`poll_s`, doubling up to `poll_max_s` while nothing
    changes) for a command that follows Slurm jobs."""
    from hpcshard import site
    from hpcshard.slurm.poll import Backoff

    layers = site.load()
    try:
        values = site.resolve(layers, profile or None).values
    except ValueError:  # the run's profile is gone from the files: the site's defaults
        values = site.resolve(layers).values
    return Backoff(values["poll_s"], values["poll_max_s"])


Ask = Callable[[], "tuple[bool | None, str]"]
"""A follower's question to Slurm: (over? None: no answer, what it said of the job)."""


def follow_log(log: Path, ask: Ask, backoff: Backoff | None = None, interval: float = 1.0,
               ended: Callable[[], bool] | None = None, grace: float = 0.0) -> None:
    """Print `log` as it grows (read every `interval`) until `ask()` says the job is over
    (then print what is left); None (not known: Slurm did not answer) is asked again.
    Slurm is asked once per `backoff` wait (every `interval` without one), the wait
    doubling while its answer stays the same. `ended()`, asked every `interval` (it reads
    files, not Slurm): the run has ended; Slurm is then asked every `interval` for up to
    `grace` seconds (the job's own end follows within seconds), and the follow ends
    then, whatever it says (a job held by a lost node ends much later). Read as bytes and
    decoded across reads: a read that ends inside a character finishes it with the next;
    a byte that is not UTF-8 is shown as U+FFFD, not an error."""
    pos = 0
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    said: str | None = None
    due = time.monotonic()
    over: bool | None = False
    ended_at: float | None = None
    while True:
        if ended_at is None and ended is not None and ended():
            ended_at = due = time.monotonic()
        if time.monotonic() >= due:
            over, now = ask()
            wait = interval if ended_at is not None or backoff is None else backoff.next(now != said)
            said, due = now, time.monotonic() + wait
        last = bool(over) or (ended_at is not None and time.monotonic() - ended_at >= grace)
        if log.exists():
            with log.open("rb") as f:
                f.seek(pos)
                chunk = decode(f.read(), final=last)
                pos = f.tell()
            if chunk:
                click.echo(chunk, nl=False)
        if last:
            return
        time.sleep(min(interval, max(0.05, due - time.monotonic())))


class FiniteFloat(click.FloatRange):
    """click's FloatRange, without nan and inf (a range check lets nan through: every
    comparison with it is false)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = float(super().convert(value, param, ctx))
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number
