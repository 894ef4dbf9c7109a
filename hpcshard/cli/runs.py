"""Operating runs: status, ls, plot, preempt, cancel (`hpcshard logs`: cli.logs) (login node: click and the
stdlib; Slurm through `hpcshard.slurm`, matplotlib only inside `plot`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from hpcshard.cli.common import job_states, poll_backoff, spec_of
from hpcshard.errors import UserError
from hpcshard.launch import backends
from hpcshard.rundir import ledger, store
from hpcshard.rundir.metrics import SPLIT, read_metrics, train_records
from hpcshard.rundir.rankenv import signal_name
from hpcshard.rundir.spec import RunSpec, read_spec
from hpcshard.rundir.status import attempts, report
from hpcshard.rundir.sweep import is_sweep
from hpcshard.sections import TrackerSection


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--signal", "signame",
              help="The notice to send [default: the run's (its profile's `signal`), else USR2].")
def preempt(run_dir: Path, signame: str | None) -> None:
    """Send a preemption notice to the run in RUN_DIR, as Slurm would.

    The ranks agree to stop at the next step boundary, commit a checkpoint and exit;
    the run is then requeued and resumes where it stopped.
    """
    spec = read_spec(run_dir)
    backend = backends.reaching(spec)
    click.echo(backend.notify(spec, run_dir, signal_name(signame or backend.notice(spec))))


@click.command()
@click.argument("target")
@click.option("--goodput", is_flag=True, help="Where the wall time went: effective training "
              "time, and queue, start-up, saves, evaluations, faults and recomputed steps.")
@click.option("-f", "--follow", is_flag=True, help="A sweep: print each task's Slurm state as it "
              "changes until every task is over (one squeue a poll; the profile's poll_s).")
@click.option("--profile", help="The profile whose poll_s and poll_max_s --follow uses "
              "[default: the configured one].")
def status(target: str, goodput: bool, follow: bool, profile: str | None) -> None:
    """Slurm state and training progress of a run (RUN_DIR, or a Slurm JOB id), or the
    table of a sweep (its directory)."""
    if is_sweep(Path(target)):
        from hpcshard.cli.sweep import follow_sweep, show_status

        if follow:
            follow_sweep(Path(target), poll_backoff(profile))
        else:
            show_status(Path(target))
        return
    if follow:
        raise UserError(f"--follow is for a sweep's directory; follow a run's log with "
                        f"`hpcshard logs -f {target}`")
    run_dir, spec = spec_of(target)
    if goodput:
        from hpcshard.rundir.goodput import account

        if spec.script:
            raise UserError(f"{run_dir} runs a script: its steps are its own (no metrics to "
                            "account); --goodput is for hpcshard jobs")
        for line in account(run_dir, spec.created).lines():
            click.echo(line)
        return
    backend = backends.reaching(spec)
    tracked = None if spec.script else TrackerSection.from_flat(spec.resolved.config)
    for line in report(run_dir, spec, backend.state(spec), backend.history(spec), tracked):
        click.echo(line)
    from hpcshard.cli.chain import lines

    for line in lines(run_dir):  # submit --after, --then
        click.echo(line)


@click.command()
@click.argument("target")
def cancel(target: str) -> None:
    """Stop a run now, without a checkpoint (see `preempt` for a clean stop); of a sweep,
    every run still going, and none of those waiting starts."""
    if is_sweep(Path(target)):
        from hpcshard.cli.sweep import cancel_sweep

        click.echo(cancel_sweep(Path(target)))
        return
    run_dir, spec = spec_of(target)
    click.echo(backends.reaching(spec).cancel(spec, run_dir))


@click.command("ls")
@click.argument("root", type=click.Path(path_type=Path), required=False)
@click.option("-n", "limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--profile", help="List the storage root of this profile [default: the configured one].")
def ls(root: Path | None, limit: int, profile: str | None) -> None:
    """Recent runs under ROOT (default: the profile's storage_root, else ./runs), newest first."""
    if root is None:
        from hpcshard import site

        root = site.storage_root(site.resolve(site.load(), profile))
    runs = sorted((p.parent for p in root.glob("*/spec.json")), key=lambda p: p.stat().st_mtime,
                  reverse=True)[:limit]
    sweeps = sorted((p.parent for p in root.glob("*/sweep.json")), key=lambda p: p.stat().st_mtime,
                    reverse=True)[:limit]
    if not runs and not sweeps:
        click.echo(f"no runs under {root}")
        return
    specs = []
    for run_dir in list(runs):  # one run's unreadable spec.json hides none of the others
        try:
            specs.append(RunSpec.read(run_dir))
        except (OSError, ValueError) as err:
            click.echo(f"{run_dir.name}: spec.json unreadable ({err}); skipped", err=True)
            runs.remove(run_dir)
    jobs = [backends.reaching(spec).job(spec) for spec in specs]
    since = [spec.created for spec, job in zip(specs, jobs, strict=True) if job is not None]
    if sweeps:
        from hpcshard.cli.sweep import summary, task_jobs

        known = [task_jobs(sweep_dir) for sweep_dir in sweeps]
        for record, _, tasks in known:
            jobs_of_sweeps = [job for job in tasks if job is not None]
            since += [record.created] if jobs_of_sweeps else []
            jobs += jobs_of_sweeps
    # Every run's and every sweep task's job in one ask (`job_states`: at most two calls).
    slurm = job_states(list(dict.fromkeys(job for job in jobs if job is not None)),
                       since=min(since, default=None))
    if sweeps:
        for sweep_dir, read in zip(sweeps, known, strict=True):
            click.echo(f"sweep {sweep_dir.name}: {summary(sweep_dir, slurm, read)}")
    if not runs:
        return
    click.echo(f"{'run':<32} {'backend':<10} {'shape':>5} {'step':>11} {'loss':>7} {'state':<9} "
               f"{'slurm':<11} age")
    for run_dir, spec, job_id in zip(runs, specs, jobs[:len(specs)], strict=True):
        total = spec.resolved.steps or "?"
        train = train_records(read_metrics(run_dir))
        rows = attempts(run_dir)
        state = rows[-1].reason if rows else "new"
        step = f"{train[-1]['step'] if train else 0}/{total}"
        loss = f"{train[-1]['loss']:.3f}" if train else "-"
        job = slurm.get(job_id, "?") if job_id is not None else "-"
        click.echo(f"{run_dir.name:<32} {spec.backend:<10} {f'{spec.nodes}x{spec.gpus}':>5} {step:>11} "
                   f"{loss:>7} {state:<9} {job:<11} {store.age(spec.created)}")


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="PNG to write [default: RUN_DIR/plot.png].")
def plot(run_dir: Path, out: Path | None) -> None:
    """Loss, tokens/s and where each step's time went over steps, with attempts, restarts,
    faults and rollbacks marked, as a PNG; of a sweep, every run's loss curves on one plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plot needs matplotlib: pip install 'hpcshard[plot]'") from None
    if is_sweep(run_dir):
        from hpcshard.cli.sweep import plot_sweep

        click.echo(f"wrote {plot_sweep(run_dir, out)}")
        return
    read_spec(run_dir)
    records = read_metrics(run_dir)
    train = train_records(records)
    if not train:
        raise UserError(f"{run_dir} has no training metrics yet")
    evals = [r for r in records if r.get("eval_loss") is not None and "event" not in r]
    timed = any(isinstance(r.get("split_s"), dict) for r in train)  # (older runs' records: no split)
    fig, axes = plt.subplots(3 if timed else 2, 1, sharex=True, figsize=(9, 8.5 if timed else 6))
    ax1, ax2 = axes[0], axes[1]
    labelled = False  # (the split's legend: from the first piece that has one)
    # One line per start of the ranks: steps trained again after a fault or a rollback
    # overlap the ones before, instead of a line drawn back across them.
    pieces: list[list[dict[str, Any]]] = [[]]
    for r in records:
        if r.get("event") == "start" or (pieces[-1] and "loss" in r and "event" not in r
                                         and r["step"] <= pieces[-1][-1]["step"]):
            pieces.append([])
        if "loss" in r and "event" not in r:
            pieces[-1].append(r)
    for i, piece in enumerate(p for p in pieces if p):
        ax1.plot([r["step"] for r in piece], [r["loss"] for r in piece], color="tab:blue",
                 label="train loss" if i == 0 else None)
        ax2.plot([r["step"] for r in piece], [r.get("tokens_per_s") or 0 for r in piece],
                 color="tab:green")
        if timed:
            labelled = _split_panel(axes[2], [r for r in piece if isinstance(r.get("split_s"), dict)],
                                    labelled) or labelled
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    top = ax1.get_ylim()[1]
    for a in [a for a in attempts(run_dir) if a.start is not None][1:]:  # where each attempt picked up
        for ax in axes:
            ax.axvline(a.loaded or 0, color="tab:red", linestyle="--", linewidth=1)
        name = f"restart {a.number}.{a.cycle}" if a.cycle else f"attempt {a.number}"
        ax1.annotate(name, (a.loaded or 0, top), fontsize=8, color="tab:red", va="top")
    for r in ledger.read(run_dir):  # where faults and rollbacks hit
        if r["event"] in ("fault", "rollback"):
            at = r.get("reached") if r["event"] == "fault" else r.get("step")
            who = (r.get("culprit") or {}).get("rank")
            label = (f"fault (rank {who})" if who is not None else "fault") if r["event"] == "fault" \
                else "nan: rolled back"
            for ax in axes:
                ax.axvline(at or 0, color="tab:orange", linewidth=1.5)
            ax1.annotate(label, (at or 0, top), fontsize=8, color="tab:orange", va="top",
                         ha="right", rotation=90)
    ax1.set_ylabel("loss (nats/token)")
    ax1.legend()
    ax2.set_ylabel("tokens/s")
    if timed:
        axes[2].set_ylabel("seconds per step")
        axes[2].legend(loc="upper left", fontsize=7, ncol=len(SPLIT))
    axes[-1].set_xlabel("step")
    ax1.set_title(f"{run_dir.name}")
    fig.tight_layout()
    target = out or run_dir / "plot.png"
    fig.savefig(target, dpi=110)
    click.echo(f"wrote {target}")


def _split_panel(ax: Any, records: list[dict[str, Any]], labelled: bool) -> bool:
    """Where the steps' time went (split_s), stacked: one colour per part, the same in
    every piece of the run; labelled for the legend unless `labelled` already. A negative
    "other" (a GPU's device and host clocks disagreeing) is drawn as none. Whether it drew."""
    if not records:
        return False
    parts = [[max(0.0, float(r["split_s"].get(k) or 0.0)) for r in records] for k in SPLIT]
    ax.stackplot([r["step"] for r in records], parts, labels=() if labelled else list(SPLIT),
                 colors=[f"C{i}" for i in range(len(SPLIT))], alpha=0.8)
    return True
