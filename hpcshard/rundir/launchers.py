"""RUN_DIR/launch/: what the launchers leave for each other and for the CLI.

    node-N.pid       a node launcher's identity while it runs (pid, start time, boot, host,
                     pid namespace: `rundir.proc`); the local backend's `preempt`, `cancel`
                     and `resume` find the live ones here, and a reused pid is not one
    job-J.attempt    the attempt number a continuation job J starts with (chain policy)
    fault-A-C.json   a fault in cycle C of attempt A, declared by the first launcher to
                     see it (created exclusively: one declaration, whoever is first)
    down-A-C-N.json  node N's ranks of that cycle are dead, and what it saw
    next-A-C.json    the decision once every node is down (node 0's, or the lowest
                     launcher's that is not lost): restart (which nodes train, where the
                     next rendezvous is) or stop; created exclusively, first decider wins
                     (through the store too: the arbiter of a job cut in two)
    alive-A-N.json   node N's launcher's heartbeat in attempt A (rewritten every second):
                     one that stops moving is a node lost (dead, frozen, cut off); a
                     launcher that ends says so in it ("done": its exit code)
    continue-A       claimed by the launcher that sends attempt A back through the queue

The launchers of a job coordinate through node 0's store (`launch.coord`); the fault,
down and alive files are the same protocol through the run directory, used when the store
cannot be had or was lost with node 0 (and with HPCSHARD_COORD=files); the next file is
created whatever the channel, where the storage takes it. Every
launcher writes its alive file once at its start and once at its end, so that a peer
falling back to the files finds the name there.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpcshard.rundir import ledger, paths, proc
from hpcshard.rundir.files import create_exclusive, write_atomic

LAUNCH = paths.LAUNCH
READ_WON_S = 5.0
"""How long a decider whose decision lost reads for the one that stands."""


def pid_file(run_dir: Path, node_rank: int) -> Path:
    return run_dir / LAUNCH / f"node-{node_rank}.pid"


def write_pid_file(run_dir: Path, node_rank: int) -> Path:
    """This process is node `node_rank`'s launcher: its identity, written whole."""
    path = pid_file(run_dir, node_rank)
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, json.dumps(proc.identity(os.getpid())) + "\n")
    return path


def _identity(path: Path) -> dict[str, Any] | None:
    """The launcher a pid file names (None: unreadable, or of a version that wrote a bare
    pid, which cannot tell the launcher from a process that got its pid later)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_pid(path: Path) -> int | None:
    """The pid of the launcher this pid file names, if that launcher still runs on this
    host: None when it is gone, when its pid now belongs to another process (a later start
    time), or when the file is another host's, boot's or pid namespace's (its pid names
    nothing here)."""
    record = _identity(path)
    return int(record["pid"]) if record is not None and proc.same(record) else None


def attempt_file(run_dir: Path, job_id: str) -> Path:
    """Where a continuation job finds its attempt number (absent: not a continuation)."""
    return run_dir / LAUNCH / f"job-{job_id}.attempt"


def guard_file(run_dir: Path, job_id: str) -> Path:
    """Present when job `job_id` is a guard: it holds the id of the job it guards."""
    return run_dir / LAUNCH / f"job-{job_id}.guards"


def guarded_job(run_dir: Path, job_id: str) -> str:
    """The job that guard job `job_id` guards (its guard file's first line)."""
    return guard_file(run_dir, job_id).read_text().split("\n", 1)[0].strip()


def decide_guard(run_dir: Path, job_id: str, taken: int | None, why: str = "") -> None:
    """Say what guard job `job_id` does, in its guard file: it took the run over as attempt
    `taken`, or declined (`why`). The guard's other launchers read it there (`guard_decision`),
    in a file each has looked at since the guard was submitted, not in a new one: a name
    looked up before another host created it stays hidden by NFS's negative lookup cache
    (30-60 s; in the chaos soak on NFS-like views, where the others waited for the winner's
    attempt file, the guard's ranks started 42 s after it took the run over, against 14 s
    for a continuation job in the same soak), while new content in a file already known
    shows at the next open (NFS's close-to-open). Appended in place, one line."""
    line = f"taken {taken}\n" if taken is not None else f"declined {' '.join(why.split())}\n"
    with open(guard_file(run_dir, job_id), "a", encoding="utf-8") as out:
        out.write(line)
        out.flush()
        os.fsync(out.fileno())


def guard_decision(run_dir: Path, job_id: str) -> tuple[int | None, str] | None:
    """What guard job `job_id` decided (`decide_guard`): (attempt, "") when it took the run
    over, (None, why) when it declined; None while undecided (or no such guard file)."""
    try:
        lines = guard_file(run_dir, job_id).read_text(encoding="utf-8").split("\n")[1:-1]
    except (OSError, ValueError):
        return None
    for line in lines:  # (whole lines only: the last, without its newline, may be half written)
        kind, _, rest = line.partition(" ")
        if kind == "taken" and rest.strip().isdigit():
            return int(rest), ""
        if kind == "declined":
            return None, rest
    return None


def guards(run_dir: Path) -> list[str]:
    """The run's guard jobs (pending, run or cancelled by Slurm), oldest first."""
    # (by job id, which Slurm hands out in submission order: a guard's file is appended to
    # when it decides, so its mtime is no submission time)
    found = [p.name[len("job-"):-len(".guards")] for p in (run_dir / LAUNCH).glob("job-*.guards")]
    return sorted(found, key=lambda job: (0, int(job), job) if job.isdigit() else (1, 0, job))


def launchers(run_dir: Path) -> list[int]:
    """The pids of the run's launchers that still run on this host. A pid file left by one
    killed with -9 does not count, nor one whose pid now belongs to another process (its
    start time differs). A pid file written on another host (or before a reboot, or in a
    container's own pid namespace) is left out too: its pid cannot be checked from here,
    and would name an unrelated process. (The local backend runs every launcher on the
    host of its CLI; of a Slurm run's, Slurm is asked.)"""
    found = (read_pid(path) for path in sorted((run_dir / LAUNCH).glob("node-*.pid")))
    return [pid for pid in found if pid is not None]


def _signal_identified(path: Path, sig: int) -> bool:
    """Send `sig` to the launcher `path` names, if it is still that process."""
    record = _identity(path)
    return record is not None and proc.signal(record, sig)


def signal_launchers(run_dir: Path, sig: int) -> int:
    """Send `sig` to every live launcher of the run on this host (`launchers`); returns how
    many got it."""
    return sum(_signal_identified(path, sig) for path in sorted((run_dir / LAUNCH).glob("node-*.pid")))


def _cycle_file(run_dir: Path, kind: str, attempt: int, cycle: int, suffix: str = ".json") -> Path:
    (run_dir / LAUNCH).mkdir(exist_ok=True)
    return run_dir / LAUNCH / f"{kind}-{attempt}-{cycle}{suffix}"


def _create(path: Path, text: str) -> bool:
    """Write `path` whole unless it exists; of two writers exactly one wins (False when it
    existed): `files.create_exclusive`."""
    return create_exclusive(path, text)


def claim(run_dir: Path, name: str) -> bool:
    """The first launcher to claim `name` gets True; every other one False."""
    return _create(run_dir / LAUNCH / name, json.dumps(proc.identity(os.getpid())) + "\n")


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


def downs(run_dir: Path, attempt: int, cycle: int, nodes: int,
          of: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """The down records of this cycle that exist (of `of`, default every node), by node."""
    found = []
    for n in sorted(range(nodes) if of is None else of):
        with contextlib.suppress(FileNotFoundError):
            found.append(json.loads(_cycle_file(run_dir, "down", attempt, cycle, f"-{n}.json").read_text()))
    return found


def nodes_down(run_dir: Path, attempt: int, cycle: int, nodes: int) -> list[int]:
    return [int(d["node"]) for d in downs(run_dir, attempt, cycle, nodes)]


def decide(run_dir: Path, attempt: int, cycle: int, decided: dict[str, Any]) -> dict[str, Any]:
    """Record the decision for this cycle; returns the one that stands (another decider's,
    if it came first). The other's file exists once the create lost (the file server said
    so); a moment to read it, should a cache still say otherwise."""
    if _create(_cycle_file(run_dir, "next", attempt, cycle), json.dumps(decided) + "\n"):
        return decided
    deadline = time.monotonic() + READ_WON_S
    while (won := decision(run_dir, attempt, cycle)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return won or decided


def decision(run_dir: Path, attempt: int, cycle: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads(_cycle_file(run_dir, "next", attempt, cycle).read_text()))
    except FileNotFoundError:
        return None


def over(run_dir: Path, attempt: int, cycle: int) -> bool:
    """Is this cycle over: decided after a fault (its decision's file; or the decider's
    fault record in the ledger, as a full disk leaves the decision in node 0's store
    alone, `launch.coord`), or the run
    started again since? A rank of it that fails now was stopped meanwhile (a frozen
    node, thawed): what it would record (a failure, its end) is stale, and the decision
    was made without it."""
    if decision(run_dir, attempt, cycle) is not None:
        return True
    # (one read: every rank that fails asks, thousands at once after a fault on a big job)
    records = ledger.read(run_dir)
    return any(r["event"] == "fault" and r.get("attempt") == attempt and r.get("cycle", 0) == cycle
               for r in records) or ledger.moved_on(run_dir, attempt, cycle, records)


def beat(run_dir: Path, attempt: int, node: int, record: dict[str, Any]) -> None:
    """This node's launcher is alive (written whole: a reader opens it afresh, which also
    gets past NFS's attribute cache)."""
    path = run_dir / LAUNCH / f"alive-{attempt}-{node}.json"
    write_atomic(path, json.dumps({"time": time.time(), "node": node, **record}) + "\n")


def beats(run_dir: Path, attempt: int, nodes: int,
          of: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
    """The newest heartbeat of each node that has written one (of `of`, default every node),
    by node."""
    found = {}
    for n in sorted(range(nodes) if of is None else of):
        with contextlib.suppress(FileNotFoundError, ValueError):
            found[n] = dict(json.loads((run_dir / LAUNCH / f"alive-{attempt}-{n}.json").read_text()))
    return found
