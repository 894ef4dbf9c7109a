"""Slurm actions the batch script takes for the launchers, where they have no Slurm client.

A launcher that runs in a container (pyxis/enroot, Apptainer) has no `scontrol` unless the
site binds one in. The batch script runs outside the container, on the batch host, where
the client is: the launcher that sends the job on writes what it decided (`HostActions`:
drain and DOWN nodes, requeue with the run's bad nodes excluded) whole into the file the
script named in HPCSHARD_HOST_ACTIONS, and the script's `host` block runs the commands once
srun has returned (templates/sbatch.j2). Which way each action goes is `way`:

- requeue, drain, DOWN: on the batch host. A drain waits for the job's step to end (the
  run already never uses the node again); a requeue comes after srun returns, as it would
  from the launcher, whose requeue kills the step anyway.
- a chain's continuation job, a guard job: not at all (they need the run's bookkeeping
  right after sbatch: the new job's pickle, attempt and lease): the run stops with its
  checkpoint and says so; `hpcshard resume` continues it. Bind the client in for them.
- lookups (the job's end time, its partition, whether something else requeued it): none;
  the launcher goes on without (no deadline from Slurm, the requeue asks for the nodes the
  job had).
- the release of a run that is over while a lost node holds its step (`launch.release`):
  on the batch host, client or not, while srun still runs: the `host_setup` block's watch
  reads the file once a second and acts on a `release` line (`StepRelease`) while srun
  runs, not after it returns (srun waits for the lost node's task until SlurmdTimeout).

The file is the batch script's own: it exists (empty) before srun starts, so a launcher's
write replaces a name the batch host already knows (on NFS a new name can stay invisible
to another host for the directory's cache time; a rename over a known one is read fresh).
A batch host lost with its node never reads it: the job then ends (NODE_FAIL or FAILED,
never requeued by Slurm with --no-kill's batch step gone) and the run waits, its newest
checkpoint committed, for `hpcshard resume`."""

from __future__ import annotations

import enum
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcshard.rundir.files import locked, write_atomic

ENV = "HPCSHARD_HOST_ACTIONS"
"""The batch script's file for this job run (exported before srun; unset: a script from
before host actions, or a site template that dropped the `host_setup` block)."""
HEADER = "hpcshard-host-actions 1"
END = "end"
"""The last line: the script acts on a file that has it (whole), and on nothing else."""
DEFERRED = "no Slurm client in the launcher's environment: left to the batch script"
"""A bad node's `drain_error` when its drain waits for the batch script (`pending_drains`)."""
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_JOB = re.compile(r"\d+(_\d+)?")


class Way(enum.Enum):
    """Where a launcher's Slurm action is done."""

    HERE = "here"
    """The launcher runs the command itself (Slurm's client is on its PATH)."""
    HOST = "host"
    """Written for the batch script, which runs it after srun returns."""
    NONE = "none"
    """Not done: the run says why (a line in the log, a ledger record where it matters)."""


HOST_ACTIONS = frozenset({"requeue", "drain"})
"""What the batch script knows how to do (`drain` covers DOWN)."""
WATCH_ENV = "HPCSHARD_HOST_WATCH"
"""Exported (1) by a batch script whose `host_setup` block watches the host file while srun
runs (`release` lines: `launch.release`); unset: a script from before the watch, or a site
template that replaced `host_setup`."""
_STEP = re.compile(r"\d+\.\d+")


def way(action: str, client: bool, host_file: str | None) -> Way:
    """Where `action` (requeue, drain, chain, guard, lookup) goes: here when the launcher
    has the Slurm command it needs (`client`: `has_client(action)`), else on the batch
    host when the script has the host side and the action is one it does, else nowhere."""
    if client:
        return Way.HERE
    return Way.HOST if host_file and action in HOST_ACTIONS else Way.NONE


NEEDS = {"chain": "sbatch", "guard": "sbatch", "release": "scancel"}
"""The Slurm command each action needs; scontrol for the others."""


def has_client(action: str = "requeue") -> bool:
    """The Slurm command `action` needs is on this process's PATH."""
    return bool(shutil.which(NEEDS.get(action, "scontrol")))


def host_file() -> str | None:
    """The batch script's file for this job run (HPCSHARD_HOST_ACTIONS), if it has one."""
    return os.environ.get(ENV) or None


def watched() -> bool:
    """Does this job's batch script act on a release while srun still runs (`WATCH_ENV`)?"""
    return os.environ.get(WATCH_ENV) == "1" and host_file() is not None


def missing(action: str) -> str:
    """The log line for an action that cannot be done without Slurm's client here."""
    where = ("the batch script runs it after srun returns" if way(action, False, host_file()) is Way.HOST
             else "it is not done")
    return (f"hpcshard: no Slurm client ({NEEDS.get(action, 'scontrol')}) on this launcher's PATH (a "
            f"container without one?): {action}: {where}")


@dataclass(frozen=True)
class Drain:
    nodes: list[str]
    state: str
    """DRAIN (bad: no new job on it) or DOWN (lost: a step with a task on it cannot end)."""
    reason: str


@dataclass(frozen=True)
class StepRelease:
    """A run that is over gives its lost nodes up (`launch.release`): the batch script's
    watch sets `down` DOWN (none, or refused: cancels `step`) while srun still waits for
    their tasks, then exits with `code` whatever srun says after."""

    step: str
    """JOB.STEP, the launchers' step (the job's own id: an array task's too)."""
    code: int
    """The batch script's exit code once it released the step (the job's: `chain.job_exit`)."""
    down: list[str]
    """The lost nodes to set DOWN; none: the step is cancelled."""
    reason: str

    def line(self) -> str:
        if not _STEP.fullmatch(self.step) or not 0 <= self.code <= 255:
            raise ValueError(f"release of step {self.step!r} with exit code {self.code}")
        down = _nodes(self.down) if self.down else "-"
        return f"release {self.step} {self.code} {down} {_reason(self.reason)}"


@dataclass(frozen=True)
class HostActions:
    """What the batch script does once srun returns: drains first (a DOWN of a lost node
    lets the requeued job leave COMPLETING), then the requeue (which ends the script)."""

    job: str = ""
    """The job to requeue (SlurmEnv.ref); "" for none."""
    exclude: list[str] = field(default_factory=list)
    nodes: int | None = None
    """Fewer nodes for the requeued job; None: as many as it had."""
    drains: list[Drain] = field(default_factory=list)
    release: StepRelease | None = None
    """Acted on while srun runs (the `host_setup` block's watch), not after it returns."""

    def text(self) -> str:
        """The file's text: one action a line, fields apart by one space, values checked
        here so that bash's `read` takes them as they are (no quoting, no eval)."""
        lines = [HEADER]
        for d in self.drains:
            if d.state not in ("DRAIN", "DOWN") or not d.nodes:
                raise ValueError(f"drain state {d.state!r} of {d.nodes} is not DRAIN or DOWN")
            lines.append(f"drain {_nodes(d.nodes)} {d.state} {_reason(d.reason)}")
        if self.release:
            lines.append(self.release.line())
        if self.job:
            if not _JOB.fullmatch(self.job) or (self.nodes is not None and self.nodes < 1):
                raise ValueError(f"requeue of job {self.job!r} on {self.nodes} nodes")
            lines.append(f"requeue {self.job} {_nodes(self.exclude) if self.exclude else '-'} "
                         f"{self.nodes or '-'}")
        return "\n".join([*lines, END]) + "\n"

    @classmethod
    def parse(cls, text: str) -> HostActions | None:
        """The actions a file holds; None for one that is empty or not whole."""
        lines = text.splitlines()
        if len(lines) < 2 or lines[0] != HEADER or lines[-1] != END:
            return None
        job, exclude, nodes, drains, release = "", [], None, [], None
        for line in lines[1:-1]:
            verb, _, rest = line.partition(" ")
            if verb == "release":
                step, code, down, why = rest.split(" ", 3)
                release = StepRelease(step, int(code), [] if down == "-" else down.split(","), why)
            elif verb == "drain":
                names, state, reason = rest.split(" ", 2)
                drains.append(Drain(names.split(","), state, reason))
            elif verb == "requeue":
                job, ex, count = rest.split(" ")
                exclude = [] if ex == "-" else ex.split(",")
                nodes = None if count == "-" else int(count)
        return cls(job, exclude, nodes, drains, release)

    def merged(self, other: HostActions | None) -> HostActions:
        """These actions and those `other` holds: its requeue and its release where these
        have none, and each of its drains these do not have."""
        if other is None:
            return self
        mine = {(tuple(d.nodes), d.state) for d in self.drains}
        drains = [*self.drains, *(d for d in other.drains if (tuple(d.nodes), d.state) not in mine)]
        requeue = self if self.job else other
        return HostActions(requeue.job, requeue.exclude, requeue.nodes, drains, self.release or other.release)

    def write(self, path: Path) -> None:
        """Whole and at once (a rename over the script's empty file), with what another
        launcher of the job wrote there already: two may write, the one that sends the job
        on and one that ended otherwise (fenced off: thawed after its peers went on without
        it), and srun returns after the later one; its drains must not take the requeue
        away."""
        with locked(path) as held:
            try:
                there = HostActions.parse(path.read_text())
            except (FileNotFoundError, UnicodeDecodeError, ValueError):
                there = None
            text = self.merged(there).text()
            held()
            write_atomic(path, text)


def _reason(text: str) -> str:
    """One line of words, as `read` gives it back (no control characters, single spaces)."""
    return " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", text).split())[:200] or "hpcshard"


def _nodes(names: list[str]) -> str:
    for name in names:
        if not _NODE.fullmatch(name):
            raise ValueError(f"node name {name!r} is not one Slurm gives")
    return ",".join(names)


def decide(run_name: str, bad: list[dict[str, Any]], job: str = "", exclude: list[str] | None = None,
           nodes: int | None = None, down_lost: bool = False) -> HostActions:
    """What the batch script is to do, from the attempt's bad-node records (`bad`): drain
    those whose drain was left to it (DEFERRED), mark the lost ones DOWN (`down_lost`:
    bad_nodes = drain, as `launch.slurm._down_lost` does with a client), and requeue `job`
    ("" for none) without `exclude`, on `nodes`."""
    reason = f"hpcshard {run_name}: "
    drains = [Drain([str(r["slurm_node"])], "DRAIN", reason + str(r.get("reason", "bad")))
              for r in bad if r.get("drain_error") == DEFERRED and r.get("slurm_node")]
    lost = sorted({str(r["slurm_node"]) for r in bad
                   if str(r.get("reason", "")).startswith("lost") and r.get("slurm_node")})
    if down_lost and lost:
        drains.append(Drain(lost, "DOWN", reason + "lost: silent"))
    return HostActions(job, list(exclude or []), nodes, drains)
