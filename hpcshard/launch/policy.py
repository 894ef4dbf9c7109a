"""What to do after a fault: a pure function of what the launchers found (`Facts`), returning
a typed `Decision`. No I/O, no clock: every branch is tested table-driven
(tests/unit/test_launch_policy.py), and the supervisor only gathers the facts and carries
the decision out.

The rules, first match wins:

1. Nodes that never reported their ranks down and are not lost: nothing is known of them;
   stop (nothing restarts with ranks that may still run).
2. The run's storage takes no write from any node that reported: full, over quota or
   read-only (a person must act), or any other error (EACCES, EIO, ESTALE, a mount that
   hangs) that the decider waited for in vain (`storage_verdict`): stop, blame no node
   (restarting or requeueing would fail the same way; a drained node would not come back).
   Refused to some nodes while others wrote (a stale mount on one node), it is no reason to
   stop: those nodes sit this attempt out (rule 4), and nothing calls them bad.
3. A stop notice came as well, or a node's launcher already ended on one: back through the
   queue, not restarted here. A node whose launcher ended because its ranks finished
   leaves nothing to restart with: stop. One whose launcher failed (its ranks with it)
   is out of this attempt like a lost node, without being called bad. (Ended launchers
   used to be waited for, 150 s, and the run stopped.)
4. Bad nodes (lost, failed a health check, straggling), and those that sit the attempt out
   (`Facts.unfit`): spares take their places; without enough, the run goes on with fewer
   nodes down to `min_nodes`, else back through the queue without the bad ones (the local
   backend has no other node: stop).
5. The job's own code raised the same exception at the same step twice: a bug; stop.
6. `no_progress_restarts` restarts in a row without a newer checkpoint: stop.
7. This allocation's restart budget is spent: back through the queue.
8. Else restart in place, on the nodes rule 4 chose.

Every decision that is neither a restart nor a requeue ends the attempt (`Decision.end`),
and the launcher records that end: a run that gives up says so, and a guard job never
takes over a run whose attempt was closed (it did, in a loop, when the give-up left no
record).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from hpcshard.rundir.events import EndReason
from hpcshard.rundir.rankenv import BUG_EXIT, REQUEUE_EXIT, STORAGE_EXIT


class Action(StrEnum):
    RESTART = "restart"
    """Every node starts its ranks again, inside this allocation."""
    REQUEUE = "requeue"
    """The launchers exit REQUEUE_EXIT: the job goes back through the queue (or a
    continuation job is submitted), resuming from the newest checkpoint."""
    STOP = "stop"
    """The run stops here; `hpcshard resume` continues it once the cause is dealt with."""


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What the deciding launcher knows once every node is down or lost."""

    cycle: int
    """The cycle that failed (0: the attempt's first)."""
    active: tuple[int, ...]
    """The launchers whose ranks trained in it."""
    spares: tuple[int, ...] = ()
    """The launchers waiting to take a lost node's place."""
    min_nodes: int = 0
    """Fewest nodes the run may go on with; 0: as many as trained."""
    local: bool = False
    """The local backend: there is no other node to be given."""
    lost: tuple[int, ...] = ()
    """Launchers silent for LOST_S in this cycle (dead, frozen, cut off)."""
    unreported: tuple[int, ...] = ()
    """Launchers that neither said their ranks are down nor went silent, by the deadline."""
    ended: dict[int, int] = field(default_factory=dict)
    """Launchers that ended (their last heartbeat says so, with their exit code) instead of
    taking part: their ranks finished or stopped on a notice while another node failed."""
    bad: dict[int, str] = field(default_factory=dict)
    """Every node declared bad in this attempt, and why (lost ones among them): the ledger's
    records and what the launchers said with their down records (a record the storage
    refused is known all the same)."""
    unfit: dict[int, str] = field(default_factory=dict)
    """Nodes that sit this attempt out without being bad (no record, no drain, no exclusion
    in later jobs), and why: the run directory refused their probe while other nodes' writes
    landed (`storage_verdict`)."""
    noticed: bool = False
    """A stop notice (preemption, time limit) came before or during the fault."""
    bug: str = ""
    """The exception the job's own code raised at the same step in this cycle and the one
    before ("" if not so)."""
    stalled: int = 0
    """Restarts in a row so far after which the committed step did not move."""
    committed: int = 0
    """The newest committed step: where a restart resumes."""
    storage: str = ""
    """Why the run's storage cannot take the run's writes (full, quota, read-only, or an
    error that was waited for in vain, named with its path); "" if it can."""
    max_restarts: int = 3
    no_progress_restarts: int = 2


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What every launcher of the job does next (written once: in node 0's store, or as
    next-A-C.json when the launchers coordinate through the files)."""

    action: Action
    code: int = 0
    """The launchers' exit code when they do not restart."""
    reason: str
    end: EndReason | Literal[""] = ""
    """How the attempt ends in the ledger ("" for a restart): stop (requeued after a notice),
    fault (requeued after faults), bug, gave_up, storage, unreported."""
    active: tuple[int, ...] = ()
    """A restart: the launchers whose ranks train next."""
    spares: tuple[int, ...] = ()
    bad: tuple[int, ...] = ()
    """Nodes this decision leaves out for good."""
    replaced: dict[str, int] = field(default_factory=dict)
    """Bad node (as a string: JSON) -> the spare that takes its place."""
    lost: tuple[int, ...] = ()
    committed: int = 0
    host: str = ""
    """A restart: where the next rendezvous is (the decider fills it in)."""
    port: int = 0
    coord_port: int = 0
    """A restart decided through the files (node 0's store was lost): where on `host` the
    decider now serves a store for the cycles after (`launch.coord`); 0: no new one."""
    coord_node: int = 0
    """...and the decider's node (whose loss is the store's)."""
    rdzv_node: int = 0
    """A restart: the launcher on `host` (the decider), node_rank 0 of the next cycle's
    static rendezvous, which serves its store there."""

    @property
    def restart(self) -> bool:
        return self.action is Action.RESTART

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {**d, "action": self.action.value, "restart": self.restart}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for name in ("active", "spares", "bad", "lost"):
            known[name] = tuple(known.get(name, ()))
        return cls(**{**known, "action": Action(d.get("action", "restart" if d.get("restart") else "stop"))})


def decide(f: Facts) -> Decision:
    """The decision after a fault in cycle `f.cycle` (see the module's rules)."""
    stop = Decision(action=Action.STOP, code=1, reason="", committed=f.committed, lost=f.lost)
    if f.unreported:
        return replace(stop, end=EndReason.UNREPORTED, reason=f"node(s) {list(f.unreported)} did not report "
                       "their ranks down, nor went silent: nothing restarts while their ranks may still run")
    if f.storage:
        return replace(stop, code=STORAGE_EXIT, end=EndReason.STORAGE, reason=f"{f.storage}; no node is "
                       "blamed: fix the storage (room, quota, permissions, the mount), then hpcshard resume")
    requeue = replace(stop, action=Action.REQUEUE, code=REQUEUE_EXIT)
    ended = {n: code for n, code in f.ended.items() if n in f.active}
    if REQUEUE_EXIT in ended.values():
        return replace(requeue, end=EndReason.STOP, reason=f"node(s) {sorted(ended)} stopped on a notice "
                       "while another failed: requeued, not restarted here")
    finished = sorted(n for n, code in ended.items() if code == 0)
    if finished:
        return replace(stop, end=EndReason.GAVE_UP, reason=f"node(s) {finished} finished while another "
                       "failed: nothing to restart with; hpcshard resume continues from the newest "
                       "checkpoint")
    # A launcher that ended otherwise failed itself (its ranks went with it): its node has
    # no launcher for this attempt, like a lost one, but nothing says the node is bad.
    f = replace(f, bad={**f.bad, **{n: f"its launcher ended (exit {code})" for n, code in ended.items()}})
    if f.noticed:
        return replace(requeue, end=EndReason.STOP,
                       reason="a stop notice came as well: requeued, not restarted here")
    nodes = _without_bad(f)
    if nodes.refused is not None:
        return replace(nodes.refused, committed=f.committed, lost=f.lost)
    why = f"{nodes.why}; " if nodes.why else ""
    if f.bug:
        return replace(stop, code=BUG_EXIT, end=EndReason.BUG,
                       reason=f"the job's own code raised {f.bug} again at the same step: a bug, "
                       "not a fault; not restarted")
    if f.stalled >= f.no_progress_restarts and not (nodes.bad or nodes.unfit):  # (new nodes: a new chance)
        return replace(stop, end=EndReason.GAVE_UP,
                       reason=f"{f.stalled} restarts in a row without a newer checkpoint")
    if f.cycle + 1 > f.max_restarts:
        # Training advanced, but this allocation has had its share of faults (a flaky
        # node?): back through the queue, as after a preemption, up to max_requeues.
        return replace(requeue, end=EndReason.FAULT, bad=nodes.bad, replaced=nodes.replaced,
                       reason=f"{why}the restart budget ({f.max_restarts}) is spent: requeued")
    return Decision(action=Action.RESTART, active=nodes.active, spares=nodes.spares, bad=nodes.bad,
                    replaced=nodes.replaced, committed=f.committed, lost=f.lost,
                    reason=f"{why}restart {f.cycle + 1} of {f.max_restarts}")


@dataclass(frozen=True)
class Nodes:
    """Rule 4's answer: who trains next once the bad and unfit nodes are out, or the decision
    when too few are left (`refused`)."""

    active: tuple[int, ...]
    spares: tuple[int, ...]
    why: str = ""
    bad: tuple[int, ...] = ()
    replaced: dict[str, int] = field(default_factory=dict)
    refused: Decision | None = None
    unfit: tuple[int, ...] = ()


def _without_bad(f: Facts) -> Nodes:
    """Spares take the places of the bad nodes and of those that sit the attempt out;
    without enough, fewer nodes down to min_nodes."""
    out = {**f.unfit, **f.bad}
    active = tuple(n for n in f.active if n not in out)
    spares = tuple(n for n in f.spares if n not in out)
    gone = tuple(n for n in f.active if n in out)
    if not gone:
        return Nodes(active, spares)
    bad = tuple(n for n in gone if n in f.bad)
    unfit = tuple(n for n in gone if n not in f.bad)
    why = " and ".join(filter(None, (_out(bad, f.bad, "bad"), _out(unfit, f.unfit, "sit this attempt out"))))
    taken, spares = spares[:len(gone)], spares[len(gone):]
    active = tuple(sorted((*active, *taken)))
    fewest = f.min_nodes or len(f.active)
    if len(active) < fewest:
        if f.local and not f.lost:
            refused = Decision(action=Action.STOP, code=1, end=EndReason.GAVE_UP, bad=bad,
                               reason=f"{why}; the local backend has no other node to use")
        else:
            without = " without the bad ones" if unfit and bad else "" if unfit else " without them"
            refused = Decision(action=Action.REQUEUE, code=REQUEUE_EXIT, end=EndReason.FAULT,
                               bad=tuple(sorted(f.bad)), reason=f"{why}: requeued{without}")
        return Nodes((), (), refused=refused)
    if len(active) == len(f.active):
        why += f": spare node(s) {list(taken)} take their place"
    else:
        why += (f": {len(taken)} spare(s) left, going on with {len(active)} nodes "
                f"(min_nodes {fewest}; the mesh is planned again)")
    return Nodes(active, spares, why, bad, dict(zip(map(str, gone), taken, strict=False)), unfit=unfit)


def _out(nodes: tuple[int, ...], why: dict[int, str], what: str) -> str:
    """"node(s) [1, 2] bad (why; why)": the nodes `nodes` out, and why ("" for none)."""
    return f"node(s) {list(nodes)} {what} ({'; '.join(sorted({why[n] for n in nodes}))})" if nodes else ""


@dataclass(frozen=True)
class StorageVerdict:
    """The nodes' probes of the run directory, compared (`storage_verdict`)."""

    stop: str = ""
    """The run stops for its storage now (`Facts.storage`): every node that reported saw an
    error, and one of them is for a person to fix (full, over quota, read-only)."""
    wait: str = ""
    """Every node that reported saw an error that may pass (EIO, ESTALE, EACCES, a mount
    that hangs): the decider waits for the storage (`health.wait_for_storage`), then
    decides; the run stops for it only if it never answers."""
    unfit: dict[int, str] = field(default_factory=dict)
    """Some nodes saw an error, and others' writes landed: the ones that saw it sit this
    attempt out (`Facts.unfit`), and nothing calls them bad."""


def storage_verdict(seen: dict[int, str], lasting: Collection[int], wrote: Collection[int]) -> StorageVerdict:
    """Compare the probes of the nodes that reported: `seen`, what each that saw an error on
    the run directory saw (a line); `lasting`, those of them whose error a person must fix;
    `wrote`, those whose write landed. One node's view alone (a stale mount) is that node's
    trouble for this attempt, not the run's (the run stopped for it: issue 42); but no node
    is ever bad for it (a mount that comes back makes it fit again, in the next job)."""
    if not seen:
        return StorageVerdict()
    if wrote:
        where = f"seen from node(s) {sorted(seen)}, not from {sorted(wrote)}"
        return StorageVerdict(unfit={n: f"{why}, {where}" for n, why in seen.items()})
    lasting = sorted(n for n in lasting if n in seen)
    if lasting:
        return StorageVerdict(stop=seen[lasting[0]])
    return StorageVerdict(wait=seen[min(seen)])
