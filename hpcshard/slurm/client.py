"""One way to run Slurm's client commands (sbatch, scancel, scontrol, sinfo, squeue, sacct):
under a timeout, with a bounded retry where a retry is safe, and an answer that says
whether Slurm refused or did not answer at all (a `Reply`: nothing here raises; `cluster`
turns replies into its one error convention). Stdlib: the login node and the launchers
inside an allocation both use it.

What Slurm 22.05's own client does (src/common/slurm_protocol_api.c): it tries to connect to
the controller (then its backups) once a second for MessageTimeout seconds (10 by default)
and then fails with "Unable to contact slurm controller (connect failure)"; once connected,
it waits MessageTimeout for the answer and then fails with "Socket timed out on send/recv
operation". So a command normally ends, one way or the other, within about twice
MessageTimeout; sbatch alone retries by itself while the controller says it is busy (queue
full, EAGAIN: up to 15 times, sleeping 1, 2, ... 15 s). A command that runs longer than
that is stuck (a controller that accepted the connection and hangs, a frozen file system
under SLURM_CONF, a site wrapper waiting on something): it is killed at our timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

TIMEOUT_S = 30.0
"""How long one call of scontrol, scancel, sinfo, squeue or sacct may take (Slurm's own
client gives up after about 2 x MessageTimeout, 20 s by default)."""
SBATCH_TIMEOUT_S = 150.0
"""How long one sbatch may take: it waits by itself (up to 120 s) while the controller
says it is busy."""
BACKOFF_S = 1.0
"""The wait before the first retry; it doubles for each next one..."""
BACKOFF_MAX_S = 8.0
"""...up to this (the fifth try's): a retry bounded by a deadline, not a count, keeps
asking every few seconds, and goes through soon after the controller is back."""
CALLS_LOG = "HPCSHARD_SLURM_CALLS_LOG"
"""A file that gets one line per Slurm command run (its time and the command's name):
what tests and `python -m bench polling` count the controller's load by."""
calls = 0
"""Slurm commands this process has run (every try counts): a test bounds a command's
calls with it."""

TRANSIENT = ("Unable to contact slurm controller", "Socket timed out on send/recv operation",
             "Zero Bytes were transmitted or received", "standby mode", "try again",
             "Resource temporarily unavailable")
"""What Slurm says when the controller is restarting, failing over or overloaded (its
errno strings, src/common/slurm_errno.c: SLURMCTLD_COMMUNICATIONS_*,
SLURM_PROTOCOL_SOCKET_IMPL_TIMEOUT, SLURM_PROTOCOL_SOCKET_ZERO_BYTES_SENT,
ESLURM_IN_STANDBY_*, ESLURM_TRANSITION_STATE_NO_UPDATE "Job can not be altered now, try again
later", EAGAIN): the same request may well succeed a few seconds later. Anything else the
controller says (Invalid job id, Access denied, ...) is its answer, and asking again would
get the same one."""
UNSENT = ("Unable to contact slurm controller (connect failure)", "standby mode")
"""What Slurm says when the request surely never reached a controller that acts on it (no
connection, or one that answered it is a standby): the only failures after which a
request that is not idempotent (sbatch) may be sent again."""


@dataclass(frozen=True)
class Reply:
    """How one Slurm command ended."""

    args: tuple[str, ...]
    code: int | None
    """Its exit status; None when it could not run or ran past its timeout (`hung`)."""
    out: str = ""
    err: str = ""
    """Its stderr, or why it could not run."""
    hung: bool = False
    """Killed at the timeout: Slurm did not answer, and may or may not have acted."""
    tries: int = 1

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def said(self) -> str:
        """One line: what went wrong (the last line of stderr), or "" when it succeeded."""
        if self.ok:
            return ""
        lines = [line for line in self.err.splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"{_name(self.args)} exited {self.code}"

    @property
    def transient(self) -> bool:
        """No answer, or one that says to ask again (`TRANSIENT`)."""
        return self.hung or (self.code not in (0, None) and any(t in self.err for t in TRANSIENT))

    @property
    def blip(self) -> bool:
        """A transient failure that came back by itself, not at our timeout: worth asking
        again at once even for a query (a hung one has already cost the whole timeout)."""
        return self.transient and not self.hung

    @property
    def unsent(self) -> bool:
        """The request surely never reached the controller (`UNSENT`)."""
        return self.code not in (0, None) and any(t in self.err for t in UNSENT)

    def says(self, *words: str) -> bool:
        """Slurm answered (it ran and ended) with an error that contains one of `words`."""
        return self.code not in (0, None) and any(w in self.err for w in words)


def _name(args: tuple[str, ...] | list[str]) -> str:
    """The command as a person would say it: `scontrol show job`, `sbatch job.sh`."""
    return " ".join(a for a in args[:3] if not a.startswith("-"))


def _ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _environ(changes: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment with `changes` (a None value: the variable unset)."""
    out = {**os.environ, **{k: v for k, v in changes.items() if v is not None}}
    return {k: v for k, v in out.items() if changes.get(k, "") is not None}


def run_once(args: list[str], timeout: float, *, ignore_term: bool = False,
             env: Mapping[str, str | None] | None = None) -> Reply:
    """Run one Slurm command under `timeout`. `ignore_term`: the command must outlive a
    TERM (Slurm ends this job's steps with TERM once it is requeued; the commands that
    follow a requeuehold must still run). `env`: variables set for it (None: unset)."""
    _count(args)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              env=_environ(env) if env else None,
                              preexec_fn=_ignore_term if ignore_term else None)
    except OSError as err:  # e.g. a container without Slurm's client commands
        return Reply(tuple(args), None, err=f"cannot run {args[0]}: {err.strerror}")
    except subprocess.TimeoutExpired:
        # (subprocess.run kills the command itself; a site's wrapper script may leave its
        # own child behind, which Slurm's own timeouts then end.)
        return Reply(tuple(args), None, err=f"{_name(args)} gave no answer within {timeout:g} s", hung=True)
    return Reply(tuple(args), proc.returncode, proc.stdout, proc.stderr.strip())


def _count(args: list[str]) -> None:
    global calls
    calls += 1
    log = os.environ.get(CALLS_LOG)
    if log:
        try:
            with open(log, "a") as f:  # (O_APPEND: one line whole, however many processes log)
                f.write(f"{time.time():.3f} {_name(args)}\n")
        except OSError:
            pass  # a bench's log, never worth a command's failure


def run(args: list[str], *, timeout: float | None = None, tries: int = 1,
        retry: Callable[[Reply], bool] = lambda r: r.transient, deadline: float | None = None,
        ignore_term: bool = False, env: Mapping[str, str | None] | None = None) -> Reply:
    """Run a Slurm command; while `retry(reply)` (by default: a transient failure) and
    fewer than `tries` tries were made, wait (BACKOFF_S, doubling) and run it again. The
    default is for what is safe to repeat: a query, or an action whose repeat is harmless
    (scancel, requeue, update, release); sbatch passes `Reply.unsent`. `deadline`
    (time.monotonic()): no try starts after it, and none runs past it."""
    wait = BACKOFF_S
    limit = TIMEOUT_S if timeout is None else timeout
    for n in range(1, tries + 1):
        left = limit if deadline is None else min(limit, deadline - time.monotonic())
        reply = replace(run_once(args, max(left, 0.1), ignore_term=ignore_term, env=env), tries=n)
        if (reply.ok or n == tries or not retry(reply)
                or (deadline is not None and time.monotonic() + wait >= deadline)):
            return reply
        time.sleep(wait)
        wait = min(2 * wait, max(BACKOFF_MAX_S, BACKOFF_S))
    raise AssertionError("unreachable: the last try returns")
