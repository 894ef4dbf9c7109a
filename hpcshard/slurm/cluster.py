"""Slurm's client commands, each asked in one place: what the cluster offers (sinfo),
what a job is doing (scontrol, sacct), and what to do to one (sbatch, scancel, scontrol
requeue). Stdlib: the login node and the launchers inside an allocation both use it.
Every command may be missing (a container without Slurm's client) or hang (a controller
that does not answer): callers get None, an empty dict or a ValueError, not a traceback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpcshard.slurm.sbatch import SbatchRequest
from hpcshard.slurm.time import parse_time

FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
"""Job states after which a job runs no more (a requeued job passes through none)."""


def ping(timeout: float = 15) -> tuple[bool, str]:
    """Does a controller answer `scontrol ping`? (ok, what it said, last line)."""
    try:
        proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=timeout)
    except OSError as err:
        return False, f"scontrol: {err.strerror}"
    except subprocess.TimeoutExpired:
        return False, f"scontrol ping hung for {timeout:g} s"
    out = (proc.stdout + proc.stderr).strip()
    return proc.returncode == 0 and "UP" in proc.stdout, out.splitlines()[-1] if out else "no answer"


def available() -> bool:
    """Slurm's client commands are here and a controller answers."""
    return bool(shutil.which("sbatch")) and ping()[0]


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: int
    gpus_per_node: int
    max_time_s: int | None = None
    """The partition's MaxTime; None: unlimited."""


def _limit(text: str) -> int | None:
    try:
        return parse_time(text)
    except ValueError:  # infinite, UNLIMITED, n/a
        return None


def partitions() -> dict[str, Partition]:
    """From sinfo: partition, node count, and GPUs per node (gres gpu:N)."""
    if not shutil.which("sinfo"):
        raise ValueError("Slurm's client commands are not installed here (no sinfo on PATH); "
                         "submit from a login node, or use --backend local")
    proc = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%G|%l"], capture_output=True, text=True)
    if proc.returncode:
        detail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise ValueError(f"Slurm does not answer (sinfo: {detail}); check that the controller runs "
                         "and SLURM_CONF points at its slurm.conf, or use --backend local")
    out = proc.stdout
    found: dict[str, Partition] = {}
    for line in out.splitlines():
        name, count, gres, limit = line.split("|")
        gpus = re.search(r"gpu(?::[^:,(]+)?:(\d+)", gres)
        part = Partition(name=name.rstrip("*"), default=name.endswith("*"), nodes=int(count),
                         gpus_per_node=int(gpus.group(1)) if gpus else 0, max_time_s=_limit(limit))
        prev = found.get(part.name)  # one line per node state: add the counts up
        found[part.name] = part if prev is None else Partition(
            part.name, part.default or prev.default, prev.nodes + part.nodes,
            max(prev.gpus_per_node, part.gpus_per_node), part.max_time_s)
    return found


def check_request(req: SbatchRequest) -> str:
    """Refuse shapes the partition cannot run; returns the partition used."""
    parts = partitions()
    name = req.partition or next((p.name for p in parts.values() if p.default), "")
    if name not in parts:
        raise ValueError(f"--partition {req.partition!r} does not exist; partitions: "
                         + ", ".join(sorted(parts)))
    part = parts[name]
    if req.nodes > part.nodes:
        raise ValueError(f"{req.nodes} nodes (--nodes, plus --spares) is more than partition {name!r} "
                         f"has ({part.nodes})")
    if req.exclude:
        usable = usable_nodes(name, req.exclude)
        if usable is not None and req.nodes > usable:
            raise ValueError(f"the run's bad nodes ({','.join(req.exclude)}) and the nodes Slurm cannot "
                             f"use leave partition {name!r} {usable} node(s) for {req.nodes}; resume with "
                             f"fewer (--nodes, --spares 0) or in another partition")
    if req.gpus_per_node > part.gpus_per_node:
        raise ValueError(f"{req.gpus_per_node} GPUs per node (--gpus, or the profile's gpus_per_node) "
                         f"is more than the nodes of partition {name!r} have ({part.gpus_per_node}); "
                         f"use --gpus {part.gpus_per_node} or fewer")
    return name


def max_array_size(timeout: float = 30) -> int | None:
    """The cluster's MaxArraySize (an array's indices must stay below it); None: unknown."""
    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", proc.stdout, re.MULTILINE)
    return int(found.group(1)) if found and not proc.returncode else None


def job_state(job_id: str, since: float | None = None) -> dict[str, str]:
    """`scontrol show job` as a dict (works without accounting; finished jobs stay visible
    for MinJobAge), else what accounting keeps of it (`Source` is then "sacct"). Empty when
    Slurm no longer knows the job."""
    fields = show_job(job_id, timeout=30) if shutil.which("scontrol") else None
    if fields is not None:
        return fields
    runs = history([job_id], since=since)
    if not runs:
        return {}
    last = runs[-1]
    return {"JobState": last.state, "Restarts": str(len(runs) - 1), "NodeList": last.nodes,
            "RunTime": last.elapsed, "ExitCode": last.exit_code, "StartTime": last.start,
            "EndTime": last.end, "Source": "sacct"}


@dataclass(frozen=True)
class SlurmRun:
    """One run of a job as Slurm's accounting keeps it: a requeued job has one per run, in
    order (run N is the one started with SLURM_RESTART_COUNT=N)."""
    job: str
    run: int
    state: str
    """PREEMPTED, REQUEUED, NODE_FAIL, ... for the runs before a requeue; the job's own
    state for the newest."""
    exit_code: str
    """return code:signal, as sacct gives it."""
    elapsed: str
    nodes: str
    start: str
    """ISO time; "Unknown" or "None" when it never started."""
    end: str


def submitted_from(job_id: str, timeout: float = 30) -> Path | None:
    """The directory whose sbatch script accounting says the job was submitted with
    (SubmitLine: `sbatch RUN_DIR/submitit/submission_file_*.sh`): RUN_DIR, or a sweep's
    directory for ARRAY_TASK. None without accounting or for another kind of job."""
    try:
        proc = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "SubmitLine"],
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.split()
    script = next((Path(w) for w in lines if w.endswith(".sh") and "/submitit/" in w), None)
    return None if proc.returncode or script is None else script.parent.parent


SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,NodeList,Start,End"


def history(job_ids: list[str], since: float | None = None, timeout: float = 30) -> list[SlurmRun] | None:
    """Every run of these jobs from `sacct --duplicates` (accounting keeps them after
    scontrol forgets a job, MinJobAge later); None without accounting (sacct missing,
    failing as it does without slurmdbd, or hanging). `since` (Unix time: the run's
    creation): only jobs from then on, as an id may have been another job's before
    (ids wrap at MaxJobId; a cluster started afresh numbers them again)."""
    if not job_ids or not shutil.which("sacct"):
        return None
    window = ["-S", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))] if since else []
    try:
        proc = subprocess.run(["sacct", "-j", ",".join(job_ids), "--duplicates", "-X", "-n", "-P",
                               *window, "-o", SACCT_FIELDS], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode:
        return None
    return parse_history(proc.stdout, job_ids)


def parse_history(text: str, job_ids: list[str]) -> list[SlurmRun]:
    """sacct's parsable lines (SACCT_FIELDS) as runs: by job in `job_ids`' order, each job's
    runs by start time (a run that has not started last)."""
    rows: dict[str, list[list[str]]] = {job: [] for job in job_ids}
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) >= 7 and cells[0] in rows:
            rows[cells[0]].append(cells)
    runs = []
    for job in job_ids:
        ordered = sorted(rows[job], key=lambda c: (not c[5][:1].isdigit(), c[5]))
        runs += [SlurmRun(job=job, run=i, state=c[1].split()[0] if c[1] else "", exit_code=c[2],
                          elapsed=c[3], nodes=c[4], start=c[5], end=c[6])
                 for i, c in enumerate(ordered)]
    return runs


def show_job(job_id: str, timeout: float | None = None) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict, times in ISO form whatever the site's
    SLURM_TIME_FORMAT; None when scontrol is missing, fails or hangs past `timeout`."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode:
        return None
    return {key: value for key, sep, value in (t.partition("=") for t in proc.stdout.split()) if sep}


def end_time(job_id: str) -> int | None:
    """When the job's time limit ends (Unix time), for HPCSHARD_DEADLINE."""
    text = (show_job(job_id, timeout=30) or {}).get("EndTime", "")
    try:
        return int(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def usable_nodes(partition: str, exclude: list[str] | tuple[str, ...] = ()) -> int | None:
    """How many nodes of `partition` a job could still be given: responding, not down,
    drained or failed, and not in `exclude`. None: sinfo did not answer."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode:
        return None
    states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
    return sum(1 for node, state in states.items() if node not in exclude and not state.endswith("*")
               and state.rstrip("~#!%$@^-") in ("idle", "alloc", "mix", "comp", "resv", "plnd"))


def requeue(job_id: str, exclude: list[str] | tuple[str, ...] = (), nodes: int | None = None) -> str:
    """Ask Slurm to requeue this job; "" when it agreed, else what it said. A job that
    reaches its time limit is never requeued by Slurm itself (it ends TIMEOUT), so the job
    must do it before the limit. `exclude`: nodes it must not run on again (held while its
    ExcNodeList is updated, so the scheduler cannot place it first). `nodes`: fewer nodes
    than it had (what is left of the partition once those are excluded)."""
    # (Slurm changes ExcNodeList only while a job is pending. Once it is held, Slurm ends
    # the job's steps, this process among them, with TERM: the commands after it ignore TERM;
    # they take milliseconds, well inside KillWait.)
    update = [f"ExcNodeList={','.join(exclude)}", *([f"NumNodes={nodes}"] if nodes else [])]
    steps = ([["requeuehold", job_id], ["update", f"JobId={job_id}", *update], ["release", job_id]]
             if exclude or nodes else [["requeue", job_id]])
    for args in steps:
        try:
            proc = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
        except OSError as err:  # e.g. inside a container without Slurm's client commands
            return (f"scontrol: {err.strerror}; the launcher's environment (its container) "
                    "needs Slurm's client")
        if proc.returncode:
            return proc.stderr.strip() or f"scontrol {args[0]} exited {proc.returncode}"
    return ""


def drain(node: str, reason: str, state: str = "DRAIN") -> str:
    """Tell Slurm a node is bad: DRAIN with a reason (no new job lands on it; an admin reads
    why in `sinfo -R`), or DOWN for one that is gone (what Slurm does itself after
    SlurmdTimeout; until then a job step with a task on it cannot end). Needs operator
    rights; returns "" or what scontrol said."""
    try:
        proc = subprocess.run(["scontrol", "update", f"NodeName={node}", f"State={state}",
                               f"Reason={reason[:200]}"], capture_output=True, text=True, timeout=30,
                              preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return (proc.stderr.strip() or f"exit {proc.returncode}") if proc.returncode else ""


def requeued_by_other(job_id: str, restart_count: int) -> str:
    """Has something else in the job (the script's framework) requeued it already? Slurm
    counts requeues in Restarts before the steps are even killed; a second requeue would
    cost the run a whole extra attempt. Returns what Slurm says, or "" if not."""
    info = show_job(job_id, timeout=30) or {}
    restarts = int(info.get("Restarts", restart_count) or restart_count)
    state = info.get("JobState", "")
    if restarts > restart_count or state in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING"):
        return f"JobState={state} Restarts={restarts}"
    return ""


def sbatch(*args: str) -> str:
    """`sbatch --parsable ARGS`: the new job's id, or ValueError with sbatch's own last line."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    except OSError as err:
        raise ValueError(f"cannot run sbatch ({err.strerror}); run this where Slurm's commands are") from None
    if proc.returncode:
        said = proc.stderr.strip().splitlines()
        raise ValueError(f"sbatch refused the job: {said[-1] if said else 'no message'}")
    return proc.stdout.strip().split(";")[0]


def scancel(*args: str) -> None:
    """`scancel ARGS`; ValueError with scancel's message when it fails."""
    try:
        proc = subprocess.run(["scancel", *args], capture_output=True, text=True)
    except OSError as err:
        raise ValueError(f"cannot run scancel ({err.strerror}); run this where Slurm's "
                         "commands are") from None
    if proc.returncode:
        raise ValueError(f"scancel {' '.join(args)}: {proc.stderr.strip()}")


QUERY_TIMEOUT_S = 30.0
"""How long a query of one job's state may take before Slurm counts as not answering."""


def job_alive(job_id: str, timeout: float | None = None) -> bool | None:
    """Is the job still alive (pending, running, requeued, completing)? False when it is in
    a final state or Slurm says it does not know it (forgotten after MinJobAge: over long
    ago); None when Slurm did not answer (scontrol missing, failing or hanging): never to be
    taken for "over" (a second job on a live run would be the result)."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                              text=True, timeout=timeout or QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode == 0:
        state = next((t.partition("=")[2] for t in proc.stdout.split() if t.startswith("JobState=")), "")
        return bool(state) and state not in FINAL_STATES
    if "Invalid job id" in proc.stderr:
        return False
    return None
