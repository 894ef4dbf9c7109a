"""The attempts ledger's events (RUN_DIR/attempts.jsonl): one typed record per kind, and the
one place that turns a record into the ledger's JSON (`record`; `ledger.append` adds the
time it was written). `ledger.append` takes nothing else, so every line of the ledger is
one of these (mypy and a test catch an untyped write).

The JSON is what it always was: `{"time": ..., "event": KIND, FIELD: VALUE, ...}`, field
names unchanged, so the readers (rundir.status, rundir.goodput, `hpcshard plot`, sweeps,
bench/) read old run directories and new ones alike. A field left `UNSET` is absent from
the line, as it was where its writer left it out; None is written as null, where a writer
wrote null. Readers stay dict-based (they read what older versions wrote); `parse` gives
the typed record back where a decision needs one.

Stdlib only: launchers, ranks and the CLI all write or read it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Final, Literal


class Unset(enum.Enum):
    """The value of a field a record leaves out: absent from its line (not null)."""

    UNSET = "unset"


UNSET: Final = Unset.UNSET

class EndReason(enum.StrEnum):
    """How an attempt ended (the `end` record's `reason`). A StrEnum: a member is its
    value, so the ledger's JSON is what the strings wrote, and old ledgers parse."""

    DONE = "done"
    """Every step trained (a script: it exited 0 without a notice)."""
    STOP = "stop"
    """Stopped on request (a notice, a time limit) with its checkpoint: requeued or continued."""
    ERROR = "error"
    """A rank failed (its exception, a script's exit code), or a user error (`user_error`)."""
    FAULT = "fault"
    """Faults spent the allocation's restarts, or bad nodes left too few: requeued."""
    NONFINITE = "nonfinite"
    """A nan or inf loss or gradient norm stopped it, with no save after it."""
    GAVE_UP = "gave_up"
    """Restarts in a row without a newer checkpoint, or too few nodes left."""
    BUG = "bug"
    """The job's own code raised the same exception at the same step twice."""
    STORAGE = "storage"
    """The run directory is full, over quota or read-only (no node is blamed)."""
    UNREPORTED = "unreported"
    """Nodes never said their ranks were down (nothing restarts beside them)."""


END_REASONS: Final = frozenset(EndReason)


def end_reason(text: str) -> EndReason:
    """`text` as an end reason (from a str-typed source: the runtime's summary, a ledger
    line); ValueError for one that no reader knows."""
    try:
        return EndReason(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an end reason; valid: {', '.join(sorted(END_REASONS))}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """What every ledger record has: its kind (`event`, the class's KIND) and its attempt."""

    KIND: ClassVar[str] = ""
    attempt: int
    """The attempt (0: the first job of the run; each requeue, continuation, resume or guard
    take-over starts the next)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Start(Event):
    """Rank 0 has loaded what it resumes from and is about to train (a script: it starts)."""

    KIND: ClassVar[str] = "start"
    cycle: int
    """The start within the attempt (0: its first; each restart after a fault adds one)."""
    script: bool | Unset = UNSET
    """True for a bring-your-own-script run (absent for hpcshard's runtime)."""
    world: int
    """Ranks in all."""
    nodes: int
    """Nodes that train (spares not counted)."""
    host: str
    """Rank 0's host."""
    slurm_job: str | Unset = UNSET
    """The Slurm job it runs in, as the spec names it (an array task: JOB_TASK); absent
    outside Slurm."""
    slurm_run: int | Unset = UNSET
    """Which run of that job (SLURM_RESTART_COUNT: 0, then 1, 2, ... after each requeue)."""
    resumed_step: int | None | Unset = UNSET
    """The step of the checkpoint loaded (null: none, a fresh start); absent for a script,
    which loads its own."""
    resumed_from: str | None | Unset = UNSET
    """That checkpoint's directory (null: none); absent for a script."""
    skipped: list[list[str]] | Unset = UNSET
    """Newer checkpoints passed over while loading, each [name, why]; absent for a script."""
    init_from: str | Unset = UNSET
    """The Hugging Face checkpoint the weights started from (absent: none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class End(Event):
    """How an attempt (or, with `cycle`, the cycle that closed it) ended: at most one is read
    per attempt (`ledger.end_of`: the last). An attempt without one was killed."""

    KIND: ClassVar[str] = "end"
    reason: EndReason
    """How it ended (see EndReason)."""
    cycle: int | Unset = UNSET
    """The cycle that ended it; absent where a script's launcher wrote it."""
    step: int | Unset = UNSET
    """The step the ranks reached (the runtime's own end)."""
    saved_step: int | None | Unset = UNSET
    """The newest saved step (-1 or null: none); absent where unknown (a failure)."""
    saved: str | None | Unset = UNSET
    """A script's newest checkpoint, by its name (null: none)."""
    lost_seconds: float | Unset = UNSET
    """A script stopped or requeued: seconds since its newest checkpoint was written (the
    training the stop lost)."""
    how: str | Unset = UNSET
    """Why, in words (the decision's reason, what the script did after the notice)."""
    error: str | Unset = UNSET
    """What failed: the exception, a script's exit code, the user error's line."""
    user_error: bool | Unset = UNSET
    """True: bad input only the ranks could check (exit 2, never restarted)."""
    storage: str | Unset = UNSET
    """Reason storage: what the run's storage refused (what is full, over quota or read-only)."""

    def __post_init__(self) -> None:
        # A str-typed caller (a ledger line) must not slip an unknown reason past mypy; a
        # known one becomes the member, so `parse` gives the enum back.
        object.__setattr__(self, "reason", end_reason(self.reason))

    @classmethod
    def of_script(cls, *, attempt: int, reason: EndReason, how: str, save: Mapping[str, Any]) -> End:
        """A script's attempt, ended with `save`, its newest checkpoint as `store.last_save`
        found it (saved_step and saved null for none; lost_seconds only with one)."""
        return cls(attempt=attempt, reason=reason, how=how, saved_step=save["saved_step"],
                   saved=save["saved"], lost_seconds=save.get("lost_seconds", UNSET))


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFailed(Event):
    """A rank failed: how, for the launchers to tell a bug (the same exception at the same
    step again) from a fault (a peer that died, a signal)."""

    KIND: ClassVar[str] = "rank_failed"
    cycle: int
    """The cycle it failed in."""
    rank: int
    """The global rank."""
    host: str
    """Where it ran."""
    code: int | Unset = UNSET
    """A script's exit code (absent for hpcshard's runtime: it raised)."""
    step: int | None
    """The step it had reached (null: before training)."""
    error: str
    """The exception's type name (a script that exited without one: `exit CODE`)."""
    message: str
    """The exception's first line, at most 300 characters ("" if none)."""
    log: str
    """Its log file."""
    after_notice: bool | Unset = UNSET
    """A script: whether a stop notice had come (absent for hpcshard's runtime)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault(Event):
    """A fault the launchers declared, and what was decided: cause, culprit, cost, the
    decision (`launch.policy.Decision`'s fields, flat)."""

    KIND: ClassVar[str] = "fault"
    cycle: int
    """The cycle that failed."""
    cause: str
    """What the declaring launcher saw ("unknown" if no declaration was read)."""
    declared: float | None
    """When it was declared, on its writer's clock (null: unknown); for people, nothing is
    decided on it."""
    culprit: dict[str, Any] | None
    """The rank or node to blame (rank, node, host, slurm_node, state, step, ...; null:
    unknown)."""
    reached: int
    """The furthest step any rank reached."""
    action: str
    """restart, requeue or stop."""
    code: int
    """The launchers' exit code when they do not restart."""
    reason: str
    """The decision, in words."""
    end: EndReason | Literal[""]
    """How the attempt ends ("" for a restart)."""
    active: list[int]
    """A restart: the launchers whose ranks train next."""
    spares: list[int]
    """The spares left."""
    bad: list[int]
    """Nodes this decision leaves out for good."""
    replaced: dict[str, int]
    """Bad node (as a string) -> the spare that takes its place."""
    lost: list[int]
    """Launchers silent in this cycle."""
    committed: int
    """The newest committed step: where a restart resumes."""
    host: str
    """A restart: where the next rendezvous is."""
    port: int
    """A restart: its port."""
    coord_port: int = 0
    """A restart decided through the files: where on `host` the decider serves the
    launchers' store anew (`launch.coord`); 0: none."""
    coord_node: int = 0
    """...and the decider's node, which serves it."""
    rdzv_node: int = 0
    """A restart: the launcher that hosts the next rendezvous (node_rank 0)."""
    restart: bool
    """Whether the ranks restart in this allocation."""
    lost_steps: int
    """Steps to train again (reached, less committed)."""
    detect_s: float
    """How long the culprit had been silent when a hang was declared (a crash: one look)."""
    collectives: list[dict[str, Any]]
    """The flight recorder's collectives some rank never joined (rundir.flight)."""

    def __post_init__(self) -> None:
        if self.end:
            object.__setattr__(self, "end", end_reason(self.end))


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovered(Event):
    """After a restart, a rank trained past the step it resumed from."""

    KIND: ClassVar[str] = "recovered"
    cycle: int
    """The cycle that trains again."""
    step: int
    """The first step past the resumed one."""
    seconds: float
    """Declared -> training again (the declaration's time is its writer's clock)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Watchdog(Event):
    """The hang limits the leader's watchdog learned in a cycle."""

    KIND: ClassVar[str] = "watchdog"
    cycle: int
    """The cycle."""
    step_limit: float
    """Seconds a step may take before it is a hang."""
    median_step: float
    """The median step's seconds it learned from."""
    factor: float
    """step_limit is this times the median ..."""
    floor_s: float
    """... and at least this."""
    phase_s: float
    """Seconds any other phase (a save, an evaluation) may take."""
    join_s: float
    """Seconds the ranks may take to join."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Links(Event):
    """The links between the nodes, timed before training (health_link_mb)."""

    KIND: ClassVar[str] = "links"
    cycle: int
    """The cycle (0: links are timed at an attempt's first start only)."""
    mb: float
    """Megabytes sent each way."""
    floor_gbps: float
    """health_link_gbps (0: no floor)."""
    slowest: dict[str, float]
    """The slowest link: {"from": node, "to": node, "gbps": GB/s}."""
    links: list[list[float]]
    """Every link: [from node, to node, GB/s]."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler(Event):
    """A rank computing slower than the others' median, or (kind "link") a node with every
    link under health_link_gbps."""

    KIND: ClassVar[str] = "straggler"
    cycle: int
    """The cycle."""
    kind: Literal["link"] | Unset = UNSET
    """"link" for a node with every link slow (absent: a slow rank)."""
    step: int
    """The step it was seen at (0: before training)."""
    rank: int
    """The slow rank (kind link: the node's first rank)."""
    host: str
    """Its host ("" where unknown)."""
    ratio: float
    """How many times slower than the median (kind link: the floor over the slowest link)."""
    gbps: float | Unset = UNSET
    """Kind link: the slowest link's GB/s."""
    floor_gbps: float | Unset = UNSET
    """Kind link: health_link_gbps."""
    policy: str
    """straggler_policy: warn, or bad_node (its node is declared bad)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollback(Event):
    """nan_policy=rollback: a non-finite step, and the checkpoint the ranks went back to."""

    KIND: ClassVar[str] = "rollback"
    cycle: int
    """The cycle."""
    step: int
    """The step whose loss or gradient norm was nan or inf."""
    to: int
    """The step rolled back to."""
    skipped: list[list[int]]
    """The global batches never trained on again, each [epoch, offset]."""
    rollback: int
    """This rollback's number in the run."""
    of: int
    """nan_rollbacks: the most the run allows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveFailed(Event):
    """A checkpoint save that was not committed (rank 0 writes it). The failed saves in a
    row count toward the storage rule across restarts and requeues
    (`runtime.checkpoint.manager.SAVE_FAILURES_STOP`, `ledger.failed_saves`)."""

    KIND: ClassVar[str] = "save_failed"
    cycle: int
    """The cycle it failed in."""
    step: int
    """The step the save was of."""
    since: int
    """The newest committed step the ranks had when it failed: the checkpoint they resumed
    from or last committed (-1: none). Failed saves in a row share it."""
    error: str
    """What it failed with, one line (at most 300 characters)."""
    probe: str
    """What the write probe beside the checkpoints found: "ok" (it wrote), its error
    ("EIO: Input/output error"), or "" (not run: the failure named full storage itself)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BadNode(Event):
    """A node declared bad: never used again by the run."""

    KIND: ClassVar[str] = "bad_node"
    cycle: int
    """The cycle."""
    node: int
    """The launcher's node number in this attempt."""
    host: str | Unset = UNSET
    """Its host, where known."""
    slurm_node: str | Unset = UNSET
    """Its Slurm node, where known (later jobs of the run exclude it)."""
    reason: str
    """Why (one starting with "lost" is a silent node)."""
    drained: bool | Unset = UNSET
    """Whether Slurm drained it (absent: not asked to)."""
    drain_error: str | Unset = UNSET
    """What Slurm said when it refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeDown(Event):
    """Nodes this attempt lost, marked DOWN in Slurm (bad_nodes = drain)."""

    KIND: ClassVar[str] = "node_down"
    slurm_node: str
    """The Slurm node (with `error`: every one asked, comma-separated)."""
    error: str | Unset = UNSET
    """What Slurm said when it refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GaveUp(Event):
    """The run is not continued by itself: `hpcshard resume` continues it."""

    KIND: ClassVar[str] = "gave_up"
    reason: str
    """Why, in words, with what to do."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Requeue(Event):
    """The job went back through Slurm's queue."""

    KIND: ClassVar[str] = "requeue"
    job: str
    """The job (SlurmEnv.ref)."""
    by: str | Unset = UNSET
    """Who requeued it when it was not hpcshard ("the job itself")."""
    state: str | Unset = UNSET
    """With `by`: the state Slurm showed."""
    error: str | None | Unset = UNSET
    """What a retried requeue met before it went through (null: nothing)."""
    excluded: list[str] | Unset = UNSET
    """The Slurm nodes excluded from now on (the run's bad nodes)."""
    host: bool | Unset = UNSET
    """Left to the batch script (no Slurm client in the launcher's environment: a
    container): done once srun returns, never if the batch host is lost
    (`launch.hostside`)."""
    nodes: int | Unset = UNSET
    """Fewer nodes than asked, where bad nodes leave the partition too few."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chain(Event):
    """A continuation job was submitted (requeue_policy=chain)."""

    KIND: ClassVar[str] = "chain"
    job: str
    """The job that stopped."""
    next: str
    """The continuation job."""
    at_once: bool | Unset = UNSET
    """True: it starts at once, without waiting for this job (orphaned, cancelled)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Guard(Event):
    """A guard job took over a run whose job ended while it trained."""

    KIND: ClassVar[str] = "guard"
    job: str
    """The job it guarded."""
    next: str
    """The guard job, which trains now."""
    state: str
    """How the guarded job ended, by Slurm ("unknown": no answer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancel(Event):
    """hpcshard cancelled a job of the run."""

    KIND: ClassVar[str] = "cancel"
    job: str
    """The job."""
    reason: str
    """Why."""


KINDS: Final[dict[str, type[Event]]] = {
    cls.KIND: cls for cls in (Start, End, RankFailed, Fault, Recovered, Watchdog, Links, Straggler,
                              Rollback, SaveFailed, BadNode, NodeDown, GaveUp, Requeue, Chain, Guard,
                              Cancel)}
"""Every event kind, by its name in the ledger."""


def record(event: Event) -> dict[str, Any]:
    """The one place an event becomes the ledger's JSON object (less the time it is written):
    its kind as `event`, then every field not UNSET. TypeError for anything else (a bare
    dict from a caller mypy did not check, the base class): no record bypasses the types."""
    if KINDS.get(getattr(event, "KIND", "")) is not type(event):
        raise TypeError(f"the ledger takes an event of hpcshard.rundir.events ({', '.join(KINDS)}), "
                        f"not {type(event).__name__}: {event!r:.200}")
    out: dict[str, Any] = {"event": event.KIND}
    for f in fields(event):
        value = getattr(event, f.name)
        if not isinstance(value, Unset):
            out[f.name] = value
    return out


def parse(line: dict[str, Any]) -> Event | None:
    """A ledger record as its typed event; None for a kind or shape this version does not
    know (an older or newer hpcshard wrote it): decisions then go on as without it."""
    cls = KINDS.get(str(line.get("event")))
    if cls is None:
        return None
    known = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in line.items() if k in known})
    except (TypeError, ValueError):
        return None
