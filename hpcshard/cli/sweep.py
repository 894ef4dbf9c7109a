"""`hpcshard sweep`: one job, many configurations. On Slurm one job array (task i runs
configuration i in its own run directory and is preempted and requeued by itself; past
what the cluster's arrays take, several arrays that are one sweep: `slurm.arrays`); under
the local backend the configurations run one after another, or N at a time. `status` and
`plot` of a sweep directory show every task side by side."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpcshard.cli import request, snapshot
from hpcshard.cli.common import job_states, table
from hpcshard.cli.options import SETS, setting_option, settings, shape_options, slurm_options, spare_options
from hpcshard.errors import UserError
from hpcshard.launch import backends
from hpcshard.rundir import store
from hpcshard.rundir.launchers import launchers, signal_launchers
from hpcshard.rundir.metrics import read_metrics, train_records
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.spec import RunSpec, create_run_dir
from hpcshard.rundir.status import attempts
from hpcshard.rundir.sweep import Sweep, expand, label, read_configs

if TYPE_CHECKING:
    from hpcshard.slurm.arrays import Part
    from hpcshard.slurm.poll import Backoff


@click.command()
@click.argument("job")
@shape_options()
@spare_options
@setting_option("backend")
@click.option("--grid", multiple=True, metavar="KEY=V1,V2,...",
              help="One axis of the grid (repeatable): every combination of the axes is a run.")
@click.option("--configs", "configs_file", type=click.Path(path_type=Path),
              help="A JSON file of configurations (a list of objects, or one per line); with "
              "--grid, every axis combination on top of each.")
@click.option("--max-parallel", type=click.IntRange(min=1),
              help="Runs at once [default: Slurm: as many as it schedules; local: 1].")
@click.option("--sweep-dir", type=click.Path(path_type=Path),
              help="Where the sweep's runs go (task-0, task-1, ...) [default: runs/JOB-sweep-TIME].")
@click.option("--name", help="Run name [default: the job's name].")
@setting_option("max_requeues")
@setting_option("code")
@slurm_options
@SETS
def sweep(job: str, nodes: int | None, grid: tuple[str, ...], configs_file: Path | None,
          max_parallel: int | None, sweep_dir: Path | None, name: str | None,
          sets: tuple[str, ...], profile: str | None, **opts: Any) -> None:
    """Run JOB once per configuration: --grid lr=1e-3,3e-4 --grid dim=64,128 is 4 runs (one
    Slurm job array; one after another under the local backend)."""
    res = settings(profile, opts)
    if not grid and configs_file is None:
        raise UserError("nothing to sweep: give --grid KEY=V1,V2 (repeatable) or --configs FILE")
    configs = expand(list(grid), read_configs(configs_file) if configs_file else None)
    asked = request.tasks(res, job, configs, nodes=nodes or 1, backend=res.values["backend"], root=sweep_dir,
                          name=name, sets=sets, max_parallel=max_parallel)
    runs, root = asked.runs, asked.root
    request.check(runs, configs=configs)
    parts = request.array_plan(len(runs), max_parallel) if asked.array is not None else []
    record = Sweep(job=asked.job, name=asked.name, backend=asked.backend, configs=configs,
                   max_parallel=max_parallel or 0)
    create_run_dir(root, runs[0].spec.run_group)
    for run in runs:
        create_run_dir(run.run_dir, run.spec.run_group)
        if run.code is not None:  # one copy in the sweep's directory, every task's
            snapshot.write(run.code, root, run.spec)
        run.spec.write(run.run_dir)
    record.write(root)
    click.echo(f"sweep {record.name}: {len(configs)} configuration(s) of {job}, {runs[0].spec.nodes} "
               f"node(s) x {runs[0].spec.gpus} GPU(s) each, in {root}")
    if asked.array is None:
        sys.exit(_run_local(record, root, [r.spec for r in runs], max_parallel or 1))
    ids, record.arrays = request.schedule_array(runs, root, parts)
    record.array, record.array_size = record.arrays[0], parts[0].count
    record.write(root)
    if len(parts) == 1:
        click.echo(f"submitted job array {record.array} ({parts[0].spec}): task i runs configuration i")
    else:
        click.echo(f"submitted {len(parts)} job arrays (this cluster's take {parts[0].count} tasks each), "
                   f"one sweep{_throttle(max_parallel, parts)}:")
        for part, job in zip(parts, record.arrays, strict=True):
            after = " ".join(record.arrays[k] for k in part.after)
            click.echo(f"  {job} ({part.spec}): tasks {part.first} to {part.tasks[-1]}"
                       + (f", after {after}" if after else ""))
    for i, config in enumerate(record.configs):
        click.echo(f"  {ids[i]}  {label(config)}  -> {record.task_dir(root, i)}")
    click.echo(f"status: hpcshard status {root}; curves: hpcshard plot {root}")


def _throttle(max_parallel: int | None, parts: list[Part]) -> str:
    if not max_parallel:
        return ""
    return (f", at most {max_parallel} task(s) at once across them"
            + (" (an array starts when the ones before it are over)" if any(p.after for p in parts) else ""))


CANCELLED = "cancelled"
"""In a sweep's directory: `cancel` was asked; the local runner starts no more runs."""


def cancel_sweep(root: Path) -> str:
    """Cancel every run of the sweep that is still going (one scancel for its Slurm jobs;
    SIGTERM to the local launchers), and keep the waiting ones from starting."""
    record = Sweep.read(root)
    (root / CANCELLED).write_text(f"{time.time()}\n")
    specs = [RunSpec.read(record.task_dir(root, i)) for i in range(len(record.configs))]
    jobs = [job for spec in specs if (job := backends.reaching(spec).job(spec)) is not None]
    if jobs:
        from hpcshard.slurm import cluster

        # The arrays still waiting on an earlier one first, each in its own call, newest first:
        # scancel sends one call's requests side by side, and the controller could start a
        # later array's task in the moment its earlier arrays' cancel freed the throttle.
        for array in reversed(record.arrays[1:]):
            with contextlib.suppress(cluster.SlurmError):
                cluster.scancel(array)
        cluster.scancel(*jobs)
        return f"cancelled Slurm job(s) {' '.join(jobs)} (sweep {root})"
    sent = sum(signal_launchers(record.task_dir(root, i), signal.SIGTERM) for i in range(len(specs)))
    return f"cancelled {sent} node launcher(s) of sweep {root}; no waiting run of it will start"


def _run_local(record: Sweep, root: Path, specs: list[RunSpec], parallel: int) -> int:
    """Each configuration's run, `parallel` at a time (their output in task-N/logs/run.out).
    Ctrl-C (or TERM, HUP) or `hpcshard cancel SWEEP` stops the running ones and starts no
    more."""
    waiting = list(range(len(specs)))
    running: dict[int, subprocess.Popen[bytes]] = {}
    failed = 0

    def interrupted(signum: int, _frame: object) -> None:  # kill, a hang-up: as Ctrl-C
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    try:
        failed = _drive(record, root, waiting, running, parallel)
    except KeyboardInterrupt:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            proc.wait()
        click.echo(f"interrupted: {len(running)} run(s) stopped, {len(waiting)} never started; "
                   f"hpcshard resume {root}/task-N continues one", err=True)
        return 130
    show_status(root)
    return 1 if failed else 0


def _drive(record: Sweep, root: Path, waiting: list[int], running: dict[int, subprocess.Popen[bytes]],
           parallel: int) -> int:
    failed = 0
    while waiting or running:
        if (root / CANCELLED).exists():
            waiting.clear()
        while waiting and len(running) < parallel:
            i = waiting.pop(0)
            task = record.task_dir(root, i)
            logs = RunPaths(task).logs
            logs.mkdir(parents=True, exist_ok=True)
            with (logs / "run.out").open("ab") as out:
                running[i] = subprocess.Popen([sys.executable, "-m", "hpcshard.launch.local",
                                               str(task.resolve())], stdout=out, stderr=subprocess.STDOUT)
            click.echo(f"task {i} ({label(record.configs[i])}): started")
        for i, proc in list(running.items()):
            if proc.poll() is not None:
                del running[i]
                failed += proc.returncode != 0
                click.echo(f"task {i} ({label(record.configs[i])}): "
                           + ("finished" if proc.returncode == 0 else f"failed (exit {proc.returncode}; "
                              f"see {record.task_dir(root, i) / 'logs' / 'run.out'})"))
        time.sleep(0.2)
    return failed


def task_jobs(root: Path) -> tuple[Sweep, list[RunSpec], list[str | None]]:
    """The sweep, its tasks' specs and each task's newest Slurm job (None: none)."""
    record = Sweep.read(root)
    specs = [RunSpec.read(record.task_dir(root, i)) for i in range(len(record.configs))]
    return record, specs, [backends.of(spec).job(spec) for spec in specs]


def task_rows(root: Path, slurm: dict[str, str] | None = None,
              known: tuple[Sweep, list[RunSpec], list[str | None]] | None = None
              ) -> list[tuple[str, str, str, str, str, str]]:
    """Each run of the sweep: task, configuration, state, step, best eval loss, attempts.
    `slurm`: the jobs' states when the caller asked already (`ls`: one ask for every sweep);
    `known`: its `task_jobs`, when the caller read them already."""
    record, specs, jobs = known or task_jobs(root)
    if slurm is None:
        slurm = job_states([job for job in jobs if job is not None], since=record.created)
    rows = []
    for i, (spec, config) in enumerate(zip(specs, record.configs, strict=True)):
        run = record.task_dir(root, i)
        records = read_metrics(run)
        train = train_records(records)
        evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None and "event" not in r]
        tried = attempts(run)
        if backends.of(spec).in_queue:
            job = jobs[i]
            state = slurm.get(job, "-") if job is not None else "new"
        else:
            state = "running" if launchers(run) else (tried[-1].reason if tried else "waiting")
        total = spec.resolved.steps or "?"
        rows.append((f"task-{i}", label(config), state, f"{train[-1]['step'] if train else 0}/{total}",
                     f"{min(evals):.4f}" if evals else "-", str(len(tried))))
    return rows


def show_status(root: Path) -> None:
    """The sweep's table: each configuration's state, step, best evaluation loss, attempts."""
    record = Sweep.read(root)
    rows = task_rows(root)
    click.echo(f"sweep {record.name}: {len(rows)} run(s) of {record.job}, backend {record.backend}"
               + _arrays(record.array_jobs)
               + f", started {store.age(record.created)} ago")
    table(("task", "configuration", "state", "step", "best eval", "attempts"), rows)


def _arrays(jobs: list[str]) -> str:
    if len(jobs) > 1:
        return f", job arrays {', '.join(jobs)}"
    return f", job array {jobs[0]}" if jobs else ""


def follow_sweep(root: Path, backoff: Backoff) -> None:
    """Print each task's Slurm state as it changes until every task's job is over, then
    the sweep's table. One squeue a poll for all the tasks still going (`slurm.poll.Watch`),
    `backoff` apart: `poll_s`, doubling while no task changes, up to `poll_max_s`."""
    from hpcshard.slurm.poll import Watch

    record, specs, jobs = task_jobs(root)
    tasks = {job: i for i, (spec, job) in enumerate(zip(specs, jobs, strict=True))
             if job is not None and backends.of(spec).in_queue}
    watch = Watch(list(tasks))
    if tasks:
        click.echo(f"following {len(tasks)} Slurm job(s) of sweep {record.name}: one squeue every "
                   f"{backoff.first:g} to {backoff.cap:g} s")
    silent = False
    while not watch.done:
        changed = watch.poll()
        for job in changed:
            info = watch.seen[job]
            why = f" ({info.reason})" if info.state.pending and info.reason not in ("", "None") else ""
            click.echo(f"task-{tasks[job]} ({label(record.configs[tasks[job]])}): {info.state_text}{why}")
        if not watch.answered and not silent:
            click.echo("Slurm does not answer; asking again", err=True)
        silent = not watch.answered
        if not watch.done:
            time.sleep(backoff.next(bool(changed)))
    show_status(root)


def summary(root: Path, slurm: dict[str, str] | None = None,
            known: tuple[Sweep, list[RunSpec], list[str | None]] | None = None) -> str:
    """One line of a sweep for `ls`: its runs by state, and the best evaluation loss
    (`slurm`, `known`: `task_rows`')."""
    rows = task_rows(root, slurm, known)
    states = Counter(row[2] for row in rows)
    best = min((row for row in rows if row[4] != "-"), key=lambda row: float(row[4]), default=None)
    return (f"{len(rows)} run(s): " + ", ".join(f"{n} {state}" for state, n in states.items())
            + (f"; best eval {best[4]} ({best[1]})" if best else ""))


def plot_sweep(root: Path, out: Path | None) -> Path:
    """Every task's train loss (and eval loss, dashed) over steps, one colour each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = Sweep.read(root)
    fig, ax = plt.subplots(figsize=(9, 5))
    drawn = 0
    for i, config in enumerate(record.configs):
        records = read_metrics(record.task_dir(root, i))
        train = train_records(records)
        steps = {r["step"]: r["loss"] for r in train}  # a step trained again: its newest loss
        if not steps:
            continue
        line, = ax.plot(sorted(steps), [steps[s] for s in sorted(steps)], label=f"{i}: {label(config)}")
        evals = [r for r in records if r.get("eval_loss") is not None and "event" not in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "--",
                    color=line.get_color())
        drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError(f"no run of sweep {root} has training metrics yet")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token); eval dashed")
    ax.set_title(f"sweep {record.name} ({len(record.configs)} runs)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    target = out or root / "plot.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
