"""`hpcshard profile`: ask a live run for a torch.profiler trace (and a CUDA memory
snapshot) of its next steps (login node: click and the stdlib; how the ranks take the ask:
`runtime.profile`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from hpcshard.cli.common import spec_of
from hpcshard.config import profile_ranks
from hpcshard.errors import UserError
from hpcshard.launch import backends
from hpcshard.rundir import profiles
from hpcshard.rundir.metrics import read_metrics
from hpcshard.rundir.spec import RunSpec

POLL_S = 0.5
OVER_EVERY_S = 10.0
"""How often the wait asks the scheduler whether the run still runs."""


class Unanswered(click.ClickException):
    """The run did not record the profile (it ended, or the wait ran out): exit 1."""


def _started(run_dir: Path) -> dict[str, Any]:
    """The newest start's record in the run's metrics ({}: none yet)."""
    starts = [r for r in read_metrics(run_dir) if r.get("event") == "start"]
    return starts[-1] if starts else {}


def _check(run_dir: Path, spec: RunSpec, ranks: tuple[int, ...] | None, memory: bool) -> None:
    if spec.script:
        raise UserError(f"{run_dir} runs a script, whose loop is its own: profile it with torch.profiler "
                        "in the script; hpcshard profile is for hpcshard jobs")
    started = _started(run_dir)
    world = int(started.get("world") or spec.nodes * spec.gpus)  # (fewer after a node loss)
    beyond = [r for r in ranks or () if r >= world]
    if beyond:
        raise UserError(f"rank {beyond[0]} is not a rank of {run_dir}: it has ranks 0-{world - 1}"
                        + (" now" if world != spec.nodes * spec.gpus else "") + "; choose --ranks among them")
    if memory and started.get("device") == "cpu":
        raise UserError(f"--memory records CUDA's allocator, and the ranks of {run_dir} train on CPU (no "
                        "CUDA device); drop --memory (the trace records CPU allocations itself)")


@click.command()
@click.argument("target")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Steps to record, from the next step boundary.")
@click.option("--ranks", "ranks_text", default="0", show_default=True,
              help="The ranks that record: comma-separated numbers (0,7), or all.")
@click.option("--memory", is_flag=True,
              help="Also a CUDA memory snapshot of those steps (allocations with stacks; where the "
                   "ranks have CUDA).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait for the traces and print where they are.")
@click.option("--timeout", type=click.FloatRange(min=0), default=900.0, show_default=True,
              help="Seconds to wait for the traces.")
def profile(target: str, steps: int, ranks_text: str, memory: bool, wait: bool, timeout: float) -> None:
    """Record a torch.profiler trace of the next steps of a running run (RUN_DIR or a Slurm
    JOB id), without a restart: the ranks take the ask at a step boundary.

    Traces go to RUN_DIR/profiles/step-S/rank-R.pt.trace.json: open them at
    ui.perfetto.dev or chrome://tracing, or `tensorboard --logdir RUN_DIR/profiles`.
    """
    run_dir, spec = spec_of(target)
    ranks = profile_ranks(ranks_text)
    _check(run_dir, spec, ranks, memory)
    backend = backends.reaching(spec)
    if backend.over(spec, run_dir) is True:
        raise UserError(f"{run_dir} is not running: nothing to profile (profile_every=N records "
                        "profiles on a schedule from its next start)")
    ask = profiles.put(run_dir, steps, ranks, memory)
    who = "every rank" if ranks is None else f"rank(s) {','.join(map(str, ranks))}"
    click.echo(f"asked {run_dir} for a profile of {steps} step(s) on {who}"
               + (" with a memory snapshot" if memory else "") + f" (ask {ask.id})")
    if not wait:
        click.echo(f"the traces will be in {profiles.asks_dir(run_dir).parent}/step-S/ "
                   "(hpcshard status shows the newest)")
        return
    _wait(run_dir, spec, backend, ask.id, timeout)


def _wait(run_dir: Path, spec: RunSpec, backend: backends.Backend, number: int, timeout: float) -> None:
    deadline, checked = time.monotonic() + timeout, time.monotonic()
    said: tuple[Any, ...] | None = None
    while time.monotonic() < deadline:
        taken = profiles.taken(run_dir, number)  # (again each time: a later start may take it anew)
        if taken is not None:
            if (taken["step"], taken.get("start")) != said:
                said = (taken["step"], taken.get("start"))
                click.echo(f"recording from step {taken['step']} on rank(s) "
                           f"{','.join(map(str, taken['ranks'])) or 'none'}"
                           + (f" (not {','.join(map(str, taken['dropped']))}: the run has fewer ranks now)"
                              if taken.get("dropped") else ""))
            if not taken["ranks"]:
                raise Unanswered(f"{run_dir} has none of the asked ranks now; ask again with --ranks "
                                 "among its ranks (hpcshard status)")
            window = profiles.window_dir(run_dir, int(taken["step"]))
            written = {r: profiles.done(window, r) for r in taken["ranks"]}
            if all(written.values()):
                for rank, w in sorted(written.items()):
                    assert w is not None
                    cut = " (cut short: the run stopped)" if w.get("partial") else ""
                    click.echo(f"rank {rank} trace: {w['trace']}{cut}" if "trace" in w
                               else f"rank {rank}: no trace ({w.get('error')})")
                    if "memory" in w:
                        click.echo(f"rank {rank} memory: {w['memory']}")
                click.echo("open the traces at ui.perfetto.dev or chrome://tracing, or "
                           f"tensorboard --logdir {window.parent}")
                return
        if time.monotonic() - checked >= OVER_EVERY_S:
            checked = time.monotonic()
            if backend.over(spec, run_dir) is True:
                taken = profiles.taken(run_dir, number)
                if taken is None or not profiles.complete(run_dir, taken):
                    raise Unanswered(f"{run_dir} ended before it recorded ask {number}; its next start "
                                     "(a requeue or hpcshard resume) records it")
        time.sleep(POLL_S)
    raise Unanswered(f"no profile from {run_dir} within {timeout:g} s ("
                     + ("the ranks have not taken it yet: rank 0 looks every few seconds, at a step "
                        "boundary, and an ask waits behind a window being recorded; on NFS a new file "
                        "may take up to a minute to be seen" if said is None
                        else "the ranks took it and are still recording or writing") + ")")
