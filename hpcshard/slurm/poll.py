"""Asking Slurm about many jobs, often, without loading its controller: every job a poll
needs in one `squeue` (a job array's tasks included), and the interval doubling while
nothing changes (`Backoff`). Each scontrol/squeue/sacct call is an RPC that the controller
(or slurmdbd) answers under its locks; a job-by-job loop every second from a few hundred
followers is what makes a cluster's controller slow for everyone (submitit #1720, #1759).
Stdlib: the login node's commands use it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcshard.slurm import client
from hpcshard.slurm.cluster import JobInfo, expand_array
from hpcshard.slurm.states import parse

POLL_S = 5
"""The site's `poll_s` default: the first interval between two polls of Slurm."""
POLL_MAX_S = 60
"""The site's `poll_max_s` default: the longest interval, reached while nothing changes."""
SQUEUE_FORMAT = "%i|%T|%r|%N|%M"
"""Job (ARRAY_TASK for an array's task), state, reason, nodes, time used."""


@dataclass
class Backoff:
    """The wait before the next poll: `first`, doubled after each poll that saw no change,
    at most `cap`; back to `first` at a change."""

    first: float = POLL_S
    cap: float = POLL_MAX_S
    wait: float = field(init=False)

    def __post_init__(self) -> None:
        self.first = min(self.first, self.cap)
        self.wait = self.first

    def next(self, changed: bool) -> float:
        """The wait after a poll that saw a change (or not)."""
        self.wait = self.first if changed else min(self.cap, self.wait * 2)
        return self.wait


def queue_states(jobs: list[str], timeout: float | None = None) -> dict[str, JobInfo] | None:
    """What the controller says of these jobs, in one `squeue` (not one scontrol per job):
    each job it still knows (pending, running, or ended within MinJobAge); a job missing
    from the answer is one it has forgotten (over). None: no answer (squeue missing,
    failing or hung), never taken for "forgotten"."""
    if not jobs:
        return {}
    # `--jobs` with several ids filters one load of the queue: one RPC whatever their number.
    reply = client.run(["squeue", "-h", "-r", "-t", "all", f"--jobs={','.join(_bases(jobs))}",
                        "-o", SQUEUE_FORMAT], tries=2, retry=lambda r: r.blip)
    if reply.says("Invalid job id specified"):  # (one id, or all: every one is forgotten)
        return {}
    if not reply.ok:
        return None
    return parse_queue(reply.out)


def _bases(jobs: list[str]) -> list[str]:
    """The ids to name: an array whose tasks are asked two or more at a time by its own id
    (`-r` lists each of its tasks), a short command line for a thousand tasks."""
    tasks: dict[str, int] = {}
    for job in jobs:
        base, sep, _ = job.partition("_")
        tasks[base] = tasks.get(base, 0) + bool(sep)
    named = [base for base, n in tasks.items() if n > 1]
    return named + [job for job in dict.fromkeys(jobs) if tasks[job.partition("_")[0]] <= 1]


def parse_queue(text: str) -> dict[str, JobInfo]:
    """squeue's SQUEUE_FORMAT lines by job (a collapsed array row, by task)."""
    found = {}
    for line in text.splitlines():
        cells = line.strip().split("|")
        if len(cells) < 5 or not cells[0]:
            continue
        job, state, reason, nodes, used = cells[:5]
        for task in expand_array(job):
            found[task] = JobInfo(task, parse(state), state, nodes=nodes, run_time=used, reason=reason)
    return found


@dataclass
class Watch:
    """Follows jobs' states, one squeue per `poll` for all the jobs not yet over (a job
    over stays so: it is asked no more). `seen`: each job's newest answer (a job the
    controller forgot: over, with the state it was last seen in, or "ended")."""

    jobs: list[str]
    seen: dict[str, JobInfo] = field(default_factory=dict)
    over: set[str] = field(default_factory=set)
    answered: bool = True
    """Whether the newest poll got an answer."""

    def poll(self) -> list[str]:
        """Ask once; the jobs whose state changed (none when Slurm did not answer)."""
        asked = [job for job in self.jobs if job not in self.over]
        found = queue_states(asked)
        self.answered = found is not None
        if found is None:
            return []
        changed = []
        for job in asked:
            before = self.seen.get(job)
            info = found.get(job) or _forgotten(before, job)
            if info.state.over or job not in found:
                self.over.add(job)
            if before is None or (before.state_text, before.reason) != (info.state_text, info.reason):
                changed.append(job)
            self.seen[job] = info
        return changed

    @property
    def done(self) -> bool:
        return len(self.over) == len(set(self.jobs))


def _forgotten(before: JobInfo | None, job: str) -> JobInfo:
    """A job the controller no longer knows: it ended (MinJobAge ago, or a job it never had)."""
    if before is not None and before.state.over:
        return before
    return JobInfo(job, parse(""), "ended")
