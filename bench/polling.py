"""Light on the controller (issue 31 item 6): Slurm calls per minute of the commands that
follow jobs, on the local Slurm cluster (scripts/local-slurm up 2, with accounting), before
and after one squeue a poll with backoff, side by side in one window.

A 100-task sweep (the demo, a few steps each, 4 tasks at a time on 2 nodes x 2 GPUs: the
tasks keep starting and ending, the worst case for a backoff) is followed for WINDOW_S
seconds at once by:

- `status SWEEP` every STATUS_EVERY_S seconds (`watch hpcshard status SWEEP`, the way to
  follow a sweep before `status --follow`), with the code before the change (BEFORE,
  unpacked by `git archive`) and with this tree's;
- `status SWEEP --follow` (this tree's; new);
- `logs -f SWEEP/task-99` (the last task: pending for the whole window) before and after.

Every Slurm command is counted by wrappers first on PATH (one line per call, into the
process's own file), the same for the old code and the new; the new code's own counter
(HPCSHARD_SLURM_CALLS_LOG) is checked against them. Results: results/polling.md, .json."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import PY, RESULTS, ROOT, Metric, env, hpcshard, run, save, show
from hpcshard.slurm.poll import POLL_S

NAME = "polling"
CONF = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm")) / "etc" / "slurm.conf"
TASKS = 100
WINDOW_S = float(os.environ.get("HPCSHARD_POLLING_WINDOW", "60"))
STATUS_EVERY_S = 5.0
"""As `watch -n 5`: the same interval as the new default poll_s."""
BEFORE = os.environ.get("HPCSHARD_POLLING_BEFORE", "c58a08a")
"""The commit before the change (main's head when issue 31 item 6 began)."""
COMMANDS = ("scontrol", "squeue", "sacct", "sbatch", "scancel", "sinfo")


def wrappers(where: Path, path: str) -> Path:
    """Slurm's commands, each logging "TIME NAME ARG1" into $HPCSHARD_BENCH_CALLS, then
    running the real one."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    for name in COMMANDS:
        real = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True,
                              env={"PATH": path}).stdout.strip() or f"/usr/bin/{name}"
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "$(date +%s.%N) {name} $1" >> "$HPCSHARD_BENCH_CALLS"\n'
                          f'exec {real} "$@"\n')
        script.chmod(0o755)
    return bin_dir


def counted(e: dict[str, str], bin_dir: Path, log: Path, code: Path | None) -> dict[str, str]:
    """The environment of one follower: the wrappers first, its own call log, the old code
    first on PYTHONPATH when `code` is given."""
    path = {"PATH": f"{bin_dir}:{e['PATH']}", "HPCSHARD_BENCH_CALLS": str(log),
            "HPCSHARD_SLURM_CALLS_LOG": str(log.with_suffix(".own"))}
    return {**e, **path, **({"PYTHONPATH": str(code)} if code else {"PYTHONPATH": str(ROOT)})}


def every(argv: list[str], e: dict[str, str], stop: float) -> int:
    # (run from the code's own directory: `python -m` puts the working directory first)
    """Run `argv` every STATUS_EVERY_S until `stop` (monotonic); how many times it ran."""
    n = 0
    while time.monotonic() < stop:
        began = time.monotonic()
        subprocess.run(argv, cwd=e["PYTHONPATH"], env=e, capture_output=True, timeout=120)
        n += 1
        time.sleep(max(0.0, STATUS_EVERY_S - (time.monotonic() - began)))
    return n


def until(argv: list[str], e: dict[str, str], stop: float) -> str:
    """Run `argv` until `stop`, then end it (TERM); its output."""
    proc = subprocess.Popen(argv, cwd=e["PYTHONPATH"], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, stop - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    return out


def calls(log: Path) -> list[tuple[float, str]]:
    return [(float(t), name) for t, name, *_ in (line.split() for line in log.read_text().splitlines())] \
        if log.exists() else []


def sweep(root: Path, e: dict[str, str]) -> str:
    lrs = ",".join(f"{(i + 1) * 1e-5:.5f}" for i in range(TASKS))
    hpcshard("sweep", "--backend", "slurm", "jobs/charlm.py", "--grid", f"lr={lrs}", "--nodes", "1",
             "--gpus", "1", "--partition", "low", "--time", "10:00", "--sweep-dir", str(root),
             "--set", "steps=3", "--set", "log_every=1", "--set", "eval_every=0", env=e, timeout=600)
    return str(json.loads((root / "sweep.json").read_text())["array"])


def followers(root: Path, before: Path) -> dict[str, tuple[list[str], Path | None, str]]:
    """Name: (argv, code, how: every or until)."""
    status = [PY, "-m", "hpcshard", "status", str(root)]
    logs = [PY, "-m", "hpcshard", "logs", "-f", str(root / f"task-{TASKS - 1}")]
    return {"status every 5 s, before": (status, before, "every"),
            "status every 5 s, after": (status, None, "every"),
            "status --follow, after": ([*status, "--follow"], None, "until"),
            "logs -f (one pending task), before": (logs, before, "until"),
            "logs -f (one pending task), after": (logs, None, "until")}


def measure(root: Path, before: Path, bin_dir: Path, e: dict[str, str], tmp: Path) -> dict[str, Any]:
    stop = time.monotonic() + WINDOW_S
    found: dict[str, Any] = {}
    threads = []
    for i, (name, (argv, code, how)) in enumerate(followers(root, before).items()):
        log = tmp / f"calls-{i}.log"
        fe = counted(e, bin_dir, log, code)

        def go(name: str = name, argv: list[str] = argv, fe: dict[str, str] = fe, how: str = how,
               log: Path = log) -> None:
            began = time.time()
            ran = every(argv, fe, stop) if how == "every" else until(argv, fe, stop)
            made = calls(log)
            own = calls(log.with_suffix(".own"))
            found[name] = {"calls": len(made), "by_command": dict(Counter(n for _, n in made)),
                           "per_min": len(made) / (time.time() - began) * 60,
                           "counter_agrees": None if name.endswith("before") else len(own) == len(made),
                           "runs": ran if isinstance(ran, int) else 1,
                           "gaps_s": [round(b[0] - a[0], 2) for a, b in zip(made, made[1:], strict=False)]}

        threads.append(threading.Thread(target=go))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


FAKE = os.environ.get("HPCSHARD_POLLING_FAKE") == "1"
"""A simulated controller instead of the local cluster (`fake_slurm`): no accounting, the
sweep's tasks 4 at a time, TASK_S each; the same followers, old code and new."""
TASK_S = 15.0
FAKE_SLURM = """#!/usr/bin/env python3
import os, sys, time
t0, n, each = float(os.environ["FAKE_T0"]), int(os.environ["FAKE_TASKS"]), float(os.environ["FAKE_TASK_S"])
def state(i):
    start = t0 + (i // 4) * each
    now = time.time()
    return "PENDING" if now < start else "RUNNING" if now < start + each else "COMPLETED"
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
if name == "sacct":
    sys.exit("sacct: error: Slurm accounting storage is disabled")
if name == "scontrol":
    i = int(args[-1].split("_")[1])
    print(f"JobId={args[-1]} JobState={state(i)} Restarts=0 Reason=None")
elif name == "squeue":
    asked = next(a for a in args if a.startswith("--jobs=")).split("=", 1)[1].split(",")
    for i in range(n):
        if f"900_{i}" in asked or "900" in asked:
            print(f"900_{i}|{state(i)}|None|n1|0:01")
"""


def fake_slurm(where: Path, root: Path) -> tuple[dict[str, str], str]:
    """Slurm's query commands as scripts answering for a 100-task array 900 (`FAKE_SLURM`),
    and a sweep's directory whose tasks are its jobs."""
    from hpcshard.rundir.spec import Resolved, RunSpec
    from hpcshard.rundir.sweep import Sweep

    real = where / "fake"
    real.mkdir()
    for name in ("scontrol", "squeue", "sacct"):
        (real / name).write_text(FAKE_SLURM)
        (real / name).chmod(0o755)
    configs = [{"lr": str(i)} for i in range(TASKS)]
    root.mkdir()
    Sweep(job="jobs/charlm.py", name="sim", backend="slurm", configs=configs, array="900").write(root)
    for i, config in enumerate(configs):
        (root / f"task-{i}").mkdir()
        RunSpec(job="jobs/charlm.py", sets=config, nodes=1, gpus=1, backend="slurm", name=f"sim-{i}",
                jobs=[f"900_{i}"], resolved=Resolved(config={"steps": 3})).write(root / f"task-{i}")
    e = env(PATH=f"{real}:{os.environ['PATH']}", FAKE_T0=str(time.time()), FAKE_TASKS=str(TASKS),
            FAKE_TASK_S=str(TASK_S))
    return e, "900"


def main() -> list[Metric]:
    if not FAKE:
        run([str(ROOT / "scripts" / "local-slurm"), "up", "2"], timeout=600)
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp_name:
        tmp = Path(tmp_name)
        before = tmp / "before"
        before.mkdir()
        subprocess.run(f"git -C {ROOT} archive {BEFORE} hpcshard | tar -x -C {before}", shell=True,
                       check=True)
        root = tmp / "sweep"
        e, array = fake_slurm(tmp, root) if FAKE else (env(SLURM_CONF=str(CONF)), "")
        bin_dir = wrappers(tmp, e["PATH"])
        array = array or sweep(root, e)
        try:
            found = measure(root, before, bin_dir, e, tmp)
        finally:
            if not FAKE:
                hpcshard("cancel", str(root), env=e, check=False)
    metrics = [Metric(NAME, f"{name}: Slurm calls per minute", got["per_min"], "calls/min",
                      note=", ".join(f"{k} {v}" for k, v in sorted(got["by_command"].items())))
               for name, got in found.items()]
    old, new = found["status every 5 s, before"], found["status --follow, after"]
    ratio = old["per_min"] / max(new["per_min"], 1e-9)
    metrics.append(Metric(NAME, "following a 100-task sweep: before / after", ratio, "x",
                          note="status every 5 s with the old code against status --follow"))
    closest = min(new["gaps_s"], default=WINDOW_S)
    metrics.append(Metric(NAME, "status --follow: the closest two of its calls", closest, "s",
                          f">= {0.9 * POLL_S:g}", closest >= 0.9 * POLL_S,
                          note=f"poll_s {POLL_S}: one call a poll; the farthest two "
                          f"{max(new['gaps_s'], default=0):.1f} s apart"))
    details = {"tasks": TASKS, "window_s": WINDOW_S, "before": BEFORE, "array": array, "followers": found,
               "controller": "simulated (no accounting)" if FAKE else "local Slurm cluster (accounting)"}
    if not FAKE:
        save(NAME, metrics, details)
    write(metrics, details)
    return metrics


def write(metrics: list[Metric], details: dict[str, Any]) -> None:
    name = f"{NAME}-simulated" if FAKE else NAME
    (RESULTS / f"{name}.json").write_text(json.dumps({"metrics": [m.__dict__ for m in metrics],
                                                      "details": details}, indent=1) + "\n")
    rows = ["| follower | calls/min | calls in the window, by command | commands run |", "|---|---|---|---|"]
    for who, got in details["followers"].items():
        rows.append(f"| {who} | {got['per_min']:.1f} | "
                    + ", ".join(f"{k} {v}" for k, v in sorted(got["by_command"].items()))
                    + f" | {got['runs']} |")
    where = (f"A simulated controller (`HPCSHARD_POLLING_FAKE=1`: squeue and scontrol answered by a "
             f"script, no accounting), the tasks {TASK_S:g} s each, 4 at a time" if FAKE else
             "Local Slurm cluster (2 nodes x 2 GPUs, accounting on), the demo 3 steps a task, "
             "4 tasks at a time")
    (RESULTS / f"{name}.md").write_text(
        f"# Slurm calls per minute, a {details['tasks']}-task sweep followed for "
        f"{details['window_s']:g} s\n\n"
        f"{where}; every follower in the same window, counted by wrappers of Slurm's commands. Before: "
        f"commit {details['before']}. Commands run: how often the follower's command ran in the window "
        f"(`status` every 5 s runs less often when one status takes longer than that).\n\n"
        + "\n".join(rows) + "\n\n"
        + "\n".join(f"- {m.name}: {m.value:.3g} {m.unit}" + (f" ({m.note})" if m.note else "")
                    for m in metrics[-2:]) + "\n")


if __name__ == "__main__":
    show(main())
