"""`hpcshard logs`: a run's rank logs as one stream, across attempts, restarts, requeues and
continuation jobs (login node: click and the stdlib; the stream is `rundir.runlogs`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import click

from hpcshard.cli.common import poll_backoff, spec_of
from hpcshard.errors import UserError
from hpcshard.launch import backends
from hpcshard.rundir import ledger
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.runlogs import Filter, RunLogs, Stream, rank_of, started
from hpcshard.rundir.spec import RunSpec, read_spec
from hpcshard.rundir.status import culprit_lines

POLL_S = (0.5, 5.0)
"""Following: the first and the longest wait between two looks; each look that finds
nothing new doubles the wait, new lines bring it back to the first."""


@click.command()
@click.argument("target")
@click.option("--rank", "ranks", type=click.IntRange(min=0), multiple=True,
              help="Only this rank's lines (repeat for several) [default: every rank].")
@click.option("--node", help="Only the ranks that ran on this node (a host name, or a node number "
              "in the attempt), attempt by attempt.")
@click.option("--attempt", type=click.IntRange(min=0), help="Only this attempt (its restarts too).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends: later attempts "
              "(requeues, continuation jobs, restarts) continue the stream under their headers.")
@click.option("--culprit", is_flag=True, help="The log of the rank named by the newest fault "
              "(`hpcshard status` lists them), its last lines (with --lines).")
@click.option("--lines", "--tail", "tail", type=click.IntRange(min=1),
              help="Only the last N lines (with -f: then follow).")
def logs(target: str, ranks: tuple[int, ...], node: str | None, attempt: int | None, follow: bool,
         culprit: bool, tail: int | None) -> None:
    """The rank logs of a run (RUN_DIR or Slurm JOB id) as one stream: every attempt and
    restart under a header line, the ranks' lines merged by time within each."""
    run_dir, spec = spec_of(target)
    if culprit:
        header, last = culprit_lines(run_dir, tail or 40)
        click.echo(header)
        click.echo("\n".join(last))
        return
    paths = RunPaths(run_dir)
    _check_ranks(paths, spec, ranks, follow)
    reader = RunLogs(paths.logs, Filter(frozenset(ranks) if ranks else None, node, attempt))
    stream = Stream(several=len(ranks) != 1 and _world(paths, spec, follow) > 1)
    lines = reader.read(final=not follow)
    if not follow and not reader.ranks:
        raise UserError(f"no rank has logged in {paths.logs} yet (-f waits for them)")
    _check_filters(run_dir, spec, reader, node, attempt, follow)
    lines = lines[-tail:] if tail else lines
    _echo(stream.render(lines, reader.starts, started(ledger.read(run_dir))))
    if follow:
        _follow(reader, stream, run_dir, _over(run_dir))


def _follow(reader: RunLogs, stream: Stream, run_dir: Path, over: Callable[[], bool | None]) -> None:
    """Print what the logs gain until the run is over, then what is left. The ledger is read
    only for a piece's header; a backend that does not answer (None) is asked again."""
    wait = POLL_S[0]
    while True:
        done = over() is True
        lines = reader.read(final=done)
        if lines:
            known = {p for p in (line.piece for line in lines) if p is not None}
            records = started(ledger.read(run_dir)) if known - {stream.shown} else {}
            _echo(stream.render(lines, reader.starts, records))
        if done:
            return
        wait = POLL_S[0] if lines else wait
        time.sleep(wait)
        wait = min(wait * 2, POLL_S[1])


def _over(run_dir: Path) -> Callable[[], bool | None]:
    """Is the run over for good? Its backend's word (`Backend.ended`), with the spec read
    again each time: a continuation job joins the run's jobs before the job it continues
    ends. A run in a queue is asked at the site's polling pace (`poll_s`, doubling up to
    `poll_max_s`: one Slurm call a poll), not at every look at the files; until then it is
    taken for not over."""
    spec = read_spec(run_dir)
    pace = poll_backoff(spec.profile) if backends.reaching(spec).asks_slurm else None
    asked, wait = [float("-inf")], [0.0]

    def over() -> bool | None:
        if pace is not None and time.monotonic() - asked[0] < wait[0]:
            return False
        asked[0] = time.monotonic()
        now = read_spec(run_dir)
        answer = backends.reaching(now).ended(now, run_dir)
        if pace is not None:
            wait[0] = pace.wait
            pace.next(False)
        return answer
    return over


def _echo(lines: list[str]) -> None:
    if lines:
        click.echo("\n".join(lines))


def _world(paths: RunPaths, spec: RunSpec, follow: bool) -> int:
    """How many ranks may show: the logs there, and while following every rank of the run."""
    there = [r for r in map(rank_of, paths.logs.glob("rank-*.log")) if r is not None]
    return max([len(there), spec.nodes * spec.gpus if follow else 0])


def _check_ranks(paths: RunPaths, spec: RunSpec, ranks: tuple[int, ...], follow: bool) -> None:
    """A rank with no log is bad input, unless it is a rank of the run and its log is
    followed (it may not have begun)."""
    there = sorted(r for r in map(rank_of, paths.logs.glob("rank-*.log")) if r is not None)
    world = spec.nodes * spec.gpus
    for rank in ranks:
        if rank not in there and not (follow and rank < world):
            names = ", ".join(f"rank-{r}" for r in there)
            raise UserError(f"no log for rank {rank} in {paths.logs}; there are: {names or 'none yet'}")


def _check_filters(run_dir: Path, spec: RunSpec, reader: RunLogs, node: str | None, attempt: int | None,
                   follow: bool) -> None:
    """A node or an attempt the run never had is bad input (while following, a node number
    or an attempt still to come may be asked for)."""
    if attempt is not None:
        had = sorted({a for a, _ in started(ledger.read(run_dir))} | {a for _, (a, _) in reader.starts})
        if attempt not in had and not (follow and attempt > max(had, default=-1)):
            raise UserError(f"{run_dir} has no attempt {attempt}; it had: "
                            f"{', '.join(map(str, had)) or 'none yet'}")
    if node is not None:
        seen = reader.nodes()
        if node not in seen and not (follow and node.isdigit() and int(node) < spec.nodes):
            raise UserError(f"no rank of {run_dir} ran on node {node!r}; its logs name: "
                            f"{', '.join(seen) or 'none (their start lines do not say)'}")
