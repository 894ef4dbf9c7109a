"""Slurm's client commands, each asked in one place: what the cluster offers (sinfo),
what a job is doing (scontrol, sacct), and what to do to one (sbatch, scancel, scontrol
requeue, release, update). Stdlib: the login node and the launchers inside an allocation
both use it. Every command may be missing (a container without Slurm's client) or hang (a
controller that does not answer): each runs under a timeout, with a bounded retry where
repeating it is safe (`client`, whose `Reply` says how it ended and never raises).

One error convention, for every function here:

- A query (ping, available, max_array_size, submitted_from, history, query_job,
  job_alive, show_job, job_state, time_left, usable_nodes, requeued_by_other) never
  raises: that Slurm did not answer is part of its typed answer. None where one value is
  asked (None: unknown, and never taken for "no"), `JobQuery.said` where "no such job"
  and "no answer" decide different things, ping's (ok, what it said).
- A command (sbatch, scancel, requeue, release, drain) raises `SlurmError` when it did not
  do what was asked, with Slurm's own last line (and how often it was tried); what one
  that did it has to say besides is its return value (sbatch's id, a requeue's note).
  So do `partitions` and `check_request`, the first steps of a submission, which cannot
  go on without them. SlurmError is a ValueError: the CLI prints it as one line and exits
  2, and a launcher catches it where it goes on without (a drain, a guard's cancel)."""

from __future__ import annotations

import enum
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcshard.slurm import client
from hpcshard.slurm.arrays import array_limit
from hpcshard.slurm.sbatch import SbatchRequest
from hpcshard.slurm.states import JobState, parse
from hpcshard.slurm.time import hms, parse_limit, parse_time


class SlurmError(ValueError):
    """A Slurm command did not do what was asked; the message is Slurm's own (last line)."""


def ping(timeout: float = 15) -> tuple[bool, str]:
    """Does a controller answer `scontrol ping`? (ok, what it said, last line)."""
    reply = client.run_once(["scontrol", "ping"], timeout)
    if reply.code is None:
        return False, reply.err
    out = (reply.out + reply.err).strip()
    return reply.ok and "UP" in reply.out, out.splitlines()[-1] if out else "no answer"


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
        raise SlurmError("Slurm's client commands are not installed here (no sinfo on PATH); "
                         "submit from a login node, or use --backend local")
    reply = client.run(["sinfo", "-h", "-o", "%P|%D|%G|%l"], tries=2, retry=_blip)
    if not reply.ok:
        raise SlurmError(f"Slurm does not answer (sinfo: {reply.said}); check that the controller runs "
                         "and SLURM_CONF points at its slurm.conf, or use --backend local")
    out = reply.out
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
        raise SlurmError(f"--partition {req.partition!r} does not exist; partitions: "
                         + ", ".join(sorted(parts)))
    part = parts[name]
    if req.nodes > part.nodes:
        raise SlurmError(f"{req.nodes} nodes (--nodes, plus --spares) is more than partition {name!r} "
                         f"has ({part.nodes})")
    if req.exclude:
        usable = usable_nodes(name, req.exclude)
        if usable is not None and req.nodes > usable:
            raise SlurmError(f"the run's bad nodes ({','.join(req.exclude)}) and the nodes Slurm cannot "
                             f"use leave partition {name!r} {usable} node(s) for {req.nodes}; resume with "
                             f"fewer (--nodes, --spares 0) or in another partition")
    if req.gpus_per_node > part.gpus_per_node:
        raise SlurmError(f"{req.gpus_per_node} GPUs per node (--gpus, or the profile's gpus_per_node) "
                         f"is more than the nodes of partition {name!r} have ({part.gpus_per_node}); "
                         f"use --gpus {part.gpus_per_node} or fewer")
    return name


def _blip(reply: client.Reply) -> bool:
    """Retry a query only after a transient failure that came back by itself (a hung one
    has cost its whole timeout already: its caller hears "no answer")."""
    return reply.blip


def max_array_size(timeout: float | None = None) -> int | None:
    """The most tasks one job array may have here (`arrays.array_limit`: MaxArraySize, an
    array's indices stay below it, or a lower max_array_tasks); None: unknown."""
    reply = client.run(["scontrol", "show", "config"], timeout=timeout, tries=2, retry=_blip)
    return array_limit(reply.out) if reply.ok else None


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


def submitted_from(job_id: str, timeout: float | None = None) -> Path | None:
    """The directory whose sbatch script accounting says the job was submitted with
    (SubmitLine: `sbatch RUN_DIR/submitit/submission_file_*.sh`): RUN_DIR, or a sweep's
    directory for ARRAY_TASK. None without accounting or for another kind of job."""
    reply = client.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "SubmitLine"], timeout=timeout,
                       tries=2, retry=_blip)
    script = next((Path(w) for w in reply.out.split() if w.endswith(".sh") and "/submitit/" in w), None)
    return None if not reply.ok or script is None else script.parent.parent


SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,NodeList,Start,End"


def history(job_ids: list[str], since: float | None = None,
            timeout: float | None = None) -> list[SlurmRun] | None:
    """Every run of these jobs from `sacct --duplicates` (accounting keeps them after
    scontrol forgets a job, MinJobAge later); None without accounting (sacct missing,
    failing as it does without slurmdbd, or hanging). `since` (Unix time: the run's
    creation): only jobs from then on, as an id may have been another job's before
    (ids wrap at MaxJobId; a cluster started afresh numbers them again)."""
    if not job_ids or not shutil.which("sacct"):
        return None
    window = ["-S", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))] if since else []
    reply = client.run(["sacct", "-j", ",".join(job_ids), "--duplicates", "-X", "-n", "-P", *window,
                        "-o", SACCT_FIELDS], timeout=timeout, tries=2, retry=_blip,
                       env={"SLURM_TIME_FORMAT": "standard"})
    return parse_history(reply.out, job_ids) if reply.ok else None


def expand_array(job: str) -> list[str]:
    """The tasks a collapsed array row names (squeue's or sacct's `12_[3-5,9%4]`: pending
    tasks, as one row) one by one: 12_3, 12_4, 12_5, 12_9; any other id as it is."""
    found = re.fullmatch(r"(\d+)_\[([\d,\-]+)(?:%\d+)?\]", job)
    if not found:
        return [job]
    base, spans = found.groups()
    tasks = []
    for span in spans.split(","):
        low, _, high = span.partition("-")
        tasks += [f"{base}_{i}" for i in range(int(low), int(high or low) + 1)] if low else []
    return tasks


def parse_history(text: str, job_ids: list[str]) -> list[SlurmRun]:
    """sacct's parsable lines (SACCT_FIELDS) as runs: by job in `job_ids`' order, each job's
    runs by start time (a run that has not started last)."""
    rows: dict[str, list[list[str]]] = {job: [] for job in job_ids}
    for line in text.splitlines():
        cells = line.split("|")
        # (an array's pending tasks are one row, 12_[3-5]: each task's)
        for job in expand_array(cells[0]) if len(cells) >= 7 else []:
            if job in rows:
                rows[job].append([job, *cells[1:]])
    runs = []
    for job in job_ids:
        ordered = _resized(sorted(rows[job], key=lambda c: (not c[5][:1].isdigit(), c[5])))
        runs += [SlurmRun(job=job, run=i, state=c[1].split()[0] if c[1] else "", exit_code=c[2],
                          elapsed=c[3], nodes=c[4], start=c[5], end=c[6])
                 for i, c in enumerate(ordered)]
    return runs


def _resized(rows: list[list[str]]) -> list[list[str]]:
    """One run for a job resized while it ran: accounting ends its record there (state
    RESIZING) and starts another from the resize on. A --no-kill job is resized when it
    loses a node (Slurm drops a node set DOWN; `launch.release` gives a lost one up): not
    a requeue, so the record before joins the one after (its start, its nodes, the time
    of both)."""
    out: list[list[str]] = []
    for row in rows:
        before = out[-1] if out else None
        if before is not None and before[1].split()[:1] == [JobState.RESIZING.value]:
            out[-1] = [*row[:3], _elapsed(before[3], row[3]), *before[4:6], row[6]]
        else:
            out.append(row)
    return out


def _elapsed(*parts: str) -> str:
    """sacct's Elapsed of several records, added up (as written when one does not parse)."""
    try:
        return hms(sum(parse_limit(p) or 0 for p in parts))
    except ValueError:
        return parts[-1]


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says of one job: scontrol's fields (`of_scontrol`), or what accounting
    keeps of it once scontrol has forgotten it (`of_runs`: `from_accounting`)."""

    job: str
    state: JobState
    state_text: str
    """Slurm's own word for the state, as shown (a word `states` does not know included)."""
    restarts: int | None = None
    """Requeues so far; None: not said."""
    nodes: str = ""
    run_time: str = ""
    exit_code: str = ""
    """return code:signal."""
    start: str = ""
    end: str = ""
    """When it ended, or when its time limit ends (ISO time)."""
    reason: str = ""
    """Why it is pending (scontrol only)."""
    stdout: str = ""
    """Its batch script's StdOut path (scontrol only)."""
    batch_host: str = ""
    partition: str = ""
    from_accounting: bool = False
    array_job: str = ""
    """The job array it belongs to (ArrayJobId; scontrol only). Asked by that id, scontrol
    answers with every task of the array, one line each: these fields are one task's."""
    time_limit: str = ""
    """TimeLimit as scontrol prints it ([D-]HH:MM:SS, UNLIMITED; scontrol only)."""

    @classmethod
    def of_scontrol(cls, job: str, fields: dict[str, str]) -> JobInfo:
        """From `scontrol show job -o`'s KEY=VALUE fields."""
        get = fields.get
        restarts = get("Restarts", "")
        return cls(job, parse(get("JobState", "")), get("JobState", ""),
                   int(restarts) if restarts.isdigit() else None, get("NodeList", ""), get("RunTime", ""),
                   get("ExitCode", ""), get("StartTime", ""), get("EndTime", ""), get("Reason", ""),
                   get("StdOut", ""), get("BatchHost", ""), get("Partition", ""),
                   array_job=get("ArrayJobId", ""), time_limit=get("TimeLimit", ""))

    @classmethod
    def forgotten(cls, job: str) -> JobInfo:
        """A job Slurm no longer knows (or did not answer about): nothing to show."""
        return cls(job, JobState.UNKNOWN, "")

    @classmethod
    def of_runs(cls, runs: list[SlurmRun]) -> JobInfo:
        """From accounting's runs of one job: the newest, and how many came before it."""
        last = runs[-1]
        return cls(last.job, parse(last.state), last.state, len(runs) - 1, last.nodes, last.elapsed,
                   last.exit_code, last.start, last.end, from_accounting=True)


def job_state(job_id: str, since: float | None = None) -> JobInfo | None:
    """What scontrol says of a job (works without accounting; finished jobs stay visible
    for MinJobAge), else what accounting keeps of it. None when Slurm no longer knows the
    job, or did not answer: good enough to show (status, ls); what decides whether a job
    is over asks `query_job`, which tells the two apart."""
    info = show_job(job_id) if shutil.which("scontrol") else None
    if info is not None:
        return info
    runs = history([job_id], since=since)
    return JobInfo.of_runs(runs) if runs else None


class Said(enum.Enum):
    """What the controller said when asked about a job."""

    KNOWN = "known"
    """It answered with the job's fields (pending, running, requeued, or ended within
    MinJobAge)."""
    NO_SUCH_JOB = "no such job"
    """It answered "Invalid job id specified": it has forgotten the job (MinJobAge, 300 s
    by default, after it ended) or never had it. Either way nothing of it runs."""
    NO_ANSWER = "no answer"
    """scontrol is missing, failed otherwise, or hung past its timeout: the job may well
    be running. Never to be taken for "over" (a second job would race a live one)."""


@dataclass(frozen=True)
class JobQuery:
    """`scontrol show job` of one job, as a typed answer."""

    job: str
    said: Said
    info: JobInfo | None = None
    """What scontrol said of it (KNOWN only), times in ISO form."""
    error: str = ""
    """Why there was no answer (NO_ANSWER only)."""

    @property
    def state(self) -> JobState:
        return self.info.state if self.info else JobState.UNKNOWN

    @property
    def over(self) -> bool | None:
        """True: the job runs no more (a final state, or the controller forgot it); False:
        it is pending, running, or on its way back through the queue; None: unknown."""
        if self.said is Said.NO_ANSWER:
            return None
        return self.said is Said.NO_SUCH_JOB or self.state.over


def query_job(job_id: str, timeout: float | None = None) -> JobQuery:
    """Ask the controller about `job_id` (scontrol only: accounting's record may lag the
    controller's and cannot say a job is alive). A transient failure is asked again once;
    a hang is not (it has cost the whole timeout, client.TIMEOUT_S by default)."""
    reply = client.run(["scontrol", "show", "job", "-o", job_id], timeout=timeout, tries=2, retry=_blip,
                       env={"SLURM_TIME_FORMAT": "standard"})
    if reply.says("Invalid job id specified"):
        return JobQuery(job_id, Said.NO_SUCH_JOB)
    fields = {key: value for key, sep, value in (t.partition("=") for t in reply.out.split()) if sep}
    if not reply.ok or "JobState" not in fields:
        return JobQuery(job_id, Said.NO_ANSWER, error=reply.said or "scontrol printed no job")
    return JobQuery(job_id, Said.KNOWN, JobInfo.of_scontrol(job_id, fields))


def job_alive(job_id: str, timeout: float | None = None) -> bool | None:
    """Is this job pending or running (a requeued one counts)? True, False (Slurm says it
    is over or has forgotten it), or None: Slurm did not answer, so nobody may act as if it
    were over (a lease on the run, `resume`)."""
    over = query_job(job_id, timeout).over
    return None if over is None else not over


def show_job(job_id: str, timeout: float | None = None) -> JobInfo | None:
    """What `scontrol show job` says of a job, times in ISO form whatever the site's
    SLURM_TIME_FORMAT; None when scontrol is missing, fails or hangs past `timeout`, or
    the controller has forgotten the job (`query_job` tells these apart)."""
    return query_job(job_id, timeout).info


def time_left(job_id: str) -> float | None:
    """Seconds left of the job's time limit: its TimeLimit less its RunTime, two durations,
    for the time-limit stop (`launch.slurm.limit_ends`). Not EndTime: a time of day, which
    only means "now" on a clock that agrees with the controller's.

    scontrol works RunTime out itself, as the asking host's clock's now less the
    controller's StartTime (slurm_sprint_job_info), so a host whose wall clock is off has its
    offset in this answer too; what the ranks plan with is bounded by the notice, which the
    controller sends on its own clock (`runtime.train.stop_time`). On a host whose clock is
    behind by more than the job has run (a launcher asks as the job starts) RunTime is
    negative, which scontrol prints as INVALID: taken as 0, the whole limit left, too much
    by what the job has run, as much as the host's clock is behind at most. None: no limit
    (UNLIMITED, a partition's), or Slurm did not answer (no client in the container, a
    controller that is down): no deadline from Slurm, and every notice stops at once."""
    info = show_job(job_id, timeout=30)
    if info is None:
        return None
    try:
        limit = parse_limit(info.time_limit)
        # (00:00:00 reads as "no limit" to parse_limit: none ran)
        ran = 0 if info.run_time == "INVALID" else parse_limit(info.run_time) or 0
    except ValueError:  # "Partition_Limit", or nothing said
        return None
    return None if limit is None else float(max(0, limit - ran))


def usable_nodes(partition: str, exclude: list[str] | tuple[str, ...] = ()) -> int | None:
    """How many nodes of `partition` a job could still be given: responding, not down,
    drained or failed, and not in `exclude`. None: sinfo did not answer."""
    reply = client.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"], tries=2, retry=_blip)
    if not reply.ok:
        return None
    states = dict(line.split() for line in reply.out.splitlines() if len(line.split()) == 2)
    return sum(1 for node, state in states.items() if node not in exclude and not state.endswith("*")
               and state.rstrip("~#!%$@^-") in ("idle", "alloc", "mix", "comp", "resv", "plnd"))


REQUEUE_BUDGET_S = 60.0
"""How long a requeue keeps trying through a controller that does not answer, at least
(`requeue_budget`). It runs after the notice (signal_lead, 120 s by default, before the
time limit) and the save, and a job that reaches its limit ends TIMEOUT, which Slurm never
requeues; but only a controller ends a job at its limit, and one that does not answer
ends none."""
SLURMCTLD_TIMEOUT_S = 120.0
"""Slurm's default SlurmctldTimeout: how long a backup controller waits for the primary to
answer before it takes control (slurm.conf(5))."""
FAILOVER_FACTOR = 2.0
"""A requeue outlasts this many SlurmctldTimeouts: the backup takes control one of them
after the primary's last answer and loads the saved state; Slurm's own clients wait 1.5 of
them for it (src/common/slurm_protocol_api.c), and one more try follows."""
HELD_BUDGET_S = 20.0
"""Once `requeuehold` took, Slurm ends the job's steps, this launcher among them: TERM
(ignored) and KILL KillWait later (30 s by default). The update and the release that must
follow are done by then."""
ALREADY_REQUEUED = "Job is pending execution"
"""ESLURM_JOB_PENDING: what a requeue of a job that is already back in the queue gets. The
job this launcher runs in cannot be pending unless a requeue took (ours, whose answer was
lost, or the job's own): the requeue is done."""


def slurmctld_timeout() -> float:
    """The site's SlurmctldTimeout, from the slurm.conf this client reads (SLURM_CONF, which
    slurmd sets in every job, to its cached copy on a configless site; else /etc/slurm) and
    the files it includes (an HA site keeps its controllers' lines in one): asked of no
    controller, for the one asked may be the one that is down. SLURMCTLD_TIMEOUT_S where
    the files do not say (or cannot be read)."""
    found = _conf_values(Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"), "SlurmctldTimeout")
    return float(found[-1]) if found else SLURMCTLD_TIMEOUT_S


INCLUDE_DEPTH = 4
"""How deep `Include` directives are followed (Slurm refuses a file that includes itself)."""


def _conf_values(path: Path, key: str, depth: int = 0) -> list[str]:
    """The values of `key` in slurm.conf `path` in the order Slurm reads them, those of the
    files it includes where they stand (`Include NAME`: relative to its directory, a glob
    allowed); a file that cannot be read says nothing."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    found: list[str] = []
    for line in text.splitlines():
        if m := re.match(r"\s*include\s+(\S+)", line, re.IGNORECASE):
            if depth < INCLUDE_DEPTH:
                name = path.parent / m[1]  # (an absolute name stays as it is)
                for each in sorted(name.parent.glob(name.name)) if "*" in name.name else [name]:
                    found += _conf_values(each, key, depth + 1)
        elif m := re.match(rf"\s*{key}\s*=\s*(\d+)", line, re.IGNORECASE):
            found.append(m[1])
    return found


def requeue_budget() -> float:
    """How long a requeue keeps trying through a controller that does not answer: through a
    fail-over to the backup controller (FAILOVER_FACTOR x SlurmctldTimeout: 240 s by
    default), and REQUEUE_BUDGET_S at least. Giving up sooner stops a run that the backup
    would have requeued; trying on costs nothing while no controller answers, since none
    ends the job meanwhile (its time limit is a controller's to enforce)."""
    return max(REQUEUE_BUDGET_S, FAILOVER_FACTOR * slurmctld_timeout())


def _scontrol(args: list[str], deadline: float) -> client.Reply:
    """An scontrol action on this job that is safe to repeat (requeue, update, release),
    retried through transient failures as often as `deadline` allows, and outliving the TERM
    that a requeue brings."""
    return client.run(["scontrol", *args], tries=sys.maxsize, deadline=deadline, ignore_term=True)


def _requeued(reply: client.Reply) -> bool:
    return reply.ok or reply.says(ALREADY_REQUEUED)


def _tried(reply: client.Reply) -> str:
    """What went wrong, in one line, and how often it was tried."""
    if reply.code is None and not reply.hung:  # e.g. inside a container without Slurm's client
        return f"{reply.err}; the launcher's environment (its container) needs Slurm's client"
    return reply.said + (f" ({reply.tries} tries)" if reply.tries > 1 else "")


def requeue(job_id: str, exclude: list[str] | tuple[str, ...] = (), nodes: int | None = None) -> str:
    """Ask Slurm to requeue this job. A job that reaches its time limit is never requeued
    by Slurm itself (it ends TIMEOUT), so the job must do it before the limit. `exclude`:
    nodes it must not run on again (held while its ExcNodeList is updated, so the
    scheduler cannot place it first). `nodes`: fewer nodes than it had (what is left of
    the partition once those are excluded). Transient failures are retried for up to
    `requeue_budget` (through a fail-over to the backup controller); a `release` follows
    every `requeuehold` that may have taken.
    Returns what went wrong besides, in one line ("" when nothing did: a queued job may
    keep the nodes it had, its ExcNodeList not changed); SlurmError when the job is not
    known to be back in the queue (it will not start again by itself)."""
    deadline = time.monotonic() + requeue_budget()
    if not (exclude or nodes):
        reply = _scontrol(["requeue", job_id], deadline)
        if not _requeued(reply):
            raise SlurmError(f"scontrol requeue: {_tried(reply)}")
        return ""
    # Slurm changes ExcNodeList only while a job is pending: hold it, update, release.
    hold = _scontrol(["requeuehold", job_id], deadline)
    if not _requeued(hold) and not hold.transient:  # refused: nothing is held
        raise SlurmError(f"scontrol requeuehold: {_tried(hold)}")
    # Held, or maybe (its answer was lost): the release follows whatever the update does,
    # else the job stays held for good. The update gets half the time the release has.
    held = time.monotonic()
    update = [f"ExcNodeList={','.join(exclude)}", *([f"NumNodes={nodes}"] if nodes else [])]
    changed = _scontrol(["update", f"JobId={job_id}", *update], held + HELD_BUDGET_S / 2)
    released = _scontrol(["release", job_id], held + HELD_BUDGET_S)
    said = ([] if _requeued(hold) else [f"requeuehold: {_tried(hold)}"]) + (
        [] if changed.ok else [f"update: {_tried(changed)} (requeued with the nodes it had)"]) + (
        [] if released.ok else [f"release: {_tried(released)}: job {job_id} may stay held; "
                                f"release it with `scontrol release {job_id}`"])
    note = "; ".join(f"scontrol {s}" for s in said)
    if not (_requeued(hold) and released.ok):
        raise SlurmError(note)
    return note


def release(job_id: str) -> None:
    """Release a held job (submitted with --hold); SlurmError when it stays held."""
    reply = _scontrol(["release", job_id], time.monotonic() + HELD_BUDGET_S)
    if not reply.ok:
        raise SlurmError(f"scontrol release: {_tried(reply)}")


def drain(node: str, reason: str, state: str = "DRAIN") -> None:
    """Tell Slurm a node is bad: DRAIN with a reason (no new job lands on it; an admin reads
    why in `sinfo -R`), or DOWN for one that is gone (what Slurm does itself after
    SlurmdTimeout; until then a job step with a task on it cannot end). Needs operator
    rights; SlurmError with what scontrol said when it was not done. Tried once: the fault
    path waits on it."""
    reply = client.run_once(["scontrol", "update", f"NodeName={node}", f"State={state}",
                             f"Reason={reason[:200]}"], client.TIMEOUT_S, ignore_term=True)
    if not reply.ok:
        raise SlurmError(reply.said)


def shared(nodes: list[str] | tuple[str, ...], job_id: str) -> str:
    """Why `nodes` must not be set DOWN for job `job_id`: other jobs run there too (running,
    suspended or completing), or Slurm did not say; "" when none does. Slurm fails every
    job on a node set DOWN (NODE_FAIL: requeued or ended), and a job without --exclusive
    (hpcshard asks for none) may share its nodes with other users' jobs (a GPU partition
    packs jobs onto a node's free GPUs): their work must not end with this job's node."""
    reply = client.run(["squeue", "-h", "-t", "R,S,CG", "-w", ",".join(nodes), "-o", "%A"], tries=3,
                       retry=_blip)
    if not reply.ok:
        return f"squeue did not say what else runs there ({reply.said})"
    others = sorted({job for job in reply.out.split() if job != job_id})
    return f"job(s) {','.join(others)} run there too: a DOWN would end them" if others else ""


def end_step(job_id: str, step: str) -> None:
    """Cancel one step of a job (`scancel JOB.STEP`): its tasks get TERM, and its srun gives
    up waiting for a task that never answers after KillWait + 2 s (measured: 7 s here), then
    exits with the code of the tasks that did end. A TERM to this process (it is one of the
    step's tasks) does not cut it short. SlurmError with what scancel said."""
    reply = client.run_once(["scancel", f"{job_id}.{step}"], client.TIMEOUT_S, ignore_term=True)
    if not reply.ok:
        raise SlurmError(reply.said)


def requeued_by_other(job_id: str, restart_count: int) -> str:
    """Has something else in the job (the script's framework) requeued it already? Slurm
    counts requeues in Restarts before the steps are even killed; a second requeue would
    cost the run a whole extra attempt. Returns what Slurm says, or "" if not."""
    info = show_job(job_id)
    if info is None:
        return ""
    restarts = restart_count if info.restarts is None else info.restarts
    if restarts > restart_count or info.state.requeued:
        return f"JobState={info.state_text} Restarts={restarts}"
    return ""


def sbatch(*args: str, unique: bool = False, timeout: float | None = None,
           unset: Sequence[str] = ()) -> str:
    """`sbatch --parsable ARGS` (the script last): the new job's id, or SlurmError with
    sbatch's own last line. sbatch's warnings on success go to stderr.

    sbatch is not idempotent: sent twice, it makes two jobs. It is sent again only after a
    failure that proves the controller never got it (`client.UNSENT`: no connection, and
    Slurm's client has already tried for MessageTimeout). After one that leaves it open
    (our timeout, "Socket timed out", a dropped connection: the controller may have made
    the job and lost only its reply) it is not: with `unique` (no job was ever submitted
    from this script path: submitit's `.submission_file_<uuid>.sh`) the job is looked for
    in squeue by that path; otherwise, or when it is not there, the error says that a job
    may have been made. (A stray one would not train: only a run's newest recorded job
    does, `RunSpec.newest_job`.) `unset`: variables of this environment sbatch must not
    read (its input variables, SBATCH_*, override the script's directives)."""
    reply = client.run(["sbatch", "--parsable", *args], tries=3, retry=lambda r: r.unsent,
                       timeout=client.SBATCH_TIMEOUT_S if timeout is None else timeout,
                       env=dict.fromkeys(unset) if unset else None)
    if reply.ok:
        if reply.err:
            print(reply.err, file=sys.stderr)
        return reply.out.strip().split(";")[0]
    if reply.code is None and not reply.hung:
        raise SlurmError(f"{reply.err}; run this where Slurm's commands are")
    if not reply.transient or reply.unsent:  # the controller's answer, or it was never reached
        raise SlurmError(f"sbatch refused the job: {_tried(reply)}")
    found = _submitted(args[-1]) if unique and args else None
    if found:
        return found
    raise SlurmError(f"sbatch got no clear answer ({reply.said}); the job may have been submitted "
                     "all the same: look with `squeue --me` before submitting again")


def _submitted(script: str) -> str | None:
    """The job (its array's id, for an array) submitted from this script path, if the
    controller has it (sbatch records the script's full path as the job's command)."""
    reply = client.run(["squeue", "--me", "-h", "-t", "all", "-o", "%A|%o"], tries=3, retry=_blip)
    path = os.path.abspath(script)
    return next((job.strip() for job, _, command in (line.partition("|") for line in reply.out.splitlines())
                 if command.strip() == path), None) if reply.ok else None


def scancel(*args: str) -> None:
    """`scancel ARGS`; SlurmError with scancel's message when it fails. A cancel is safe to
    repeat: it is sent again after a transient failure (not after a hang: the user, or the
    launcher, has waited the whole timeout already), and then a job already gone counts as
    cancelled (the first one took, and only its answer was lost)."""
    reply = client.run(["scancel", *args], tries=3, retry=_blip)
    if reply.ok or (reply.tries > 1 and reply.says("Invalid job id", "already completing or completed")):
        return
    if reply.code is None and not reply.hung:
        raise SlurmError(f"{reply.err}; run this where Slurm's commands are")
    raise SlurmError(f"scancel {' '.join(args)}: {_tried(reply)}")


def depend(job_id: str, dependency: str) -> None:
    """Set a pending job's dependency (`KIND:JOB`): a run's follower moved onto the job that
    continues the run. SlurmError with scontrol's word when it was not done (the job has
    started or ended meanwhile: nothing to move)."""
    reply = client.run(["scontrol", "update", f"JobId={job_id}", f"Dependency={dependency}"], tries=3,
                       retry=_blip)
    if not reply.ok:
        raise SlurmError(f"scontrol update JobId={job_id} Dependency={dependency}: {_tried(reply)}")
