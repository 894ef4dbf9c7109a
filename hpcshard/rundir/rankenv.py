"""What a launcher tells its ranks: every HPCSHARD_* variable of a rank, as one object
(as `slurm.env.SlurmEnv` is for SLURM_*), the notice signal's names, and the exit code
that means "requeue me". Stdlib: read by the rank entry point before torch loads.

A node's place in the job (HPCSHARD_NODE_RANK, ..., between the local backend and the
node launcher) is `launch.node.NodeEnv`'s; everything a rank reads is here.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.proc import boot_id, clock

REQUEUE_EXIT = 75
"""Exit code meaning "stopped cleanly on request, checkpoint committed: requeue me"
(EX_TEMPFAIL in sysexits.h: a temporary failure, try again later). The runtime's ranks,
own scripts (`hpcshard.preemption.REQUEUE`) and the launchers all use this one."""

BUG_EXIT = 3
"""Exit code meaning "the job's own code raised the same exception at the same step on a
retry: a bug, not a fault"; never restarted or requeued."""
STORAGE_EXIT = 74
"""Exit code meaning "the run's storage is full, over its quota or read-only: stopped, with
no node blamed; free space, then resume" (EX_IOERR in sysexits.h). Never restarted or
requeued: every attempt would fail the same way."""
STRAGGLER_EXIT = 76
"""The ranks stopped together after saving because a node straggles and the policy is
bad_node: a fault (its node is declared bad), not the end of the run."""

STACKS_SIGNAL = signal.SIGRTMIN + 4
"""What a launcher sends a rank to have it write every thread's Python stack into its log
before it is killed (faulthandler): a real-time signal, which nothing else of a job uses."""

STOP_SIGNALS = ("USR1", "USR2")
"""What a profile may use as the notice. torchrun takes TERM, INT, HUP and QUIT for
itself (it tears the ranks down on them, mid-save). NCCL may catch USR1, so USR2 is the
default."""
SCRIPT_SIGNALS = ("TERM", "INT", "HUP", "USR1", "USR2", "none")
"""What a script may be sent on a notice; none: nothing, the launcher stops it after
the grace period."""
NOTICE = "USR2"
"""The default notice, as Slurm's --signal and the settings spell it."""
DEFAULT_NOTICE = f"SIG{NOTICE}"

ENV_DOC = {
    "HPCSHARD_RUN_DIR": "the run directory (spec, logs, attempts ledger)",
    "HPCSHARD_CHECKPOINT_DIR": "RUN_DIR/checkpoints: save here, resume from here",
    "HPCSHARD_ATTEMPT": "0 for the first attempt, +1 for each requeue or `hpcshard resume`",
    "HPCSHARD_RESTART_COUNT": "requeues of this submission (Slurm's SLURM_RESTART_COUNT)",
    "HPCSHARD_DEADLINE": "Unix time at which the job's time limit ends, on this node's clock "
                         "(unset without a limit)",
    "HPCSHARD_NOTICE_SIGNAL": "the signal the script gets when the job must stop (e.g. SIGTERM)",
}
"""The variables a script may read (docs/user/scripts.md's table is checked against this)."""


def signal_name(text: str) -> str:
    """usr2, USR2, SIGUSR2 -> "SIGUSR2"; ValueError for a name Python does not know."""
    name = text.strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not hasattr(signal.Signals, name):
        raise ValueError(f"signal {text!r} is not a signal name; use e.g. USR2")
    return name


def short_name(text: str) -> str:
    """SIGUSR2, usr2 -> "USR2": the spelling of Slurm's --signal and scancel."""
    return signal_name(text).removeprefix("SIG")


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """The HPCSHARD_* variables a launcher sets for its node's ranks."""

    attempt: int = 0
    """HPCSHARD_ATTEMPT: 0 for the first attempt, +1 for each requeue or resume."""
    resume: str = "auto"
    """HPCSHARD_RESUME: auto | never | STEP | PATH (requeued attempts always auto)."""
    restart_count: int = 0
    """HPCSHARD_RESTART_COUNT: requeues of this submission."""
    notice: str = DEFAULT_NOTICE
    """HPCSHARD_STOP_SIGNAL: the launcher's notice, which the ranks listen for."""
    deadline: float | None = None
    """When the job's time limit ends, on this host's boot clock (`rundir.proc.clock`); None:
    no limit known. A launcher makes it from the controller's time left (a duration) and the
    moment it asked; its ranks, processes of the same host and boot started at any time
    later (a restart in the allocation), read the same clock, so what is left is measured
    from that one answer, never from a wall clock. HPCSHARD_DEADLINE_BOOT carries it with its
    boot; HPCSHARD_DEADLINE, for scripts, is the same moment on this host's wall clock as
    the variables are made (`to_environ`)."""
    lead: int | None = None
    """HPCSHARD_NOTICE_LEAD: seconds before the deadline that the time-limit notice comes
    (the profile's signal_lead); None: unknown (every notice stops at once)."""
    cycle: int = 0
    """HPCSHARD_CYCLE: in-place restarts of the ranks within this attempt (a fault)."""
    board: str = ""
    """HPCSHARD_BOARD: the node's progress board (`rundir.progress`); empty: none."""
    owner: str = ""
    """HPCSHARD_OWNER: the lease token of the job or process that owns the run
    (`rundir.lease`): rank 0 checks it still does before it commits or cleans anything;
    empty: no lease (a run directory of an older hpcshard)."""
    newest: int = 0
    """HPCSHARD_NEWEST_STEP: a restart's newest committed step as the launchers know it
    (the node that committed it sees it): rank 0 looks it up by name should its own
    listing of the checkpoints not show it yet (an NFS client's directory cache: 30-60 s
    after another host made it); 0: none known."""

    def __post_init__(self) -> None:  # USR2, usr2, SIGUSR2: one spelling from here on
        object.__setattr__(self, "notice", signal_name(self.notice))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        env = os.environ if environ is None else environ
        deadline = deadline_in(env)
        return cls(attempt=int(env.get("HPCSHARD_ATTEMPT", "0")),
                   resume=env.get("HPCSHARD_RESUME", "auto"),
                   restart_count=int(env.get("HPCSHARD_RESTART_COUNT", "0")),
                   notice=env.get("HPCSHARD_STOP_SIGNAL", DEFAULT_NOTICE),
                   deadline=deadline,
                   lead=int(env["HPCSHARD_NOTICE_LEAD"]) if env.get("HPCSHARD_NOTICE_LEAD") else None,
                   cycle=int(env.get("HPCSHARD_CYCLE", "0")), board=env.get("HPCSHARD_BOARD", ""),
                   owner=env.get("HPCSHARD_OWNER", ""), newest=int(env.get("HPCSHARD_NEWEST_STEP") or 0))

    def to_environ(self) -> dict[str, str]:
        env = {"HPCSHARD_ATTEMPT": str(self.attempt), "HPCSHARD_RESUME": self.resume,
               "HPCSHARD_RESTART_COUNT": str(self.restart_count),
               "HPCSHARD_STOP_SIGNAL": self.notice, "HPCSHARD_CYCLE": str(self.cycle),
               "HPCSHARD_BOARD": self.board, "HPCSHARD_OWNER": self.owner,
               "HPCSHARD_NEWEST_STEP": str(self.newest)}
        if self.deadline is not None:
            env["HPCSHARD_DEADLINE_BOOT"] = f"{self.deadline:.3f} {boot_id()}"
            env["HPCSHARD_DEADLINE"] = str(int(time.time() + self.time_left()))
        if self.lead is not None:
            env["HPCSHARD_NOTICE_LEAD"] = str(self.lead)
        return env

    @property
    def notice_signal(self) -> signal.Signals:
        return signal.Signals[self.notice]

    def time_left(self) -> float:
        """Seconds until the time limit ends, now (0 without a deadline: call with one)."""
        return 0.0 if self.deadline is None else self.deadline - clock()


DEADLINE_VARS = ("HPCSHARD_DEADLINE", "HPCSHARD_DEADLINE_BOOT")
"""A deadline's variables. A launcher drops what its environment brought (a continuation
job submitted from an earlier job's launcher inherits that job's) before it sets its own:
another job's deadline on the same boot would be believed."""


def deadline_in(env: Mapping[str, str]) -> float | None:
    """The deadline on this host's boot clock: HPCSHARD_DEADLINE_BOOT when it was made on
    this boot of this host (made elsewhere, its number means nothing here: no deadline);
    else a Unix time in HPCSHARD_DEADLINE (a launcher of the user's own, a test), taken
    as this host's wall clock says it now."""
    made = env.get("HPCSHARD_DEADLINE_BOOT", "").split()
    if made:
        return float(made[0]) if " ".join(made[1:]) == boot_id() else None
    wall = env.get("HPCSHARD_DEADLINE")
    return clock() + float(wall) - time.time() if wall else None


NOTICE_SLACK_S = 60.0
"""Slurm may send --signal up to a minute early (its event resolution): a notice that came
within the lead time plus this of the deadline is the time limit's."""


def limit_end(noticed: float, deadline: float, lead: int) -> float:
    """When the time limit ends, as a time-limit notice that came at `noticed` says: the
    earlier of the launcher's `deadline` and the notice plus `lead`. All on this host's boot
    clock. The deadline is a duration the controller gave (TimeLimit less RunTime), counted
    from when it was asked; but scontrol works RunTime out on this host's wall clock, so a
    clock 45 s behind the controller's puts the end 45 s late. The notice is the
    controller's own: it sends it `lead` seconds before the end on its clock (or up to a
    minute earlier, never later), so the notice plus the lead is never past the end,
    whatever this host's clock says."""
    return min(deadline, noticed + lead)


def noticed_end(deadline: float, noticed: float | None, lead: int | None) -> float:
    """When the time limit ends, as best this host can tell: the launcher's `deadline`,
    bounded by a notice that came at `noticed` within the `lead` (and NOTICE_SLACK_S) of
    it, the time limit's (`limit_end`); a notice further off is a preemption's, which says
    nothing of the limit."""
    if noticed is None or lead is None or deadline - noticed > lead + NOTICE_SLACK_S:
        return deadline
    return limit_end(noticed, deadline, lead)


def script_environ(run_dir: Path, attempt: int, script_signal: str) -> dict[str, str]:
    """The variables a script (not an hpcshard job) reads on top of torchrun's: ENV_DOC."""
    return {"HPCSHARD_RUN_DIR": str(run_dir),
            "HPCSHARD_CHECKPOINT_DIR": str(RunPaths(run_dir).checkpoints),
            "HPCSHARD_ATTEMPT": str(attempt),
            "HPCSHARD_NOTICE_SIGNAL": "" if script_signal == "none" else signal_name(script_signal)}
