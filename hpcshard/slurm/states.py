"""Slurm's job states, mapped from its strings in one place (`parse`): scontrol's JobState,
sacct's State ("CANCELLED by 1000", a "+" where sacct cut a word short), squeue's %T. Code
elsewhere compares `JobState` members and asks their properties (`over`, `running`, ...),
never Slurm's words (a test walks the source for them). Stdlib."""

from __future__ import annotations

import enum


class JobState(enum.Enum):
    """A job's state, as Slurm 22.05 names them (src/common/slurm_protocol_defs.c,
    job_state_string): base states, then the flag-like states scontrol shows alone."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    CONFIGURING = "CONFIGURING"
    COMPLETING = "COMPLETING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESIZING = "RESIZING"
    REVOKED = "REVOKED"
    SIGNALING = "SIGNALING"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    UPDATE_DB = "UPDATE_DB"
    RECONFIG_FAIL = "RECONFIG_FAIL"
    POWER_UP_NODE = "POWER_UP_NODE"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    UNKNOWN = "UNKNOWN"
    """A word this table does not know (a newer Slurm's), or none: records keep Slurm's
    own text beside it for display."""

    @property
    def over(self) -> bool:
        """The job runs no more (a requeued job passes through none of these)."""
        return self in _OVER

    @property
    def running(self) -> bool:
        """Its steps run (or are ending)."""
        return self in (JobState.RUNNING, JobState.COMPLETING, JobState.CONFIGURING, JobState.SIGNALING,
                        JobState.STAGE_OUT)

    @property
    def pending(self) -> bool:
        """Waiting in the queue for its (next) start."""
        return self is JobState.PENDING

    @property
    def requeued(self) -> bool:
        """Back in the queue after a requeue, or on its way there: it starts again by itself."""
        return self in (JobState.REQUEUED, JobState.REQUEUE_HOLD, JobState.REQUEUE_FED, JobState.PENDING)

    @property
    def ended_on_purpose(self) -> bool:
        """Cancelled by someone, or finished: nothing failed."""
        return self in (JobState.CANCELLED, JobState.COMPLETED)


_OVER = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
                   JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL, JobState.DEADLINE,
                   JobState.PREEMPTED})

_BY_NAME = {state.value: state for state in JobState}


def parse(text: str) -> JobState:
    """Slurm's word for a job's state as a member: the first word ("CANCELLED by 1000"),
    without a trailing "+" (sacct's cut); UNKNOWN for any other, or none."""
    words = text.split()
    return _BY_NAME.get(words[0].rstrip("+"), JobState.UNKNOWN) if words else JobState.UNKNOWN

