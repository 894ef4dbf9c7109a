"""RUN_DIR/owner.json: which job or process owns the run (one at a time), stdlib only.

A run directory is written by one job at a time: its ranks commit checkpoints, clean
interrupted saves and append to the ledger. Two jobs on one run (a `resume` while the job
still runs, a guard that takes over from a job that is not dead, a thawed node) would
train two timelines into one checkpoint store. The lease says who owns the run:

    {"kind": "job", "job": "4242", "epoch": 3}          a Slurm job (or ARRAY_TASK)
    {"kind": "process", "process": {...}, "epoch": 4}   a local run's CLI, or a command that
                                                        is submitting

and RUN_DIR/owner.beat, which a live owner rewrites every RENEW_S (its token and a fresh
nonce). The beat has a file of its own so that renewing never rewrites owner.json: a
renewal that stalled (a frozen node, a file server's failover) cannot write back an owner
that was replaced meanwhile.

Each change of owner raises the epoch; an owner is `name@epoch` (its token), so a job that
was taken over and comes back (a requeue of a job a guard replaced, a node thawed) no longer
matches. Changes happen under `files.locked` (a read-modify-write that holds on NFS), and
a reader opens the file afresh each time (close-to-open consistency: a file replaced by
rename on another host is read fresh at once, unlike a new name, which NFS may hide for
its lookup cache time).

Whether the current owner is still alive is asked of whoever knows: Slurm for a job (an
unknown state is never "over": `busy` then refuses), the kernel for a process on this host
(pid and start time: a reused pid is not the owner), and for a process on another host its
beats: a live owner renews the lease every RENEW_S, and one whose beat stands still for
WATCH_S on the reader's own monotonic clock is over (no two hosts' clocks are compared).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcshard.rundir import launchers, proc
from hpcshard.rundir.files import locked, write_atomic

LEASE = "owner.json"
BEAT = "owner.beat"
RENEW_S = 5.0
"""How often a live owner renews its lease (one small file written by one process)."""
WATCH_S = 4 * RENEW_S
"""A process owner on another host whose beat did not move for this long is over."""
SUBMIT_WAIT_S = 120.0
"""How long a starting job waits for the command that submitted it to name it the owner
(sbatch returned; the command writes the lease next)."""


class Busy(ValueError):
    """The run has a live owner (or one nobody can vouch is over): nothing may take it."""


@dataclass(frozen=True)
class Process:
    """One process, wherever it runs: not just a pid (pids are reused, and equal in two
    containers or on two hosts). `rundir.proc` says who a pid is."""

    host: str
    pid: int
    start: int
    boot: str
    pidns: str = ""

    @classmethod
    def current(cls) -> Process:
        found = proc.identity(os.getpid())
        assert found is not None
        return cls(host=found["host"], pid=found["pid"], start=found["start"], boot=found["boot"],
                   pidns=found["pidns"])

    def alive(self) -> bool | None:
        """True or False where its pid can be looked up (this boot of this host, this pid
        namespace); None elsewhere, where only its beats can tell."""
        record = asdict(self)
        return proc.same(record) if proc.here(record) else None

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host}"


@dataclass(frozen=True)
class Owner:
    """Who owns the run: a Slurm job, or a process (a local run; a command submitting)."""

    kind: str
    job: str = ""
    process: Process | None = None
    epoch: int = 0
    what: str = ""
    """What the owner is doing, for the one-line refusals ("hpcshard resume", "local run")."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_job(cls, job: str) -> Owner:
        return cls(kind="job", job=job, what=f"Slurm job {job}")

    @classmethod
    def of_process(cls, what: str) -> Owner:
        return cls(kind="process", process=Process.current(), what=what)

    @property
    def name(self) -> str:
        if self.kind == "job":
            return f"job:{self.job}"
        p = self.process
        assert p is not None
        return f"process:{p.host}:{p.pid}:{p.start}"

    @property
    def token(self) -> str:
        """The owner at this epoch: what a job checks before it commits or cleans."""
        return f"{self.name}@{self.epoch}"

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Owner:
        process = Process(**d["process"]) if d.get("process") else None
        return cls(**{**d, "process": process})


def path(run_dir: Path) -> Path:
    return run_dir / LEASE


def beat_path(run_dir: Path) -> Path:
    return run_dir / BEAT


def beat(run_dir: Path) -> str:
    """The lease's last beat as written (token and nonce); "" when there is none."""
    try:
        return beat_path(run_dir).read_text()
    except FileNotFoundError:
        return ""


READ_TRIES = 3
"""Reads of the lease that a file server's transient error (ESTALE, EIO) may take."""


def read(run_dir: Path) -> Owner | None:
    """The current owner, None when the run has none (never had, or released). Opened
    afresh: another host's rename is seen at once. A lease that does not parse is nobody's
    to take: Unreadable (never None, or anyone could take a run that is in use)."""
    for attempt in range(READ_TRIES):
        try:
            text = path(run_dir).read_text()
            break
        except FileNotFoundError:
            return None
        except OSError:
            if attempt + 1 == READ_TRIES:
                raise
            time.sleep(0.2 * (attempt + 1))
    try:
        return Owner.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as err:
        raise Unreadable(f"{path(run_dir)} cannot be read ({type(err).__name__}: {err}); if no job or "
                         "command uses the run, remove it") from None


class Unreadable(Busy):
    """owner.json is there but does not parse (another version, a hand edit)."""


def owns(run_dir: Path, token: str) -> bool:
    """Does the owner with this token (`Owner.token`) still own the run? An empty token
    (a process that was never given one: a test, an older launcher) always does."""
    if not token:
        return True
    try:
        current = read(run_dir)
    except Busy:
        return False
    return current is not None and current.token == token


JobAlive = Callable[[str], "bool | None"]
"""Slurm's word on a job: True (pending, running, requeued...), False (over, or unknown
to Slurm), None (Slurm did not answer)."""


def busy(run_dir: Path, owner: Owner | None, job_alive: JobAlive, watch_s: float | None = None) -> str:
    """Why `owner` (of `run_dir`) may still be live; "" when it surely is not. A job: what
    Slurm says, and no answer is never "over". A process of this host: the kernel's answer
    (pid and start time), and the run's launchers' (a local run whose command was killed
    trains on while they run). A process of another host: whether its lease's beat moves
    within `watch_s` (this waits up to that long, reading the lease afresh each second). A
    lease that changed meanwhile is judged again by the caller (`take`)."""
    if owner is None:
        return ""
    if owner.kind == "job":
        alive = job_alive(owner.job)
        if alive is None:
            return (f"Slurm did not answer whether job {owner.job}, which owns the run, still "
                    "runs; try again when the controller answers")
        return f"Slurm job {owner.job} still owns it" if alive else ""
    assert owner.process is not None
    who = f"{owner.what or 'a command'} ({owner.process})"
    here = owner.process.alive()
    if here:
        return f"{who} still owns it"
    if here is False:  # (the local backend's launchers run on its command's host)
        pids = launchers.launchers(run_dir)
        return f"{who} is gone, but its launchers (pids {pids}) still run" if pids else ""
    watch_s = WATCH_S if watch_s is None else watch_s
    deadline, first = time.monotonic() + watch_s, beat(run_dir)
    while time.monotonic() < deadline:
        time.sleep(min(1.0, watch_s))
        now = read(run_dir)
        if now is None or now.token != owner.token:
            return CHANGED
        last = beat(run_dir)
        if last != first and last.startswith(owner.token + " "):
            return f"{who} still owns it (it renews the lease: its launchers still run?)"
    return ""


CHANGED = "the lease changed while it was judged"


def take(run_dir: Path, me: Owner, job_alive: JobAlive, watch_s: float | None = None) -> Owner:
    """Make `me` the owner (epoch + 1) and return it as written (`extra["previous"]`: the
    owner it took the run from, for `release(restore=True)`); when `me` owns the run already
    (another launcher of the same job took it first), the lease as it is. Refused (Busy,
    with the reason) while the current owner may be live (`busy`). The owner is judged
    outside the lock (asking Slurm, or watching a beat, takes seconds) and taken under it
    only if it is still the one judged."""
    while True:
        current = read(run_dir)
        if current is not None and current.name == me.name:
            return current
        why = busy(run_dir, current, job_alive, watch_s)
        if why == CHANGED:
            continue
        if why:
            raise Busy(f"{run_dir} is in use: {why}")
        with locked(path(run_dir)) as held:
            if _token(read(run_dir)) != _token(current):
                continue  # it changed while judged: judge the new one
            new = replace(me, epoch=(current.epoch if current else 0) + 1,
                          extra={**me.extra, **({"previous": asdict(current)} if current else {})})
            held()
            write_atomic(path(run_dir), new.to_json())
            return new


def _token(owner: Owner | None) -> str | None:
    return None if owner is None else owner.token


def renew(run_dir: Path, token: str) -> bool:
    """A live owner's beat (every RENEW_S): owner.beat gets its token and a fresh nonce
    (a process's; a job's lease is only checked: Slurm answers for a job).
    False, and nothing written, when the owner with this token no longer owns the run
    (taken over: it must stop writing to the run). No lock: a beat written just after a
    take-over carries the old token, which nobody counts."""
    if not token:
        return False
    try:
        current = read(run_dir)
    except Busy:
        return False
    if current is None or current.token != token:
        return False
    if current.kind == "job":
        # Slurm says whether a job lives (`over`): its beat would be read by nobody, and
        # on the cycle's leader it was most of a node's metadata load on the run directory
        # in steady training (a create, fsync, chmod and rename every 5 s).
        return True
    write_atomic(beat_path(run_dir), f"{token} {secrets.token_hex(8)}\n")
    return True


def keep(run_dir: Path, me: Owner) -> threading.Thread:
    """Renew `me`'s lease every RENEW_S in a thread of this process until it no longer
    owns the run (handed over, released, taken): a command that holds a run for seconds or
    minutes (a preflight, a local run) stays visibly alive to hosts that cannot look its
    pid up."""

    def renewing() -> None:
        while True:
            time.sleep(RENEW_S)
            try:
                if not renew(run_dir, me.token):
                    return
            except OSError:
                continue  # a full or slow disk: try again at the next beat

    thread = threading.Thread(target=renewing, name="hpcshard-lease", daemon=True)
    thread.start()
    return thread


def hand_over(run_dir: Path, me: Owner, to: Owner) -> Owner | None:
    """`me` gives the run to `to` (a continuation job it submitted, the job a command
    submitted): `to` at the next epoch, or None when `me` did not own it any more."""
    with locked(path(run_dir)) as held:
        current = read(run_dir)
        if current is not None and current.token != me.token:
            return None
        new = replace(to, epoch=(current.epoch if current else 0) + 1)
        held()
        write_atomic(path(run_dir), new.to_json())
        return new


def release(run_dir: Path, me: Owner, restore: bool = False) -> None:
    """`me` is done with the run (a local run that ended): nobody owns it now; `restore`:
    it gives the run back to the owner it took it from (a command that took a run and then
    found it could not go on). Nothing happens when somebody else owns it."""
    with contextlib.suppress(OSError), locked(path(run_dir)) as held:
        current = read(run_dir)
        if current is None or current.token != me.token:
            return
        held()
        previous = current.extra.get("previous")
        if restore and previous:
            write_atomic(path(run_dir), Owner.from_dict(previous).to_json())
        else:
            path(run_dir).unlink()
