"""What `hpcshard status` shows: Slurm's view of the job and the run directory's view of the
training (progress, checkpoints, one row per attempt). Stdlib only."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hpcshard.rundir import flight, ledger, profiles, store
from hpcshard.rundir.metrics import read_metrics, split_text, train_records
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.runlogs import LOG_START
from hpcshard.rundir.spec import RunSpec, wandb_id


@dataclass
class Attempt:
    number: int
    cycle: int
    """In-place restarts before this one within the attempt (after faults)."""
    start: float | None
    """None: its end is recorded, its start not (stopped before rank 0 was up)."""
    end: float | None
    reason: str
    loaded: int | None
    saved: int | None
    reached: int | None
    lost: int | None
    lost_s: float | None = None
    """A script's attempt: seconds of training since its own last save (steps unknown)."""
    slurm: tuple[str, int] | None = None
    """The Slurm job and its run (SLURM_RESTART_COUNT) this attempt ran in."""

    @property
    def lost_text(self) -> str:
        if self.lost is not None:
            return str(self.lost)
        return "-" if self.lost_s is None else f"{self.lost_s:.0f}s"


def attempts(run_dir: Path) -> list[Attempt]:
    """One row per attempt. Steps lost: trained in this attempt but not in a checkpoint the
    next attempt loaded (a hard kill loses the steps since the last save). An attempt whose
    end is recorded and its start not (a notice or a kill before rank 0 was up) is a row
    too, with no start: every attempt the ledger knows is shown."""
    records = ledger.read(run_dir)
    steps = [(r["time"], r["step"]) for r in train_records(read_metrics(run_dir))]

    def key(r: dict[str, Any]) -> tuple[int, int]:
        return r["attempt"], r.get("cycle", 0)

    started = {key(r) for r in records if r["event"] == "start"}
    # (an end without its start stands for the start: the row's place, its `until` for the row before)
    starts = sorted([r for r in records if r["event"] == "start"
                     or (r["event"] == "end" and key(r) not in started)], key=key)
    rows = []
    for i, s in enumerate(starts):
        began = s["time"] if s["event"] == "start" else None
        until = starts[i + 1]["time"] if i + 1 < len(starts) else float("inf")
        end = next((r for r in records if r["event"] == "end" and key(r) == key(s)), None)
        fault = next((r for r in records if r["event"] == "fault" and key(r) == key(s)), None)
        if fault is not None:  # the ranks were killed and restarted (or the run stopped)
            end = {"time": fault["time"], "reason": "fault"}
        reached = (None if began is None
                   else max((st for t, st in steps if began <= t < until), default=None))
        next_loaded = starts[i + 1].get("resumed_step") if i + 1 < len(starts) else None
        kept = next_loaded if i + 1 < len(starts) else (end or {}).get("saved_step")
        lost = None if reached is None else max(0, reached - (kept or 0))
        rows.append(Attempt(number=s["attempt"], cycle=s.get("cycle", 0), start=began,
                            end=(end or {}).get("time"),
                            reason=(end or {}).get("reason",
                                                   "killed" if i + 1 < len(starts) else "running?"),
                            loaded=s.get("resumed_step"), saved=(end or {}).get("saved_step"),
                            reached=reached, lost=lost, lost_s=(end or {}).get("lost_seconds"),
                            slurm=(s["slurm_job"], int(s.get("slurm_run", 0)))
                            if s.get("slurm_job") else None))
    return rows


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


class SlurmJob(Protocol):
    """What status shows of the run's newest Slurm job (`hpcshard.slurm.cluster.JobInfo`;
    the run directory imports nothing of Slurm's)."""

    @property
    def state_text(self) -> str: ...
    @property
    def restarts(self) -> int | None: ...
    @property
    def nodes(self) -> str: ...
    @property
    def run_time(self) -> str: ...
    @property
    def exit_code(self) -> str: ...
    @property
    def from_accounting(self) -> bool: ...


class Trackers(Protocol):
    """Where status finds a run's trackers: its resolved config's tracker section
    (`hpcshard.sections.TrackerSection`, which the run directory does not import)."""

    @property
    def tensorboard(self) -> bool: ...
    @property
    def wandb_project(self) -> str: ...
    @property
    def wandb_entity(self) -> str: ...
    @property
    def wandb_mode(self) -> str: ...


def report(run_dir: Path, spec: RunSpec, slurm_state: SlurmJob | None,
           slurm_runs: list[dict[str, Any]] | None = None, tracked: Trackers | None = None) -> list[str]:
    """`hpcshard status`'s lines. `slurm_state`: what scontrol (or accounting, once the
    controller forgot it) says of the newest job, None outside Slurm; `slurm_runs`:
    accounting's runs of every job of the run (SlurmRun fields), None without accounting;
    `tracked`: the run's trackers (None: a script, or a run not resolved)."""
    spares = f" + {spec.spares} spare(s)" if spec.spares else ""
    lines = [f"run {spec.name}: {spec.nodes} node(s){spares} x {spec.gpus} GPU(s), "
             f"backend {spec.backend}, {run_dir}"]
    if spec.code is not None:
        lines.append(f"code: {spec.code_lost or spec.code.summary}")
    if slurm_state is not None:
        job, s = spec.jobs[-1], slurm_state
        lines.append(f"slurm job {job}: {s.state_text or 'no longer known to Slurm'}, restarts "
                     f"{'?' if s.restarts is None else s.restarts}, nodes {s.nodes or '-'}, "
                     f"run time {s.run_time or '-'}" + (f", exit {s.exit_code}" if s.exit_code else "")
                     + (" (from accounting: the controller has forgotten it)" if s.from_accounting else ""))
    records = read_metrics(run_dir)
    train = train_records(records)
    total = spec.resolved.steps or "?"
    if train:
        last = train[-1]
        tps = last.get("tokens_per_s")
        mfu = last.get("mfu")
        lines.append(f"progress: step {last['step']}/{total}, loss {last['loss']:.4f}"
                     + (f", {tps:,.0f} tokens/s" if tps else "") + (f", MFU {100 * mfu:.3g}%" if mfu else ""))
        split = split_text(last)
        if split:
            lines.append(split)
    evals = [r for r in records if r.get("eval_loss") is not None and "event" not in r]
    if evals:
        lines.append(f"eval: loss {evals[-1]['eval_loss']:.4f} at step {evals[-1]['step']}")
    lines += trackers(run_dir, spec.created, tracked) if tracked is not None else []
    lines += profile_lines(run_dir)
    done = store.committed(run_dir / store.CHECKPOINTS)
    own = store.last_save(run_dir) if spec.script else {}
    if own.get("saved") and not done:  # a script's own checkpoints, by their names
        lines.append(f"checkpoint: the script's newest save is {own['saved']} (step "
                     f"{own['saved_step']}, {store.age(time.time() - own['lost_seconds'])} ago)")
    elif done:
        c = done[-1]
        saved_in, age = c.manifest.get("save_seconds", 0), store.age(c.manifest.get("time", 0))
        lines.append(f"checkpoint: step {c.step} ({c.bytes / 1e6:.1f} MB, saved in {saved_in:.2f}s, "
                     f"{age} ago)")
    else:
        lines.append("checkpoint: none committed yet")
    lines += failing_saves(run_dir, done[-1].step if done else -1)
    rows = attempts(run_dir)
    by_run = {(r["job"], int(r["run"])): r for r in slurm_runs or []}
    if rows:
        lines.append(f"attempts ({len(rows)}):")
        lines.append(f"  {'#':>3} {'start':>8} {'end':>8}  {'end reason':<10} {'loaded':>6} {'reached':>7} "
                     f"{'saved':>6} {'lost':>5}" + ("  slurm job.run: state, nodes" if by_run else ""))
        for a in rows:
            number = f"{a.number}.{a.cycle}" if a.cycle else str(a.number)
            ran = by_run.get(a.slurm) if a.slurm else None
            lines.append(f"  {number:>3} {_clock(a.start):>8} {_clock(a.end):>8}  {a.reason:<10} "
                         f"{_fmt(a.loaded):>6} {_fmt(a.reached):>7} {_fmt(a.saved):>6} {a.lost_text:>5}"
                         + (f"  {ran['job']}.{ran['run']}: {ran['state']}, {ran['nodes']}" if ran else ""))
    if slurm_runs:
        lines.append(f"slurm runs ({len(slurm_runs)}, from accounting):")
        lines += [f"  {r['job']}.{r['run']}  {r['state']:<10} exit {r['exit_code']:<6} {r['elapsed']:>10}  "
                  f"{r['start'].replace('T', ' ')} -> {r['end'].replace('T', ' ')}  {r['nodes']}"
                  for r in slurm_runs]
    lines += faults(run_dir)
    records = ledger.read(run_dir)
    learned = [r for r in records if r["event"] == "watchdog"]
    if learned:  # the newest start's limits
        r = learned[-1]
        lines.append(f"watchdog ({r['attempt']}.{r['cycle']}): a step may take {r['step_limit']:.1f} s "
                     f"({r['factor']:g} x the median {r['median_step']:.2f} s, at least "
                     f"{r['floor_s']:g} s); joining {r.get('join_s', 120):g} s, "
                     f"other phases {r['phase_s']:g} s")
    for r in (r for r in records if r["event"] == "links"):
        low = r["slowest"]
        lines.append(f"links ({r['attempt']}.{r['cycle']}): slowest node {low['from']} -> {low['to']} at "
                     f"{low['gbps']:g} GB/s ({r['mb']:g} MB each way"
                     + (f"; floor {r['floor_gbps']:g} GB/s)" if r.get("floor_gbps") else ")"))
    slow = [r for r in records if r["event"] == "straggler" and r.get("kind") != "link"]
    if slow:
        lines.append(f"stragglers ({len(slow)}):")
        lines += [f"  rank {r['rank']} on {r.get('host', '?')} in {r['attempt']}.{r['cycle']}, step "
                  f"{r['step']}: {r['ratio']}x slower than the others' median "
                  + ("(its node declared bad)" if r.get("policy") == "bad_node" else "(a warning)")
                  for r in slow]
    bad = [r for r in records if r["event"] == "bad_node"]
    if bad:
        lines.append(f"bad nodes ({len(bad)}), never used again by this run:")
        told = {True: "; drained in Slurm", False: "; not drained (Slurm refused: {}), excluded "
                "by this run only"}
        lines += [f"  node {r['node']} ({r.get('slurm_node') or r.get('host', '?')}) in "
                  f"{r['attempt']}.{r['cycle']}: {r['reason']}"
                  + (told[r["drained"]].format(r.get("drain_error", "")) if "drained" in r else "")
                  for r in bad]
    for r in records:
        if r["event"] == "gave_up":
            lines.append(f"gave up: {r['reason']}")
        if r["event"] == "guard":
            lines.append(f"job {r['job']} ended {r['state']} while attempt {r['attempt']} trained (its "
                         f"batch node failed?): guard job {r['next']} took the run over "
                         f"({_clock(r.get('time'))})")
        if r["event"] == "rollback":
            lines.append(f"rollback {r['rollback']} of {r['of']} ({_clock(r.get('time'))}): nan or inf "
                         f"at step {r['step']}, rolled back to step {r['to']}, skipping "
                         f"{len(r['skipped'])} global batch(es)")
    return lines


def failing_saves(run_dir: Path, newest: int) -> list[str]:
    """The saves that failed in a row since the newest checkpoint (step `newest`, -1: none),
    across restarts and requeues (`ledger.failed_saves`): how many, and the last one's error."""
    row = ledger.failed_saves(ledger.read(run_dir), newest)
    if not row:
        return []
    last = row[-1]
    probe = {"": "", "ok": "; a write probe beside it wrote fine"}.get(
        last.get("probe", ""), f"; a write probe beside it got {last.get('probe')}")
    return [f"failed saves: {len(row)} in a row since {f'step {newest}' if newest >= 0 else 'the start'}, "
            f"the last at step {last['step']} ({last['attempt']}.{last['cycle']}): {last['error']}{probe}"]


def profile_lines(run_dir: Path) -> list[str]:
    """The recorded profiles (the newest window's files) and any out-of-memory snapshot."""
    lines = []
    recorded = profiles.windows(run_dir)
    if recorded:
        newest = recorded[-1]
        ranks = sorted(int(p.name.split("-")[1].split(".")[0]) for p in newest.glob("rank-*.done.json"))
        lines.append(f"profiles ({len(recorded)}): newest from step {int(newest.name[5:])} on rank(s) "
                     f"{','.join(map(str, ranks)) or '-'}: {newest} (Perfetto: ui.perfetto.dev; "
                     f"tensorboard --logdir {newest.parent})")
    for oom in sorted(RunPaths(run_dir).profiles.glob("oom-*.pickle")):
        lines.append(f"out of GPU memory: the allocator's snapshot {oom} (pytorch.org/memory_viz)")
    return lines


def trackers(run_dir: Path, created: float, tracked: Trackers) -> list[str]:
    """Where the run's TensorBoard events and W&B run are (one run across every start)."""
    lines = []
    if tracked.tensorboard:
        lines.append(f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}")
    if tracked.wandb_project:
        run_id = wandb_id(run_dir, created)
        where = "/".join(p for p in (tracked.wandb_entity, tracked.wandb_project) if p)
        lines.append(f"wandb: run {run_id} in {where}" + (
            f" (offline: wandb sync {run_dir / 'wandb'}/offline-run-*)" if tracked.wandb_mode == "offline"
            else ""))
    return lines


def faults(run_dir: Path) -> list[str]:
    """One line per fault: when, what, who, what it cost and what was done about it."""
    records = ledger.read(run_dir)
    found = [r for r in records if r["event"] == "fault"]
    if not found:
        return []
    lines = [f"faults ({len(found)}):"]
    back = {(r["attempt"], r["cycle"]): r["seconds"] for r in records if r["event"] == "recovered"}
    for r in found:
        culprit = _culprit(r.get("culprit") or {})
        action = "restarted" if r.get("restart") else "stopped"
        if (r["attempt"], r["cycle"] + 1) in back:
            action += f", training again {back[(r['attempt'], r['cycle'] + 1)]:.1f} s after"
        waits = flight.summary(r.get("collectives", []))
        lines.append(f"  {r['attempt']}.{r['cycle']} {_clock(r.get('declared'))}  {r.get('cause')}; "
                     f"{culprit}; {waits + '; ' if waits else ''}"
                     f"{r.get('lost_steps', 0)} step(s) to redo from step "
                     f"{r.get('committed', '-')}; {action}: {r.get('reason', '')}")
    return lines


def _culprit(who: dict[str, Any]) -> str:
    if not who:
        return "culprit unknown"
    if "rank" not in who:  # a whole node (lost)
        return f"node {who['node']} ({who.get('slurm_node') or who.get('host', '?')}) {who.get('state', '')}"
    where = f" on {who['host']}" if "host" in who else ""
    if "node" in who:  # (a rank whose own code raised is named by its host alone)
        where += f" (node {who['node']})" if where else f" on node {who['node']}"
    return f"rank {who['rank']}{where}" + (f": {who['error']}" if who.get("error") else "")


def _fmt(v: int | None) -> str:
    return "-" if v is None else str(v)


def culprit_lines(run_dir: Path, tail: int) -> tuple[str, list[str]]:
    """The newest fault's culprit: a header and the last lines its log had when the fault
    came (a restarted rank appends below a LOG_START line of its own)."""
    named = [r for r in ledger.read(run_dir) if r["event"] == "fault" and "rank" in (r.get("culprit") or {})]
    if not named:
        raise ValueError(f"{run_dir} has no fault with a known culprit; see hpcshard status {run_dir}")
    fault = named[-1]
    rank = int(fault["culprit"]["rank"])
    log = RunPaths(run_dir).rank_log(rank)
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    mark = f"attempt {fault['attempt']} cycle {fault['cycle'] + 1} "
    cut = next((i for i, line in enumerate(lines) if LOG_START in line and mark in line), len(lines))
    return (f"rank {rank} ({fault['cause']}), the last lines of {log} before the restart:",
            lines[max(0, cut - tail):cut])
