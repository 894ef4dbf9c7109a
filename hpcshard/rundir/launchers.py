"""RUN_DIR/launch/: what the launchers leave for each other and for the CLI.

    node-N.pid       a node launcher's pid while it runs (local backend: `preempt`,
                     `cancel` and `resume` find the live ones here)
    job-J.attempt    the attempt number a continuation job J starts with (chain policy)
    fault-A-C.json   a fault in cycle C of attempt A, declared by the first launcher to
                     see it (created exclusively: one declaration, whoever is first)
    down-A-C-N.json  node N's ranks of that cycle are dead, and what it saw
    next-A-C.json    the decision once every node is down (node 0's, or the lowest
                     launcher's that is not lost): restart (which nodes train, where the
                     next rendezvous is) or stop; created exclusively, first decider wins
    alive-A-N.json   node N's launcher's heartbeat in attempt A (rewritten every second):
                     one that stops moving is a node lost (dead, frozen, cut off); a
                     launcher that ends says so in it ("done": its exit code)
    continue-A       claimed by the launcher that sends attempt A back through the queue

The launchers of a job see each other only through these files: the run directory is
shared storage, and a node whose launcher writes nothing is a node that is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from hpcshard.rundir import ledger
from hpcshard.rundir.files import write_atomic

LAUNCH = "launch"


def pid_file(run_dir: Path, node_rank: int) -> Path:
    return run_dir / LAUNCH / f"node-{node_rank}.pid"


def attempt_file(run_dir: Path, job_id: str) -> Path:
    """Where a continuation job finds its attempt number (absent: not a continuation)."""
    return run_dir / LAUNCH / f"job-{job_id}.attempt"


def guard_file(run_dir: Path, job_id: str) -> Path:
    """Present when job `job_id` is a guard: it holds the id of the job it guards."""
    return run_dir / LAUNCH / f"job-{job_id}.guards"


def guards(run_dir: Path) -> list[str]:
    """The run's guard jobs (pending, run or cancelled by Slurm), oldest first."""
    found = sorted((run_dir / LAUNCH).glob("job-*.guards"), key=lambda p: p.stat().st_mtime)
    return [p.name[len("job-"):-len(".guards")] for p in found]


def launchers(run_dir: Path) -> list[int]:
    """The pids of the launchers that are still alive (a pid file left behind by one
    killed with -9 does not count; another user's live process does)."""
    alive = []
    for path in sorted((run_dir / LAUNCH).glob("node-*.pid")):
        try:
            pid = int(path.read_text())
            os.kill(pid, 0)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            continue
        except PermissionError:
            pass
        alive.append(pid)
    return alive


def signal_launchers(run_dir: Path, sig: int) -> int:
    """Send `sig` to every live launcher of the run; returns how many got it."""
    sent = 0
    for pid in launchers(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            sent += 1
    return sent


def _cycle_file(run_dir: Path, kind: str, attempt: int, cycle: int, suffix: str = ".json") -> Path:
    (run_dir / LAUNCH).mkdir(exist_ok=True)
    return run_dir / LAUNCH / f"{kind}-{attempt}-{cycle}{suffix}"


def _create(path: Path, text: str) -> bool:
    """Write `path` whole unless it exists (written aside, then linked: no reader sees it
    half written, and of two writers exactly one wins). False when it existed."""
    path.parent.mkdir(exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(text)
    try:
        os.link(aside, path)
    except FileExistsError:
        return False
    finally:
        aside.unlink()
    return True


def claim(run_dir: Path, name: str) -> bool:
    """The first launcher to claim `name` gets True; every other one False."""
    return _create(run_dir / LAUNCH / name, f"{os.getpid()}\n")


def declare_fault(run_dir: Path, attempt: int, cycle: int, record: dict[str, Any]) -> bool:
    """Declare a fault in this cycle; False when another launcher declared one first."""
    return _create(_cycle_file(run_dir, "fault", attempt, cycle),
                   json.dumps({"time": time.time(), **record}) + "\n")


def fault(run_dir: Path, attempt: int, cycle: int) -> dict[str, Any] | None:
    """The fault declared in this cycle, or None."""
    path = _cycle_file(run_dir, "fault", attempt, cycle)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return dict(json.loads(text))


def mark_down(run_dir: Path, attempt: int, cycle: int, node: int, record: dict[str, Any]) -> None:
    """Node `node`'s ranks of this cycle are dead; `record`: what it saw (dead ranks, steps)."""
    write_atomic(_cycle_file(run_dir, "down", attempt, cycle, f"-{node}.json"),
                 json.dumps({"time": time.time(), "node": node, **record}) + "\n")


def downs(run_dir: Path, attempt: int, cycle: int, nodes: int) -> list[dict[str, Any]]:
    """The down records of this cycle that exist, by node."""
    found = []
    for n in range(nodes):
        with contextlib.suppress(FileNotFoundError):
            found.append(json.loads(_cycle_file(run_dir, "down", attempt, cycle, f"-{n}.json").read_text()))
    return found


def nodes_down(run_dir: Path, attempt: int, cycle: int, nodes: int) -> list[int]:
    return [int(d["node"]) for d in downs(run_dir, attempt, cycle, nodes)]


def decide(run_dir: Path, attempt: int, cycle: int, decided: dict[str, Any]) -> dict[str, Any]:
    """Record the decision for this cycle; returns the one that stands (another decider's,
    if it came first)."""
    if _create(_cycle_file(run_dir, "next", attempt, cycle), json.dumps(decided) + "\n"):
        return decided
    return decision(run_dir, attempt, cycle) or decided


def decision(run_dir: Path, attempt: int, cycle: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads(_cycle_file(run_dir, "next", attempt, cycle).read_text()))
    except FileNotFoundError:
        return None


def over(run_dir: Path, attempt: int, cycle: int) -> bool:
    """Is this cycle over: decided after a fault, or the run started again since? A rank
    of it that fails now was stopped meanwhile (a frozen node, thawed): what it would
    record (a failure, its end) is stale, and the decision was made without it."""
    return decision(run_dir, attempt, cycle) is not None or ledger.moved_on(run_dir, attempt, cycle)


def beat(run_dir: Path, attempt: int, node: int, record: dict[str, Any]) -> None:
    """This node's launcher is alive (written whole: a reader opens it afresh, which also
    gets past NFS's attribute cache)."""
    path = run_dir / LAUNCH / f"alive-{attempt}-{node}.json"
    write_atomic(path, json.dumps({"time": time.time(), "node": node, **record}) + "\n")


def beats(run_dir: Path, attempt: int, nodes: int) -> dict[int, dict[str, Any]]:
    """The newest heartbeat of each node that has written one, by node."""
    found = {}
    for n in range(nodes):
        with contextlib.suppress(FileNotFoundError, ValueError):
            found[n] = dict(json.loads((run_dir / LAUNCH / f"alive-{attempt}-{n}.json").read_text()))
    return found
