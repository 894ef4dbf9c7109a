"""Supervision of a node's ranks (hpcshard jobs): start them, watch them, and when a rank
dies, bring every node's ranks back from the newest committed checkpoint without leaving
the allocation.

One cycle is one torchrun (or warm agent) per node. While it runs, the launcher reads its
node's progress board (`rundir.progress`) every POLL_S: a rank whose process is gone while
it was still training is a crash, declared at once for the whole job (`rundir.launchers`:
one fault file per cycle, first declarer wins). Every launcher polls for a declaration too,
so a fault on one node stops the others within a poll, not after torchrun's 300 s exit
barrier or gloo's 30 minutes. Each launcher then kills what is left of its ranks (SIGCONT
first: a stopped process would not die of SIGTERM; then SIGKILL) and says it is down; the
lowest launcher that is not lost gathers the facts and asks `launch.policy` what to do
(restart, requeue, stop); every node starts the next cycle from the newest committed
checkpoint, or ends as decided.

The pieces it uses each live in a module of their own: `launch.liveness` (heartbeats on
the reader's clock), `launch.health` (node and storage checks), `launch.exclusion` (bad
nodes), `launch.procs` (the node's processes), `launch.policy` (the decision).

Writes and reads of the run directory on the fault path are tried, never trusted, and
bounded (`launch.bounded`): on a full disk (or one that went read-only, or refuses writes
with any error: EACCES, EIO, or hangs) the launcher still kills its ranks first and says
what it can; the decider compares the nodes' probes of the storage (`policy.storage_verdict`)
and the run stops for it (at once when a person must act, after a wait when the error may
pass), or the nodes that alone saw it sit the attempt out; no node is ever blamed for it.
The decision is reached through node 0's store, whatever the disk does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from hpcshard.launch import coord, exclusion, health, policy
from hpcshard.launch.bounded import Hung, bounded
from hpcshard.launch.liveness import BEAT_S, LOST_S, UNHEARD_S, Peers
from hpcshard.launch.policy import Decision, Facts
from hpcshard.launch.ports import listen_ports
from hpcshard.launch.procs import Agent, alive, children, descendants, kill_below, kill_tree, send
from hpcshard.launch.watchdog import Limits, Watchdog, process_state
from hpcshard.rundir import events, files, flight, launchers, lease, ledger, store
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.progress import Board, board_path
from hpcshard.rundir.rankenv import STORAGE_EXIT, RankEnv
from hpcshard.rundir.spec import RunSpec

__all__ = ["BEAT_S", "LOST_S", "UNHEARD_S", "Agent", "Fenced", "Roster", "Supervisor", "Watch",
           "children", "descendants", "send"]

T = TypeVar("T")

POLL_S = 0.2
"""How often a launcher looks at its board and for a declared fault (a fault or decision
the store pushes wakes it at once: `Channel.wait`)."""
DOWN_LOOK_S = 0.05
"""How often the decider looks for the downs while the store serves (a scan of it; the
files are looked at every POLL_S)."""
DECIDER_LOOK = 2
"""How many launchers below it a launcher watches at a time to find the decider (`decider`)."""
DOWN_TIMEOUT_S = 120.0
"""How long the decider waits for every node to report its ranks dead before it gives up."""
DECIDE_S = 30.0
"""How long a launcher gives the decider, on top of DOWN_TIMEOUT_S, to decide once every
node is down (its reads, each bounded by READ_WAIT_S, and the decision's write)."""
DOWN_TRIES = 3
"""Tries of a launcher's down record that its storage refused for no lack of room."""
WRITE_WAIT_S = 120.0
"""The longest a launcher waits, beating, for one of its writes (`_try`): a ledger lock left
by a holder on another host is broken after files.LOCK_STALE_S, and Slurm's drain gives up
after slurm.client.TIMEOUT_S; a write still hanging after this is a hung mount, and the
fault path goes on without it."""
READ_WAIT_S = 20.0
"""The longest a launcher waits, beating, for one read of the run directory on the fault
path (`_readable`: the checkpoints' listing, the ledger, flight records). A listing takes
seconds on a loaded file system, not tens of them; a read still hanging is a hung mount (a
Lustre OST that is gone hangs a stat of the files on it, while the probe's file, on
another OST, lands), and the decision comes without it: the other launchers wait for it
DOWN_TIMEOUT_S + DECIDE_S after their down records."""
ALL_LOST_S = 30.0
"""How long every launcher with ranks must have been silent before a spare declares them
lost (nobody else is left to say so: `idle`). Longer than the LOST_S they watch each other
by: a silence of all of them at once is more often one starvation of them all (a save, a
swap storm; each comes back and goes on, `_stood_still`) than all their nodes dead, and a
spare on node 0's store hears the others through it (node 0 lost, their beats stop there
LOST_S before the spare finds the store silent and moves to the standby, where they show
up). Declared at LOST_S, the spare's fault named healthy nodes lost, and the spare, the
decider then, declared them bad (drained)."""
LINGER_S = 2 * LOST_S
"""How long node 0's store outlives its launcher's end for the others to end too."""
RENEW_WAIT_S = 2.0
"""The longest the leader's heartbeat waits for its renewal of the run's lease (one small
read, milliseconds): on a hard mount whose server is gone the read hangs, and a leader
silent past LOST_S is taken for lost, its node for bad (`_renew`)."""
KILLED_EXIT_S = 10.0
"""How long the ranks a launcher killed are given to be gone before it clears what they
left of the ledger's lock (`_clear_left`): a process frees its memory before it is gone,
seconds for a large one, and may still take the lock meanwhile. One still there after it
is left to the lock's own rules."""
COMMS_ERRORS = ("DistBackendError", "DistNetworkError", "DistError", "DistStoreError")
"""Exceptions a rank raises because a peer died: a consequence, never the culprit."""
COMMS_MESSAGES = ("gloo/transport", "Connection reset", "Connection closed", "Broken pipe", "NCCL")
"""...and what gloo's and NCCL's RuntimeErrors say when that happens."""
NOT_THE_JOBS = (*COMMS_ERRORS, "LoadFault", "Disowned", "LockLost")
"""Exceptions of hpcshard's own that say the storage or the run failed the rank, never the
job's code: one that persists is bounded by the no-progress rule, not called a bug."""


def _who(culprit: dict[str, Any] | None) -> str:
    """The culprit in one phrase: rank, host, step, and for an exception its line and log."""
    if not culprit:
        return "culprit unknown"
    if "rank" not in culprit:  # a whole node
        return f"node {culprit['node']} ({culprit.get('slurm_node') or culprit.get('host')}), lost"
    text = f"rank {culprit['rank']} on {culprit.get('host', '?')}"
    if culprit.get("step") is not None:
        text += f" at step {culprit['step']}"
    if culprit.get("error"):
        text += f": {culprit['error']}: {culprit.get('message', '')} (traceback in {culprit.get('log')})"
    return text


def _fault(attempt: int, cycle: int, declared: dict[str, Any], culprit: dict[str, Any] | None,
           reached: int, decided: Decision, collectives: list[dict[str, Any]]) -> events.Fault:
    """The fault's ledger record: the declaration (`declared`: what its launcher saw), the
    culprit, the cost and the decision, its fields flat."""
    return events.Fault(
        attempt=attempt, cycle=cycle, cause=declared.get("cause", "unknown"), declared=declared.get("time"),
        culprit=culprit, reached=reached, action=decided.action.value, code=decided.code,
        reason=decided.reason, end=decided.end, active=list(decided.active), spares=list(decided.spares),
        bad=list(decided.bad), replaced=dict(decided.replaced), lost=list(decided.lost),
        committed=decided.committed, host=decided.host, port=decided.port, coord_port=decided.coord_port,
        coord_node=decided.coord_node, rdzv_node=decided.rdzv_node,
        restart=decided.restart,
        lost_steps=max(0, reached - decided.committed),
        # how long the culprit had been silent when a hang was declared; a crash is seen
        # within one look
        detect_s=declared.get("silent_s", POLL_S), collectives=collectives)


def free_port() -> int:
    """A port for the next cycle's rendezvous, on this host (node 0 hosts it), below the
    ephemeral range (`launch.ports`)."""
    return listen_ports(1)[0]


@dataclass(frozen=True)
class Roster:
    """Which launchers' ranks train in a cycle (`active`) and which wait, each ready to take
    a lost node's place (`spares`: allocated for that, `--spares`). A node declared bad is
    in neither, ever again in this attempt."""

    active: tuple[int, ...]
    spares: tuple[int, ...] = ()

    @classmethod
    def first(cls, launchers: int, nodes: int) -> Roster:
        """Cycle 0: the first `nodes` launchers train, the others wait. (An allocation with
        fewer launchers than `nodes`, requeued without bad nodes, trains on them all.)"""
        active = min(nodes, launchers)
        return cls(tuple(range(active)), tuple(range(active, launchers)))

    @property
    def leader(self) -> int:
        """The launcher that watches the others' heartbeats and writes the cycle's records."""
        return self.active[0]

    @property
    def members(self) -> tuple[int, ...]:
        return (*self.active, *self.spares)


class Fenced(Exception):
    """This launcher must leave the run at once and say nothing: it was stopped (its node
    frozen) and its peers went on without it."""


class TakenOver(Fenced):
    """The run was taken over (its lease names another owner): every launcher of this job
    leaves it. The one that finds out says so in its last heartbeat ("fenced"), which its
    peers read as their own order to leave: else they would take its node for lost."""


@dataclass
class Watch:
    """What one cycle came to."""

    code: int
    fault: dict[str, Any] | None = None
    dead: list[dict[str, Any]] = field(default_factory=list)
    """Ranks of this node whose process died while they trained (the culprits)."""
    reached: int = 0
    """The highest step any rank of this node reported."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Where each rank of this node was when the fault came (a flight record names a
    rank; this says where it ran)."""
    flight: dict[int, dict[str, Any]] = field(default_factory=dict)
    """This node's ranks' flight records (`flight.brief`), for the decider."""
    killed: list[int] = field(default_factory=list)
    """The processes this launcher killed (its ranks, and what ran below them): waited for
    before the ledger's lock is cleared (`Supervisor._clear_left`)."""


class Supervisor:
    """A node's ranks, cycle after cycle, until they finish, stop, or the budget ends."""

    def __init__(self, node: Any, run_dir: Path, spec: RunSpec, ranks: RankEnv,
                 start: Callable[[Any, dict[str, str]], Agent],
                 grace: float | None = None, local: bool = False) -> None:
        self.node, self.run_dir, self.spec, self.ranks = node, run_dir, spec, ranks
        self.local = local
        """The local backend (`launch.local`) started this launcher: the command that owns
        the run requeues it, and there is no other node to be given."""
        self.start = start
        self.grace = grace
        """Own scripts: how long after a notice their ranks may run before they are killed."""
        self.proc: Agent | None = None
        self.ending: int | None = None
        """The TERM or INT that came (cancel, the scheduler): the ranks end, nothing restarts."""
        self.ending_sent = False
        """...and whether the cycle's agent has had it (it may have come before the agent was)."""
        self.noticed: float | None = None
        """When a stop notice came: the ranks stop cleanly; a failure then is not restarted."""
        self.told: set[int] = set()
        """The rank pids that have had the notice (ranks that join after it get it too)."""
        self.killed = False
        """The grace period ran out and the ranks were killed."""
        self.where = {"node": node.node_rank, "host": socket.gethostname(),
                      **({"slurm_node": os.environ["SLURMD_NODENAME"]}
                         if os.environ.get("SLURMD_NODENAME") else {})}
        """This node, in every record it writes."""
        self.beaten = self.looked = 0.0
        self.seq = 0
        """This launcher's heartbeats so far (what its peers see move)."""
        self.peers = Peers()
        self.roster = Roster.first(node.nnodes, spec.nodes)
        """Who trains in the current cycle, and who waits."""
        self.order: tuple[int, ...] = self.roster.active
        """The active launchers by node_rank in this cycle's rendezvous."""
        self.seen_bad: set[int] = set()
        self.at_cycle = 0
        self.fenced = False
        """It left the run (fenced off): nothing of it may write to the run any more."""
        self.leaving = False
        """It is saying its last word (its exit code): nothing to judge any more."""
        self.renewed = time.monotonic()
        self.renewal = threading.Event()
        """Set once the last renewal of the lease has answered (`_renew`)."""
        self.renewal.set()
        self.storage = health.Storage()
        """What this launcher's probe of the run directory found wrong in this cycle (false:
        nothing, or no probe yet). Not a write's refusal: a heartbeat that lands says
        nothing of it (one that cleared it lost a probe's EIO before its down record)."""
        self.refusal = ""
        """The last refusal `_try` said (said once)."""
        self.hung = False
        """This launcher found the run directory hung in this cycle (a probe, a write or a
        read gave no answer within its bound): its reads on the fault path give their
        defaults at once, not after a bound each (`_readable`)."""
        self.unhealthy = ""
        """Why this node must not train, as a phrase ("failed its health check: ..."; "" if
        it may): it failed its health check, or the run declared it bad before. It trains
        in no cycle of this attempt."""
        self.declared: dict[int, str] = {}
        """The nodes this launcher declared bad, and why: sent with its down record, so that
        the decider knows them when the run directory refused their records (`decide`)."""
        self.newest = 0
        """The newest committed step the last decision named (`RankEnv.newest`)."""
        self.fault_seen: float | None = None
        """When (monotonic) this launcher saw the last fault (declared it, or was told)."""
        self.graced = 0
        """The channel's moves (to a standby, to the files) after which it gave its peers
        their grace to show up there too (`_isolated`)..."""
        self.grace_ends = self.asked_who = 0.0
        """...when (monotonic) that grace ends, and when it last asked the standby who is
        there."""
        self.chan = coord.Channel(run_dir, self.me)
        """How it speaks with the other launchers: node 0's store once `_run` opened it,
        the run directory's files before and without it (`launch.coord`)."""

    @property
    def me(self) -> int:
        return int(self.node.node_rank)

    # -- heartbeat, lease, and writes that may fail -----------------------------------
    def beat(self, done: int | None = None) -> None:
        """Say this launcher is alive, at most every BEAT_S (called from every wait); `done`:
        it ends with this exit code (never to be taken for lost, nor waited for)."""
        if time.monotonic() - self.beaten < BEAT_S and done is None:
            return
        stalled = time.monotonic() - self.beaten if self.beaten else 0.0
        self.beaten = time.monotonic()
        if stalled > LOST_S and not self.leaving:
            self._stood_still(stalled)
        if not self.leaving:
            self._still_serving()
        self.seq += 1
        record = {**self.where, "pid": os.getpid(), "seq": self.seq,
                  **({"done": done} if done is not None else {})}
        if not self._try("its heartbeat", self.chan.beat, self.ranks.attempt, self.me, record,
                         beating=False):
            self.peers.cannot_beat()  # a full disk must not end supervision, nor lose every peer
            return
        self.peers.beat_landed()
        if done is None:
            self._renew()

    def _try(self, what: str, write: Callable[..., Any], *args: Any, beating: bool = True) -> bool:
        """Write something to the run directory; False (said once, not raised) when it was
        refused: the fault path must go on (kill the ranks, decide) whatever the disk does.
        `beating`: this launcher beats while the write runs (a lock left by a holder on
        another host is broken only after files.LOCK_STALE_S; Slurm's drain may take its
        whole timeout), or its peers would take it for lost; a write still hanging after
        WRITE_WAIT_S is a hung mount, and the fault path goes on without it."""
        try:
            if beating:
                bounded(partial(write, *args), WRITE_WAIT_S, self.beat, POLL_S)
            else:
                write(*args)
        except OSError as err:  # (Hung among them)
            return self._refused(what, err)
        return True

    def _refused(self, what: str, err: OSError) -> bool:
        """A write `_try` could not make: said once, not at each heartbeat (a storage waited
        for minutes refuses every heartbeat written to its files). False."""
        hung = isinstance(err, Hung)
        why = f"the run directory {self.run_dir}: {err}" if hung else health.storage_error(err, self.run_dir)
        if why != self.refusal:
            print(f"hpcshard: node {self.me}: {what} could not be written: {why}", file=sys.stderr,
                  flush=True)
        self.refusal, self.hung = why, self.hung or hung
        return False

    def _readable(self, default: T, read: Callable[..., T], *args: Any) -> T:
        """What `read` found in the run directory, read while this launcher beats; `default`
        where it could not be read (an EIO, an expired ticket, a corrupt file) or gave no
        answer within READ_WAIT_S, and at once once this launcher found the storage hung
        (each read would hang a bound more, and leave a thread more blocked in the kernel):
        the fault path reaches its decision all the same."""
        if self.hung:
            return default
        try:
            return bounded(partial(read, *args), READ_WAIT_S, self.beat, POLL_S)
        except Hung:
            self.hung = True
            return default
        except (OSError, ValueError):
            return default

    def _stood_still(self, seconds: float) -> None:
        """This launcher did not run for `seconds` (its node was frozen, stopped, starved):
        its peers may have declared it lost and gone on without it. Then it leaves the run
        at once and says nothing (Fenced: measured in the chaos soak, a node thawed after
        the run went on declared its peers lost, drained a healthy node in Slurm, and wrote
        failures of an attempt long over). Else its peers' silence counts from now: it
        heard nothing while it stood still."""
        attempt, cycle = self.ranks.attempt, self.at_cycle
        # Decided facts only: a peer's suspicion (a fault naming it lost) is not one, and a
        # launcher that comes back before the decision is kept (it says it is down).
        self.chan.woke()
        found = self.chan.decision(attempt, cycle)
        decided = Decision.from_dict(found) if found else None
        dropped = decided is not None and decided.restart and self.me not in (
            *decided.active, *decided.spares)
        declared = any(r.get("node") == self.me for r in ledger.bad_nodes(self.run_dir, attempt, lost=True))
        if dropped or declared:
            raise Fenced(f"declared lost while it stood still for {seconds:.0f} s")
        if ledger.moved_on(self.run_dir, attempt, cycle):
            raise Fenced(f"the run started again without it while it stood still for {seconds:.0f} s")
        if self._store_left(seconds):
            raise Fenced(f"its peers left its store while it stood still for {seconds:.0f} s")
        self.peers.woke()

    def _store_left(self, seconds: float) -> bool:
        """Node 0, thawed: did most of its peers give its store up meanwhile (they took
        node 0 for lost and go on through the files, and said so: `Server.quit`)? Their
        word reaches it at once, queued while it stood still; a moment for its store's
        thread, frozen with it, to read it. Most, as `_still_serving` and `_isolated`
        count: a few that left are the ones cut off, and leave by themselves. A connection
        closed without that word is a launcher that died (SIGKILL, the OOM killer): it went
        on nowhere, a lost node for this one to declare (counted as one that left, a
        2-node job's node 0 was fenced with nobody left to decide; and the peer that did
        give the store up counts it against itself, `_isolated`, and left too)."""
        server = self.chan.server
        if server is None or seconds <= LOST_S:
            return False
        time.sleep(2 * POLL_S)
        others = set(self.roster.members) - self.seen_bad - {self.me} - server.ended - self.chan.gave_up
        return 2 * len(server.quit & others) > len(others)

    def _still_serving(self) -> None:
        """The launcher that serves the store (node 0, or a decider that served one anew):
        once a peer gave its store up (unanswered for LOST_S: the store's loop behind under
        load, a network blip), that peer took this node for lost and goes on through the
        files; so will every peer when the store stopped answering this node's own
        connection. Once most of its peers did, going on, this node would decide on its
        own in its store while they decide through the files (two decisions for one cycle,
        a healthy node drained on each side). It leaves the run, its store with it:
        whoever is still on the store falls back to the files with the others. (A peer
        that ended, or whose launcher died, said no such thing: `Server.quit`.)"""
        server = self.chan.server
        if server is None:
            return
        if self.chan.lost_why:
            raise Fenced(f"its own store stopped answering it ({self.chan.lost_why})")
        # (a node whose store this one gave up, node 0 for a standby it serves now, is lost
        # to it, not a peer that fell silent: `_isolated` counts the same)
        others = set(self.roster.members) - self.seen_bad - {self.me} - server.ended - self.chan.gave_up
        quit = server.quit & others
        # Most of them: they go on through the files without it. A few: they are the ones
        # cut off (or starved), and leave by themselves (`_isolated`: the same count, seen
        # from their side, so that exactly one side goes on).
        if 2 * len(quit) > len(others):
            raise Fenced(f"node(s) {sorted(quit)} gave its store up (silent to them for {LOST_S:.0f} s)")
        # Cut off from them all (its network, not theirs): their word that they gave it up
        # cannot reach it, but their silence does. Most of the peers it had heard, silent at
        # once, is this node gone, not them: it leaves rather than blame (and drain) them.
        beats = self.chan.beats(self.ranks.attempt, self.node.nnodes, sorted(others))
        heard = [n for n in others if n in self.peers.seen]
        silent = set(self.peers.lost(heard, beats)) | quit
        if len(others) > 1 and 2 * len(silent) > len(others):
            raise Fenced(f"node(s) {sorted(silent)} fell silent at once: it is the one cut off from them")

    def _renew(self) -> None:
        """The cycle's leader renews the run's lease every RENEW_S (`rundir.lease`); one
        that finds the run taken over (a guard, a `resume` that found this job's Slurm state
        over) leaves it at once: its ranks must not commit or clean anything more."""
        if not self.ranks.owner or self.me != self.roster.leader:
            return
        if time.monotonic() - self.renewed < lease.RENEW_S:
            return
        self.renewed = time.monotonic()
        if not self.renewal.is_set():  # (the last one still hangs: not one thread blocked a beat)
            return
        answered = self.renewal = threading.Event()

        def renew() -> bool:
            try:
                return lease.renew(self.run_dir, self.ranks.owner)
            finally:
                answered.set()

        try:  # (bounded: called from every wait's beat, and a silent leader is a lost one)
            kept = bounded(renew, RENEW_WAIT_S, lambda: None, POLL_S)
        except OSError:  # a full or hung disk (Hung): the ranks' own check before a commit stands
            return
        if not kept:
            try:
                now = lease.read(self.run_dir)
                who = now.what or now.name if now else "nobody"
            except (lease.Busy, OSError) as err:
                who = f"an owner it cannot read ({err})"
            raise TakenOver(f"the run was taken over by {who}")

    def _check_fenced(self, beats: dict[int, dict[str, Any]]) -> None:
        """A peer that found the run taken over left it and said so: this one leaves too."""
        if why := self.chan.fenced(self.ranks.attempt):
            raise TakenOver(f"a peer found the run taken over: {why}")
        for n in self.roster.members:
            if n != self.me and beats.get(n, {}).get("fenced"):
                raise TakenOver(f"node {n} found the run taken over: {beats[n]['fenced']}")

    def lost(self, nodes: list[int] | tuple[int, ...]) -> list[int]:
        """Which of these nodes are lost: their heartbeat stood still for LOST_S (or never
        heard of, UNHEARD_S after this launcher began). One that said it ended is not."""
        return self._look(nodes)[0]

    def _look(self, nodes: list[int] | tuple[int, ...]) -> tuple[list[int], dict[int, dict[str, Any]]]:
        """The lost ones of `nodes`, and every heartbeat as read (one read of them)."""
        self.beat()  # (a launcher stopped since its last beat must not judge before it knows)
        if self.chan.fell_back:
            self._isolated()
        beats = self.chan.beats(self.ranks.attempt, self.node.nnodes, nodes)
        self._check_fenced(beats)
        return self.peers.lost(nodes, beats), beats

    def _isolated(self) -> None:
        """This launcher gave node 0's store up (for the standby, or the files). Either node
        0 is lost, and every launcher gives it up within a second or two and shows up where
        this one went; or this one was cut off (or starved) alone while the others stay
        with the store and will take it for lost. Each peer gets a grace from the move to
        show up; when, after that, most of them have not, it is this launcher that is gone:
        it leaves the run and blames nobody (measured before this: one launcher starved of
        the CPU at 128 emulated nodes fell back alone and declared 118 healthy nodes lost)."""
        others = [n for n in self.roster.members
                  if n != self.me and n not in self.chan.gave_up and n not in self.seen_bad]
        if self.graced != self.chan.moves:
            self.graced = self.chan.moves
            # On the standby, its peers show up as soon as each finds the store silent too
            # (within a heartbeat or two of this one). In the files, as late as NFS may
            # hide their heartbeat files: a spare had never watched its peers' heartbeats
            # before, and on the chaos soak's NFS-like views one that gave them LOST_S took
            # itself for the one cut off while they had fallen back too.
            seconds = 2 * LOST_S if self.chan.store is not None else UNHEARD_S + LOST_S
            self.peers.grace(others, seconds)
            self.grace_ends = time.monotonic() + seconds
        if not others:
            return
        if self.chan.store is not None:
            ended = {n for n, (mark, _) in self.peers.seen.items() if mark[2] is not None}
            self._arrived([n for n in others if n not in ended])  # (one that ended comes nowhere)
            return
        beats = self.chan.beats(self.ranks.attempt, self.node.nnodes, others)
        others = [n for n in others if "done" not in beats.get(n, {})]  # (those that ended count for nobody)
        gone = self.peers.lost(others, beats)
        if 2 * len(gone) > len(others):
            raise Fenced(f"it gave up the store of node(s) {sorted(self.chan.gave_up)}, and {len(gone)} "
                         f"of its {len(others)} other peers did not: it is the one cut off")

    def _arrived(self, others: list[int]) -> None:
        """`_isolated` on the standby: who is there, the standby says itself (connected,
        or ended there), asked every 2 s (not every peer's heartbeat each second: at 1,000
        nodes that was a megabyte a second per launcher, from one loop). All there: the move
        is over. After the grace, most missing: this one is the one cut off; most there:
        the move is over too (the rest are lost, or on the files, heard there for a while:
        `coord.Channel._bridging`)."""
        now = time.monotonic()
        if now - self.asked_who < 2 * BEAT_S:
            return
        self.asked_who = now
        here = self.chan.present()
        if here is None:
            return
        missing = [n for n in others if n not in here]
        if not missing:
            self.chan.settle(everyone=True)
        elif now >= self.grace_ends:
            if 2 * len(missing) > len(others):
                raise Fenced(f"it moved to node {self.chan.host_node}'s standby store, and {len(missing)} "
                             f"of its {len(others)} other peers did not: it is the one cut off")
            self.chan.settle(everyone=False)

    # -- one cycle -------------------------------------------------------------------
    def run(self) -> int:
        """Supervise this node's ranks until the run ends here; the exit code. A launcher
        fenced off (`_stood_still`, a lost lease) returns 0 and writes nothing more."""
        try:
            code = self._run()
        except Fenced as why:  # its ranks must not train on, nor it speak for the run
            self.fenced = True
            killed = kill_below(os.getpid())  # agents, ranks, zygote, a health check
            print(f"hpcshard: node {self.me} leaves the run: {why}", file=sys.stderr, flush=True)
            if isinstance(why, TakenOver):  # (its peers leave too, and take it for nothing worse)
                with contextlib.suppress(OSError):
                    self.chan.fence(self.ranks.attempt, str(why))
                last = {**self.where, "pid": os.getpid(), "seq": self.seq + 1, "done": 0, "fenced": str(why)}
                for say, *where in ((self.chan.beat,), (launchers.beat, self.run_dir)):
                    self._try("its last heartbeat", say, *where, self.ranks.attempt, self.me, last,
                              beating=False)
            self._clear_left(killed, beating=False)  # (after its last word: it may wait for them)
            # (only a take-over's push needs its store to outlive it; any other fence is its
            # peers going on without it: those still on its store must fall back to the
            # files now, with the others, not decide through it for LINGER_S more)
            self._close(linger=isinstance(why, TakenOver))
            return 0  # (not a failure: a non-zero exit would take the others' job down)
        except BaseException:
            # A bug here must not leave ranks training unsupervised, nor peers waiting for a
            # node whose launcher is gone: kill them, and say this launcher is done.
            killed = kill_below(os.getpid())
            self._done(1)
            self._clear_left(killed, beating=False)  # (after its last word: it may wait for them)
            self._close()
            raise
        self._done(code)
        self._close()
        return code

    def _done(self, code: int) -> None:
        """The last heartbeat: this launcher ends with `code` (peers do not wait for it). In
        the files too (one write an attempt): should node 0's store be lost after this
        launcher ended, the others learn from them that it did."""
        self.leaving = True  # (no judging anyone on the way out)
        self.beat(done=code)
        if self.chan.store is not None:
            self._try("its last heartbeat", launchers.beat, self.run_dir, self.ranks.attempt, self.me,
                      {**self.where, "pid": os.getpid(), "seq": self.seq, "done": code}, beating=False)

    def _close(self, linger: bool = True) -> None:
        """Leave the store. Node 0 serves it until the others have left too (each closes
        its connection as it ends; one lost never will), at most LINGER_S."""
        server = self.chan.server
        if server is not None and linger:
            deadline = time.monotonic() + LINGER_S
            while set(server.conns) - {self.me} - self.seen_bad and time.monotonic() < deadline:
                time.sleep(POLL_S)
        self.chan.close()

    def _open(self) -> None:
        """Join node 0's store (node 0 serves it), or stay on the files without one. A spec
        written before the store has no key: a store would let in anyone who shows none."""
        if coord.mode() == "store" and self.node.coord_port and self.spec.coord_key:
            self.chan.open(str(self.node.rdzv_host), int(self.node.coord_port), self.spec.coord_key,
                           self.ranks.attempt, serve=self.me == 0, where=self.where, waiting=self.beat,
                           nodes=int(self.node.nnodes))
            self._stand_by()

    def _stand_by(self) -> None:
        """The lowest launcher of the roster but the store's host serves the standby store
        for it (`coord.Channel.stand_by`): node 1 for node 0's, and after a restart that
        moved the store, the next one for the new host's."""
        others = sorted(n for n in self.roster.members if n not in self.seen_bad and n != self.chan.host_node)
        if others and others[0] == self.me and self.chan.standby is None and self.chan.server is None:
            self.chan.stand_by(self._host())

    def _run(self) -> int:
        self._open()
        self.beat()
        cycle = 0
        node = replace(self.node, nnodes=len(self.roster.active))
        found = health.check(self.run_dir, leader=self.me == self.roster.leader,
                             ranks=int(self.node.per_node), command=self.spec.health_check, waiting=self.beat)
        self.hung = found.storage.hung
        self._unfit(found.node)
        watch = self._storage_fault(found.storage) if found.storage else None
        while True:
            self.at_cycle = cycle
            if watch is None:
                if self.ending is not None:  # a cancel before the ranks started: none start
                    return 128 + self.ending
                if self.me in self.roster.active and not self.unhealthy:
                    watch = self.cycle(replace(node, node_rank=self.order.index(self.me)), cycle)
                else:
                    watch = self.idle(cycle)
            if watch.fault is None:
                return watch.code
            decided, watch = self.recover(cycle, watch), None
            if not decided.restart or self.ending is not None:
                return decided.code
            cycle += 1
            # (the decider found the storage answering, or this node sits out: its next
            # recovery probes the storage again)
            self.hung, self.storage = False, health.Storage()
            self.newest = decided.committed  # (rank 0 looks it up by name if it must)
            # (node_rank 0 hosts the static rendezvous: the decider, on whose host it is)
            first = [decided.rdzv_node] if decided.rdzv_node in decided.active else []
            self.order = (*first, *(n for n in decided.active if n not in first))
            self._join(decided, cycle)
            self.roster = Roster(decided.active, decided.spares)
            self._stand_by()
            node = replace(self.node, nnodes=len(self.roster.active), rdzv_host=decided.host,
                           rdzv_port=decided.port, run_id=f"{self.node.run_id}-c{cycle}")

    def _storage_fault(self, seen: health.Storage) -> Watch:
        """The health check's probe found the run directory refusing writes: nobody trains
        before the nodes' probes are compared (`decide`: stop, wait for the storage, or go
        on without the nodes that saw it alone), and no node is blamed. A fault of cycle 0."""
        print(f"hpcshard: node {self.me}: {seen.why}", file=sys.stderr, flush=True)
        cause = {"cause": "the health check's write probe", "storage": seen.why, **self.where}
        self._try("its fault declaration", self.chan.declare_fault, self.ranks.attempt, 0, cause)
        self.storage = seen
        return Watch(code=STORAGE_EXIT, fault=self._readable(None, self.chan.fault, self.ranks.attempt, 0)
                     or cause)

    def _unfit(self, failed: str) -> None:
        """Must this node sit the attempt out? It failed its health check (`failed`), or the
        run declared its Slurm node bad before and the job was placed on it again
        (`exclusion.declared_before`). Then it is bad (the ledger, a drain where asked),
        and it never trains in this attempt: the decider gives its place to a spare, or
        goes on without it; given ranks all the same, it declares a fault (`idle`)."""
        again = "" if failed else self._readable("", exclusion.declared_before, self.run_dir,
                                                 self.where.get("slurm_node", ""))
        if not (failed or again):
            return
        self.unhealthy = f"failed its health check: {failed}" if failed else f"must not train: {again}"
        self._bad(0, self.me, self.where, f"health check: {failed}" if failed else again)
        name = self.where.get("slurm_node", self.where["host"])
        print(f"hpcshard: node {self.me} ({name}) {self.unhealthy}", file=sys.stderr, flush=True)

    def idle(self, cycle: int) -> Watch:
        """A launcher without ranks this cycle (a spare, or a node declared bad): alive and
        watching until a fault needs it (it takes part in the recovery, and may be given a
        lost node's place) or every launcher with ranks has ended (it ends as they did).
        Bounded by the others' liveness: it waits only while a launcher with ranks beats.
        One given ranks it cannot run (it failed its health check; the decider did not
        know, its record refused by the storage) says so at once: its peers would wait for
        its ranks, and with every node of the cycle unhealthy or a spare nobody declared
        anything (both launchers idled until the time limit)."""
        attempt = self.ranks.attempt
        if self.unhealthy and self.me in self.roster.active:
            self._try("its fault declaration", self.chan.declare_fault, attempt, cycle,
                      {"cause": f"node {self.me} {self.unhealthy}", **self.where})
        while True:
            self.beat()
            fault = self.chan.fault(attempt, cycle)
            if fault is not None:
                self.fault_seen = time.monotonic()
                return Watch(code=1, fault=fault)
            lost, beats = self._look(self.roster.active)  # (one read of the heartbeats; none that ended)
            ended = [n for n in self.roster.active if "done" in beats.get(n, {})]
            if ended and set(ended) | set(lost) >= set(self.roster.active):
                return Watch(code=int(beats[ended[0]]["done"]))
            if (lost and set(lost) >= set(self.roster.active)  # (nobody else is left to say so)
                    and set(self.peers.lost(lost, beats, after=ALL_LOST_S)) >= set(lost)):
                self._try("its fault declaration", self.chan.declare_fault, attempt, cycle,
                          {**self.where, "noticed": self.noticed is not None, "lost": lost,
                           "cause": f"node(s) {lost} lost: silent for {ALL_LOST_S:.0f} s"})
                if (fault := self.chan.fault(attempt, cycle)) is not None:
                    self.fault_seen = time.monotonic()
                    return Watch(code=1, fault=fault)
            if self.ending is not None:
                return Watch(code=0)
            self.chan.wait(POLL_S)

    def watch_peers(self, cycle: int) -> None:
        """Every BEAT_S: the cycle's leader reads every other launcher's heartbeat, the
        others the leader's. An active node gone silent for LOST_S is a fault declared at
        once (its ranks may be stopped mid-collective: the others would only hang); a lost
        spare is marked bad and never used."""
        if time.monotonic() - self.looked < BEAT_S:
            return
        self.looked = time.monotonic()
        roster = self.roster
        watched = ([n for n in roster.members if n != self.me] if self.me == roster.leader
                   else [roster.leader])
        lost = self.lost(watched)
        for n in (n for n in lost if n in roster.spares and n not in self.seen_bad):
            self.seen_bad.add(n)
            where = self.chan.beats(self.ranks.attempt, self.node.nnodes, [n]).get(n, {})
            self._bad(cycle, n, where, f"lost: its launcher was silent for {LOST_S:.0f} s (a spare)")
        gone = [n for n in lost if n in roster.active]
        if gone:
            self._try("its fault declaration", self.chan.declare_fault, self.ranks.attempt,
                      cycle, {**self.where, "noticed": self.noticed is not None, "lost": gone,
                              "cause": f"node(s) {gone} lost: silent for {LOST_S:.0f} s"})

    def cycle(self, node: Any, cycle: int) -> Watch:
        path = board_path(node.run_id, node.node_rank)
        board = Board.create(path, node.per_node)
        env = replace(self.ranks, cycle=cycle, board=str(path),
                      resume=self.ranks.resume if cycle == 0 else "auto", newest=self.newest)
        self.told.clear()
        self.ending_sent = False
        self.proc = None  # (a TERM while the agent starts is for the new one: `_tell`)
        try:
            self.proc = self.start(node, env.to_environ())
        except (OSError, RuntimeError) as err:  # no agent (a dead zygote, no memory to fork)
            board.close(remove=True)
            return self._no_agent(cycle, err)
        try:
            watch = self._watch(self.proc, board, cycle)
        finally:
            board.close(remove=True)
        self._clear_left(watch.killed)  # (its ranks ended, or were killed)
        return watch

    def _clear_left(self, killed: list[int], beating: bool = True) -> None:
        """This node's ranks ended, or were killed (`killed`, once they are gone, within
        KILLED_EXIT_S): the ledger's lock, if one of them held it as it was killed, is
        broken now, and their side files removed. A rank appends as it fails, which is the
        moment it is killed, and a waiter on another host cannot look a pid of this host
        up: it would wait files.LOCK_STALE_S (the decider's records with it). Done before
        this node says it is down, so the decider's records, which come after every down,
        find the lock free. Bounded as every other look at the run directory on the fault
        path (`_readable`), and nothing at all once the storage was found hung; one that
        hangs here finds it hung (the reads after it give their defaults at once). A
        launcher on its way out (`beating` false: after its last word) is bounded too: it
        would hang there for as long as the mount does, its task and the job's step with it."""
        if self.hung:
            return
        clear = partial(files.clear_left, self.run_dir / ledger.LEDGER, killed, wait=KILLED_EXIT_S,
                        waiting=lambda: None)  # (this thread beats: `bounded`)
        try:
            bounded(clear, KILLED_EXIT_S + READ_WAIT_S, self.beat if beating else lambda: None, POLL_S)
        except Hung:
            self.hung = True
        except OSError:  # (storage that refuses it: the fault path goes on)
            pass

    def _no_agent(self, cycle: int, err: BaseException) -> Watch:
        """The cycle's agent could not be started: a fault of this node's like any other
        (the others stop, the decider restarts within the budget; the next start makes a
        new zygote if the old one died)."""
        self.fault_seen = time.monotonic()
        info = {**self.where, "noticed": self.noticed is not None,
                "cause": f"node {self.me} could not start its agent ({err})"}
        self._try("its fault declaration", self.chan.declare_fault, self.ranks.attempt,
                  cycle, info)
        return Watch(code=1, fault=self.chan.fault(self.ranks.attempt, cycle) or info)

    def _tell(self, proc: Agent, slots: list[Any]) -> None:
        """Signals that came before there was anyone to hear them reach the ranks now. A
        notice goes to every rank that has joined the board since (a rank is on its board
        only once its handler is in: earlier, the notice is ignored or kills it), even one
        that came while the agent was still in its rendezvous: lost before, a time-limit
        notice so lost ended in TIMEOUT, never requeued. A TERM or INT (cancel) that came
        before the agent existed goes to it as soon as it does (before, the run trained on
        to its end)."""
        if self.ending is not None and not self.ending_sent:
            proc.send_signal(self.ending)
            self.ending_sent = True
        if self.noticed is not None:
            new = [s.pid for s in slots if s.pid not in self.told and s.phase != "done"]
            send(new, self.ranks.notice_signal)
            self.told.update(new)

    def _watch(self, proc: Agent, board: Board, cycle: int) -> Watch:
        attempt = self.ranks.attempt
        dog = Watchdog(Limits.from_config(self.spec.resolved.config), poll_s=POLL_S)
        hang: dict[str, Any] | None = None
        learned = False
        found = self.chan.decision(attempt, cycle - 1) if cycle else None
        before = Decision.from_dict(found) if found else None
        while True:
            self.beat()
            self.watch_peers(cycle)
            code = proc.poll()
            slots = board.read()
            reached = max((s.step for s in slots), default=0)
            self._tell(proc, slots)
            if before is not None and self._recovered(cycle, before, slots):
                before = None
            # A cancel, a script's grace that ran out, or a script told to stop (its ranks
            # may die of the notice, or save inside a step for any time): they end as they
            # will; nothing is a fault now.
            if self.ending is not None or self.killed or (self.noticed is not None and self.spec.script):
                self._grace(proc)
                # (another node may have declared a fault before its notice came: take part)
                if code is not None or (self.spec.script and self.ending is None and not self.killed
                                        and self.chan.fault(attempt, cycle)):
                    break
                time.sleep(POLL_S)
                continue
            dead = [{"rank": s.rank, "pid": s.pid, "step": s.step, "phase": s.phase, **self.where}
                    for s in slots if s.phase != "done" and not alive(s.pid)]
            if code is None and not dead:
                hang = dog.look(slots)
                if not learned and dog.step_limit() is not None:
                    learned = self._learned(dog, cycle)
            if code is not None or dead or hang or self.chan.fault(attempt, cycle):
                break
            self.chan.wait(POLL_S)
        self.fault_seen = time.monotonic()
        fault = self.chan.fault(attempt, cycle)
        if code and self.spec.script and fault is None and not dead:
            ended = board.read()
            if len(ended) == board.slots and all(s.phase == "done" for s in ended):
                # Every rank of a script left on purpose (finished, or stopped on REQUEUE: a
                # script reports done only then); the agent's code came after, from
                # teardown (seen under load: torchrun exits 1 once its ranks exited 0).
                # Restarting would train past the end (Trainer did one step more).
                print(f"hpcshard: node {self.me}: every rank finished; the launcher's exit {code} "
                      "after them is not a fault", file=sys.stderr, flush=True)
                code = 0
        stopped_on_notice = self.noticed is not None and fault is None and (
            self.spec.script or (code is not None and not dead))
        if code == 0 or self.ending is not None or self.killed or stopped_on_notice:
            # Done, cancelled, or stopped on the notice (whatever the exit: not restarted).
            return Watch(code=code if code is not None else proc.wait(), reached=reached)
        if code is not None and not dead and self._final(cycle):
            return Watch(code=code, reached=reached)  # restarting would change nothing
        # A fault, also after a notice (a rank that died while the job stopped): the decider
        # then sends the job back through the queue instead of restarting it here.
        info = self._cause(code, dead, hang, cycle)
        if fault is None:  # (tried: a full disk must not keep this launcher from its ranks)
            self._try("its fault declaration", self.chan.declare_fault, attempt, cycle, info)
        now = board.read()
        where = [{"rank": s.rank, "pid": s.pid, "step": s.step, "phase": s.phase, **self.where,
                  "state": process_state(s.pid) or "gone"} for s in now]
        left = [s for s in now if s.phase != "done" and alive(s.pid)]
        stopped = [{"rank": s.rank, "pid": s.pid, "step": s.step, "phase": s.phase, **self.where,
                    "state": "stopped"} for s in left if process_state(s.pid) in ("T", "t")]
        live = [s.pid for s in left]
        # Stacks and flight records say where a hang was: 1.3 s of waiting on every node
        # (measured in `bench control`) that a crash or a lost node, whose culprit is
        # known, does not need.
        hung = hang is not None or "silent_s" in (self.chan.fault(attempt, cycle) or fault or {})
        killed: list[int] = []
        if proc.poll() is None:
            killed = kill_tree(proc, stacks=live if hung else [], also=live)
        elif live:  # the agent died and left its ranks behind: they must not train on
            killed = kill_tree(proc, also=live)
        declared = self.chan.fault(attempt, cycle) or fault or info
        return Watch(code=proc.returncode or 1, fault=declared, dead=dead + stopped, reached=reached,
                     ranks=where, flight=self._readable({}, flight.read_ranks, self.run_dir, attempt, cycle,
                                                        [s.rank for s in now]), killed=killed)

    def _cause(self, code: int | None, dead: list[dict[str, Any]], hang: dict[str, Any] | None,
               cycle: int) -> dict[str, Any]:
        """The fault this launcher declares: what it saw."""
        info: dict[str, Any] = {**self.where, "noticed": self.noticed is not None}
        if hang:
            info.update({k: hang[k] for k in ("cause", "rank", "step", "phase", "pid", "state",
                                              "limit", "silent_s")})
        elif dead:
            info.update(cause=f"rank {dead[0]['rank']} died (its process is gone)", rank=dead[0]["rank"],
                        step=dead[0]["step"])
        elif code is not None and (slow := self._readable(list[dict[str, Any]](), exclusion.stragglers,
                                                          self.run_dir, self.ranks.attempt, cycle)):
            info.update(cause="a node with every link slow (health_link_gbps): stopped before training"
                        if slow[0].get("kind") == "link" else
                        "a straggler (straggler_policy=bad_node): the ranks saved and stopped")
        else:
            info.update(cause=f"the ranks of node {self.me} failed (exit {code})")
        return info

    def _learned(self, dog: Watchdog, cycle: int) -> bool:
        """The leader, once per cycle: the step limit its watchdog learned, in the ledger."""
        if self.me == self.roster.leader:
            limits = dog.limits
            self._try("the watchdog's limit", ledger.append, self.run_dir, events.Watchdog(
                attempt=self.ranks.attempt, cycle=cycle, step_limit=round(dog.step_limit() or 0, 3),
                median_step=round(dog.median(), 4), factor=limits.factor, floor_s=limits.floor_s,
                phase_s=limits.phase_s, join_s=limits.join_s))
        return True

    def _recovered(self, cycle: int, decided: Decision, slots: list[Any]) -> bool:
        """The leader, after a restart: once a rank trains past the step it resumed from, the
        ledger says how long the fault cost: from the moment this launcher saw the fault
        to training again, on its own monotonic clock (no two hosts' clocks compared: a
        skew of seconds would be in the figure). Through the store a fault reaches every
        launcher within milliseconds of its declaration; through the files (node 0 lost),
        as late as the file system shows it, which this figure leaves out."""
        resumed = decided.committed
        if self.me != self.roster.leader or not any(s.phase == "step" and s.step > resumed for s in slots):
            return False
        seen = self.fault_seen if self.fault_seen is not None else time.monotonic()
        self._try("the recovery's time", ledger.append, self.run_dir, events.Recovered(
            attempt=self.ranks.attempt, cycle=cycle, step=resumed + 1,
            seconds=round(time.monotonic() - seen, 2)))
        return True

    def _grace(self, proc: Agent) -> None:
        """A script still running `grace` seconds after the notice: kill its ranks (torchrun
        then ends); an hpcshard job stops at its next step by itself."""
        if (self.grace is not None and self.noticed is not None and not self.killed
                and time.monotonic() - self.noticed > self.grace):
            send(children(proc.pid), signal.SIGKILL)
            self.killed = True

    def _final(self, cycle: int) -> bool:
        """The runtime ended this cycle on purpose: a bad value (exit 2, one line), a
        non-finite loss (which stops the run) or storage that took no checkpoint. Not
        faults: a restart changes nothing."""
        end = self._readable(None, ledger.end_of, self.run_dir, self.ranks.attempt) or {}
        return end.get("cycle", 0) == cycle and bool(
            end.get("user_error") or end.get("reason") in (EndReason.NONFINITE, EndReason.STORAGE))

    # -- between cycles --------------------------------------------------------------
    def recover(self, cycle: int, watch: Watch) -> Decision:
        """Say this node is down, then wait for the decision: the decider's, or, once the
        launchers below this one are all lost, this one's own. The down record says what
        this node's probe found of the run directory: the decider compares the nodes' probes
        (`decide`). One that nobody hears (the launchers speak through the files, which the
        storage refuses) decides alone: it waits for the storage itself where its error may
        pass, and the run stops for it where it never answers."""
        if not self.storage:
            # The down record goes to node 0's store, which a run directory that refuses
            # writes does not refuse: a write of its own says whether the storage was why
            # the ranks failed (they stop with STORAGE_EXIT, which their agent reports as 1;
            # or fail on an EACCES, an EIO), whatever the error.
            self.storage = health.storage_problem(self.run_dir, waiting=self.beat)
            self.hung = self.hung or self.storage.hung
        seen = self.storage
        said = self._say_down(cycle, watch)
        if not said and seen and not seen.lasting:
            self.storage = self._wait_for_storage(seen)
            said = self._say_down(cycle, watch)
        if not said and seen:
            return self._conclude(cycle, watch, policy.decide(Facts(
                cycle=cycle, active=self.roster.active, storage=self.storage.why,
                noticed=self.noticed is not None, committed=self._seen_committed())))
        return self._decision(cycle, watch, wait=health.STORAGE_WAIT_S if seen else 0.0)

    def _say_down(self, cycle: int, watch: Watch) -> bool:
        """This node's down record, with what its probe found of the run directory and the
        nodes it declared bad (their records may be what the storage refused, and the
        decider must not give them ranks again: `decide`). Tried again for a file server's
        blip (ESTALE, EIO), unless the probe said what is wrong."""
        down = {"host": self.where["host"], "dead": watch.dead, "reached": watch.reached,
                "ranks": watch.ranks, "flight": watch.flight, "committed": self._seen_committed(),
                **({"storage": self.storage.why, "lasting": self.storage.lasting} if self.storage else {}),
                **({"bad": {str(n): why for n, why in self.declared.items()}} if self.declared else {})}
        for _ in range(DOWN_TRIES):
            if self._try("its down record", self.chan.mark_down, self.ranks.attempt, cycle, self.me, down):
                return True
            if self.storage:
                return False
            time.sleep(1.0)
        return False

    def _wait_for_storage(self, seen: health.Storage) -> health.Storage:
        """Storage whose error may pass (EIO, ESTALE, EACCES, a mount that hangs), probed
        again while this launcher beats, for up to health.STORAGE_WAIT_S; what it answered
        (false: a write landed). A notice ends the wait, the storage not shown to last: the
        job goes back through the queue (its time limit would end it, never requeued), and
        the next attempt's probe tries the storage again. So does a cancel."""
        print(f"hpcshard: node {self.me}: {seen.why}; trying it again for up to "
              f"{health.STORAGE_WAIT_S:.0f} s", file=sys.stderr, flush=True)
        began = time.monotonic()
        found = health.wait_for_storage(self.run_dir, seen, self.beat, stop=self._told_to_end)
        self.hung = found.hung
        if found and not found.lasting and self._told_to_end():
            found = health.Storage()
        elif not found:
            print(f"hpcshard: node {self.me}: the run directory {self.run_dir} takes writes again after "
                  f"{time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
        return found

    def _told_to_end(self) -> bool:
        """A stop notice or a cancel came: nothing waits for the storage any more."""
        return self.noticed is not None or self.ending is not None

    def _decision(self, cycle: int, watch: Watch, wait: float) -> Decision:
        """The decision of cycle `cycle`, once this node's down record is said: shared by the
        decider, or this one's own. `wait`: how long a decider may wait for the storage on
        top of gathering the downs (this node saw it refuse a write)."""
        attempt = self.ranks.attempt
        deadline = time.monotonic() + DOWN_TIMEOUT_S + DECIDE_S + wait
        while True:
            self.beat()  # (first: one frozen here past the deadline is fenced, not failed)
            found = self.chan.decision(attempt, cycle)
            if found is not None:
                return Decision.from_dict(found)
            if self.decider() == self.me:
                return self.decide(cycle, watch)
            if time.monotonic() >= deadline:
                return self._conclude(cycle, watch, Decision(
                    action=policy.Action.STOP, code=1, end=EndReason.UNREPORTED,
                    reason="no launcher decided (are they gone?)"), share=False)
            self.chan.wait(POLL_S)

    def decider(self) -> int:
        """Who decides after a fault: the lowest launcher of the job not lost (not bad), and
        still there: one whose last heartbeat says it ended decides nothing (in the chaos
        soak the survivors waited for an ended one until they gave up, 150 s).

        Looked for DECIDER_LOOK at a time from the lowest, the next ones only once those
        are gone: each launcher watching every launcher below it brought N^2/2 heartbeats
        through node 0's store with every beat of a recovery (at 512 nodes 11 MB and 0.37 s
        of its loop, measured). Two at a time, two lowest lost at once are both seen lost
        after LOST_S; the next one, first looked at then, is taken as there (a launcher
        first heard is not lost before LOST_S) until it shows it is not."""
        members = sorted(n for n in self.roster.members if n not in self.seen_bad)
        below = [n for n in members if n < self.me]
        for start in range(0, len(below), DECIDER_LOOK):
            window = below[start:start + DECIDER_LOOK]
            lost, beats = self._look(window)
            there = [n for n in window if n not in lost and "done" not in beats.get(n, {})]
            if there:
                return there[0]
        return self.me

    def decide(self, cycle: int, watch: Watch) -> Decision:
        """Once every node is down (or lost): gather the facts, ask the policy, record the
        decision and share it (first decider wins)."""
        attempt = self.ranks.attempt
        members = [n for n in self.roster.members if n not in self.seen_bad]
        lost, missing, ended = self._gather(cycle, members)
        downs = self.chan.downs(attempt, cycle, self.node.nnodes)
        storage, unfit = self._storage_verdict(members, downs)
        bad: dict[int, str] = {}
        noticed = self.noticed is not None or bool((watch.fault or {}).get("noticed"))
        judged: list[tuple[int, dict[str, Any], str]] = []
        if not storage:  # nothing went wrong with the disk: blame the nodes that earned it
            beats = self.chan.beats(attempt, self.node.nnodes, lost)
            judged = [(n, beats.get(n, {}), f"lost: its launcher was silent for {LOST_S:.0f} s")
                      for n in lost]
            # (after a notice the job goes back through the queue: stragglers are not judged)
            judged += [] if noticed else self._readable([], exclusion.slow_nodes, self.run_dir, attempt,
                                                        cycle, downs)
            bad = {**self._known_bad(downs), **{n: why for n, _, why in judged}}
        # The newest commit any node sees: the one whose rank 0 made it does at once, another
        # host's listing may not for NFS's directory cache (30-60 s).
        committed = max([self._seen_committed(), *(int(d.get("committed") or 0) for d in downs)])
        facts = Facts(cycle=cycle, active=self.roster.active, spares=self.roster.spares,
                      min_nodes=self.spec.min_nodes, local=self.local,
                      lost=tuple(lost), unreported=tuple(n for n in missing if n not in lost),
                      ended=ended, bad=bad, unfit=unfit, noticed=noticed,
                      bug=self._same_bug(cycle), stalled=self._stalled(cycle, committed),
                      committed=committed, storage=storage, max_restarts=self.spec.max_restarts,
                      no_progress_restarts=self.spec.no_progress_restarts)
        self.seen_bad |= set(facts.bad)
        decided = policy.decide(facts)
        serving: coord.Server | None = None
        if decided.restart:
            decided = replace(decided, port=free_port(), host=self._host(), rdzv_node=self.me)
            serving = self._serve_anew()
            if serving is not None:
                decided = replace(decided, coord_port=serving.port, coord_node=self.me)
            elif self.chan.gave_up and self.chan.server is not None and self.chan.store is not None:
                # (it serves the standby the launchers moved to: one that could not reach
                # it, and went on through the files, joins it with the decision)
                decided = replace(decided, coord_port=self.chan.server.port, coord_node=self.me)
        decided = self._conclude(cycle, watch, decided, downs, blame=judged)
        if serving is not None and (decided.coord_port != serving.port or decided.host != self._host()):
            serving.close()  # (another decider's decision stands, with its own store)
        return decided

    def _gather(self, cycle: int, members: list[int]) -> tuple[list[int], list[int], dict[int, int]]:
        """Wait (up to DOWN_TIMEOUT_S) until every member has said it is down, is lost, or
        ended; (lost, missing: neither down nor ended, ended: with their exit codes)."""
        attempt, deadline = self.ranks.attempt, time.monotonic() + DOWN_TIMEOUT_S
        while True:
            self.beat()
            down = self.chan.nodes_down(attempt, cycle, self.node.nnodes)
            candidates = sorted(set(members) - set(down))
            lost, beats = self._look(candidates)
            # A launcher that ended (its ranks finished, or stopped on a notice) says so in
            # its last heartbeat: it will not say it is down, and is not waited for.
            ended = {n: int(beats[n]["done"]) for n in candidates if "done" in beats.get(n, {})}
            missing = [n for n in candidates if n not in ended]
            if set(lost) == set(missing) or time.monotonic() > deadline:
                return lost, missing, ended
            self.chan.wait(POLL_S, on_store=DOWN_LOOK_S)

    def _storage_verdict(self, members: list[int], downs: list[dict[str, Any]]) -> tuple[str, dict[int, str]]:
        """The nodes' probes of the run directory, compared (`policy.storage_verdict`): why
        the run stops for its storage ("" if it does not), and the nodes that sit this
        attempt out for what they alone saw (a stale mount: the run stopped for one node's
        view of it). Where every node that reported saw an error that may pass, this decider
        waits for the storage first (`_wait_for_storage`: a 2.5 s EIO while a file server
        failed over stopped the run for good); the others wait for its decision meanwhile
        (`_decision`: they saw the error too)."""
        told = {int(d["node"]): d for d in downs if int(d["node"]) in members}
        seen = {n: str(d["storage"]) for n, d in told.items() if d.get("storage")}
        lasting = {n for n in seen if told[n].get("lasting")}
        if self.storage and self.me in members:  # (its own, its down record refused or not)
            seen[self.me] = self.storage.why
            lasting |= {self.me} if self.storage.lasting else set()
        verdict = policy.storage_verdict(seen, lasting, set(told) - set(seen))
        if not verdict.wait:
            return verdict.stop, verdict.unfit
        return self._wait_for_storage(health.Storage(verdict.wait, hung=self.hung)).why, {}

    def _known_bad(self, downs: list[dict[str, Any]]) -> dict[int, str]:
        """The nodes declared bad in this attempt, as the launchers know them: the ledger's
        records, and what each launcher declared, sent with its down record and kept by
        this one. A record the storage refused is known all the same (the decider used to
        read the ledger only: with an unwritable run directory it gave both nodes of a job,
        each failing its health check, ranks again, and both idled)."""
        told = {int(n): str(why) for d in downs for n, why in (d.get("bad") or {}).items()}
        ledger_says = self._readable(dict[int, str](), exclusion.bad, self.run_dir, self.ranks.attempt)
        return {**ledger_says, **told, **self.declared}

    def _serve_anew(self) -> coord.Server | None:
        """A restart decided through the files (node 0's store was lost): this decider
        serves a new store for the cycles after, so that only this one recovery waited on
        the file system. None: the store is in use, was never wanted, or cannot be served."""
        if not self.chan.lost_why or coord.mode() != "store":
            return None
        try:
            return coord.Server(self.spec.coord_key, 0, self._host(), self.ranks.attempt,
                                int(self.node.nnodes)).start()
        except OSError:
            return None

    def _join(self, decided: Decision, cycle: int) -> None:
        """After a restart that names a new store (`_serve_anew`), before cycle `cycle`:
        every launcher leaves the files for it (its decider, which serves it, too)."""
        if self.chan.store is not None and self.chan.fell_back:
            # (moved to the standby, and decided there: the move is over, every launcher of
            # the new roster is on it, and a silence from now on is a fault like any other)
            self.chan.fell_back, self.graced = False, self.chan.moves
        if not decided.coord_port or self.chan.store is not None:
            return
        old = self.chan
        self.chan = coord.Channel(self.run_dir, self.me, first_cycle=cycle, host_node=decided.coord_node)
        self.graced = 0
        old.close()
        self.chan.server = coord.Server.serving(decided.coord_port) if decided.host == self._host() else None
        if self.chan.open(decided.host, decided.coord_port, self.spec.coord_key, self.ranks.attempt,
                          serve=False, where=self.where, waiting=self.beat, nodes=int(self.node.nnodes)):
            print(f"hpcshard: node {self.me}: the launchers coordinate through the store on "
                  f"{decided.host}:{decided.coord_port} from cycle {cycle}", file=sys.stderr, flush=True)
        elif self.chan.server is not None:  # (one its own decider cannot reach serves nobody)
            self.chan.server.close()
            self.chan.server = None

    def _conclude(self, cycle: int, watch: Watch, decided: Decision,
                  downs: list[dict[str, Any]] | None = None, share: bool = True,
                  blame: list[tuple[int, dict[str, Any], str]] | None = None) -> Decision:
        """Share the decision (the first decider's stands), record it, say it in one line.
        Another decider's that stands is its decider's to record. `blame`: the nodes this
        decider found bad (node, where it ran, why), marked bad only by the decider whose
        decision stands (`_shared`)."""
        if share:
            ours = Decision.from_dict(decided.to_dict())
            decided = self._shared(cycle, ours, blame or [])
            if decided != ours:
                print(f"hpcshard: node {self.me}: another launcher decided cycle {cycle} first: "
                      f"{decided.reason}", file=sys.stderr, flush=True)
                return decided
        self._record(cycle, watch, downs or [], decided)
        return decided

    def _shared(self, cycle: int, ours: Decision, blame: list[tuple[int, dict[str, Any], str]]) -> Decision:
        """Share this decider's decision; the one that stands. Its bad nodes are marked
        (the ledger, a Slurm drain) once the run directory said it stands and before the
        launchers on the store learn it: they act on it at once, and the one that sends a
        requeued job on excludes the run's bad nodes as the ledger names them
        (`launch.slurm`). Through the files the decision's file is both (its decider blames
        after it, or one whose decision lost would blame too). Each step beats while it
        runs: the exclusive create waits on the storage; on failure the others learn it
        from their own trouble. A decider that found the storage hung asks the files
        nothing: its write would take WRITE_WAIT_S, after the others stopped waiting for it
        (DECIDE_S past the storage's wait), and no other decider's would land there either."""
        attempt, said = self.ranks.attempt, list[dict[str, Any] | None]()
        if not self.hung:
            self._try("the decision", lambda: said.append(self.chan.arbitrate(attempt, cycle,
                                                                             ours.to_dict())))
        first = Decision.from_dict(said[0]) if said and said[0] is not None else None
        if first == ours:
            self._blame(cycle, blame)
        standing, shared = first or ours, list[dict[str, Any]]()
        told = standing.to_dict()
        if self._try("the decision", lambda: shared.append(self.chan.share(attempt, cycle, told))):
            standing = Decision.from_dict(shared[0])
        if first is None and standing == ours:
            self._blame(cycle, blame)
        return standing

    def _blame(self, cycle: int, blame: list[tuple[int, dict[str, Any], str]]) -> None:
        """Mark each of these nodes bad (node, where it ran, why): `_bad`."""
        for n, where, why in blame:
            self._bad(cycle, n, where, why)

    def _host(self) -> str:
        """Where the next rendezvous is: this launcher's host, as the others reach it."""
        if self.me == 0:
            return str(self.node.rdzv_host)
        return str(self.where.get("slurm_node") or self.node.rdzv_host)

    def _bad(self, cycle: int, node: int, where: dict[str, Any], reason: str) -> None:
        """A node this run must not use again (the ledger, and Slurm where asked to)."""
        self.beat()  # (a launcher stopped since its last beat must not judge before it knows)
        self.seen_bad.add(node)
        self.declared[node] = reason
        self._try("a bad node's record", exclusion.declare_bad, self.run_dir, self.ranks.attempt, cycle,
                  node, where, reason, self.spec.bad_nodes == "drain")

    def _seen_committed(self) -> int:
        """`_committed`, or 0 when the run directory cannot be read, or not in time (a down
        record is sent whatever the disk does)."""
        return self._readable(0, self._committed)

    def _committed(self) -> int:
        """The newest step a restart resumes from: hpcshard's committed checkpoints, or a
        script's own newest save in the checkpoint directory (step from its name)."""
        if self.spec.script:
            return int(store.last_save(self.run_dir)["saved_step"] or 0)
        return max((c.step for c in store.committed(self.run_dir / store.CHECKPOINTS)), default=0)

    def _record(self, cycle: int, watch: Watch, downs: list[dict[str, Any]], decided: Decision) -> None:
        """The fault in the ledger (cause, culprit, cost, decision) and, for a decision that
        ends the attempt, its end record; one line on the console."""
        dead = [d for down in downs for d in down.get("dead", [])]
        fault = watch.fault or {}
        # (each node's records came with its down record: another host's new files may
        # stay hidden here for NFS's lookup cache)
        mine = self._readable(dict[int, dict[str, Any]](), flight.read, self.run_dir, self.ranks.attempt,
                              cycle)
        records = {**mine, **{int(r): f for down in downs for r, f in down.get("flight", {}).items()}}
        collectives = flight.missing(records)
        # The culprit, surest first: a rank whose own code raised (it is dead too, as are
        # ranks torchrun tore down after it); one killed or stopped; a node lost; the rank where the
        # flight records' chain of waits begins (a livelock: busy while its peers wait,
        # whichever node's watchdog spoke first); the rank the watchdog named.
        everyone = {r["rank"]: r for down in downs for r in down.get("ranks", [])}
        root = [everyone[r] for r in flight.roots(collectives) if r in everyone]
        named = ("rank", "pid", "step", "phase", "node", "host", "state")
        hung: dict[str, Any] | None = ({k: fault[k] for k in named if k in fault}
                                       if "rank" in fault and "state" in fault else None)
        beats = self.chan.beats(self.ranks.attempt, self.node.nnodes, decided.lost)
        gone = [{"node": n, "state": "lost", **{k: v for k, v in beats.get(n, {}).items()
                                                 if k in ("host", "slurm_node")}}
                for n in decided.lost if n in self.roster.active]
        culprit = self._failed_first(cycle) or (dead[0] if dead else gone[0] if gone else
                                                root[0] if len(root) == 1 else hung)
        reached = max([watch.reached, *(d.get("reached", 0) for d in downs)])
        self._try("the fault's record", ledger.append, self.run_dir, _fault(
            self.ranks.attempt, cycle, fault, culprit, reached, decided, collectives))
        waits = flight.summary(collectives)
        print(f"hpcshard: fault: {fault.get('cause', 'unknown')}; {_who(culprit)}; "
              f"{waits + '; ' if waits else ''}{decided.reason}", file=sys.stderr, flush=True)
        if decided.end:  # the attempt ends here: how, for status and for a guard job
            self._try("the attempt's end", ledger.append, self.run_dir, events.End(
                attempt=self.ranks.attempt, cycle=cycle, reason=decided.end, how=decided.reason,
                saved_step=decided.committed))

    def _failures(self, cycle: int) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self._readable([], ledger.read, self.run_dir)
        return [r for r in records if r.get("event") == "rank_failed"
                and r.get("attempt") == self.ranks.attempt and r.get("cycle", 0) == cycle]

    def _failed_first(self, cycle: int) -> dict[str, Any] | None:
        """The first rank whose own code raised (not a peer's death seen as a comms error)."""
        own = [r for r in self._failures(cycle) if r.get("error") not in NOT_THE_JOBS
               and not any(m in r.get("message", "") for m in COMMS_MESSAGES)]
        return own[0] if own else None

    def _same_bug(self, cycle: int) -> str:
        now = self._failed_first(cycle)
        before = self._failed_first(cycle - 1) if cycle else None
        if now and before and (now["error"], now["step"]) == (before["error"], before["step"]):
            return str(now["error"])
        return ""

    def _stalled(self, cycle: int, committed: int) -> int:
        """Restarts in a row so far after which the committed step did not move."""
        stalled = 0
        for c in range(cycle - 1, -1, -1):
            before = self._readable(None, self.chan.decision, self.ranks.attempt, c) or {}
            if before.get("committed") != committed:
                break
            stalled += 1
        return stalled
