"""Supervision of a node's ranks (hpcshard jobs): start them, watch them, and when a rank
dies, bring every node's ranks back from the newest committed checkpoint without leaving
the allocation.

One cycle is one torchrun (or warm agent) per node. While it runs, the launcher reads its
node's progress board (`rundir.progress`) every POLL_S: a rank whose process is gone while
it was still training is a crash, declared at once for the whole job (`rundir.launchers`:
one fault file per cycle, first declarer wins). Every launcher polls for a declaration too,
so a fault on one node stops the others within a poll, not after torchrun's 300 s exit
barrier or gloo's 30 minutes. Each launcher then kills what is left of its ranks (SIGCONT
first: a stopped process would not die of SIGTERM; then SIGKILL) and says it is down; node
0 decides, once every node is down, whether to restart (within the budget, not when the
job's own code raised the same exception at the same step twice) and where the next
rendezvous is; every node starts the next cycle from the newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from hpcshard.launch.watchdog import Limits, Watchdog, process_state, started, stat_fields
from hpcshard.rundir import flight, launchers, ledger, store
from hpcshard.rundir.launchers import LAUNCH as LAUNCH_DIR
from hpcshard.rundir.progress import Board, board_path, boards
from hpcshard.rundir.rankenv import BUG_EXIT, REQUEUE_EXIT, STACKS_SIGNAL, RankEnv
from hpcshard.rundir.spec import RunSpec


class Agent(Protocol):
    """A cycle's torchrun (or warm) agent: a Popen, or a fork of the node's zygote."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...


FLIGHT_WAIT_S = 0.3
"""How long the ranks get to write their flight records (a few ms each, measured)."""
STACKS_WAIT_S = 1.0
"""How long the ranks get to write their stacks before they are killed."""
POLL_S = 0.2
"""How often a launcher looks at its board and for a declared fault."""
DOWN_TIMEOUT_S = 120.0
"""How long node 0 waits for every node to report its ranks dead before it gives up."""
HEALTH_TIMEOUT_S = 120.0
"""How long the profile's health check may take."""
BEAT_S = 1.0
"""How often a launcher says it is alive (a small file in the run directory)."""
LOST_S = 8.0
"""A node whose launcher has said nothing for this long is lost (dead, frozen, cut off):
eight missed heartbeats, so a launcher slowed by a loaded host is not taken for one."""
UNHEARD_S = 30.0
"""...and one never heard of is lost this long after this launcher began (launchers of one
job start seconds apart)."""
COMMS_ERRORS = ("DistBackendError", "DistNetworkError", "DistError", "DistStoreError")
"""Exceptions a rank raises because a peer died: a consequence, never the culprit."""
COMMS_MESSAGES = ("gloo/transport", "Connection reset", "Connection closed", "Broken pipe", "NCCL")
"""...and what gloo's and NCCL's RuntimeErrors say when that happens."""


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (Linux; works in containers without ps)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(entry)  # empty when it exited while we looked
            if fields and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (a warm agent's forked ranks, torchrun's
    workers and whatever they started)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def ranks_below(pids: list[int]) -> list[int]:
    """The ranks (pids, by global rank) below these launchers, from the boards of this
    host: whatever lies between (torchrun, a warm agent, the zygote), a rank is what
    reports on a board. A board left by a killed launcher may name a pid that now is
    another process (pids wrap): only a slot written since its process started counts
    (both on the boot clock: start times floor to a clock tick, so a slot of the process
    itself is never earlier)."""
    below = {d for pid in pids for d in descendants(pid)}
    slots = sorted((s.rank, s.pid) for board in boards() for s in board
                   if s.pid in below and s.since >= started(s.pid))
    return [pid for _, pid in slots]


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie: a killed rank stays a zombie until its agent reaps
    it, and must count as dead at once."""
    return process_state(pid) not in ("", "Z", "X")


def send(pids: list[int], sig: int) -> None:
    """`sig` to each of `pids` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_tree(proc: Agent, stacks: list[int] | tuple[int, ...] = (),
              also: list[int] | tuple[int, ...] = ()) -> None:
    """End a cycle's agent and every rank below it, whatever state they are in. `stacks`:
    ranks asked first to write their Python stacks into their logs (what a hang was doing).
    `also`: ranks that may no longer be below it (an agent that died leaves orphans)."""
    pids = [*descendants(proc.pid), *(p for p in also if alive(p)), proc.pid]
    if stacks:  # which collective each rank waits in, before a stopped one may move again
        flight.ask([p for p in stacks if process_state(p) not in ("T", "t")])
        time.sleep(FLIGHT_WAIT_S)
    send(pids, signal.SIGCONT)  # a stopped process ignores all but SIGKILL until continued
    if stacks:  # where each rank is: its Python stacks, into its log
        send(list(stacks), STACKS_SIGNAL)
        time.sleep(STACKS_WAIT_S)
    send([*descendants(proc.pid), *pids], signal.SIGKILL)
    proc.wait()


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


MIN_FREE_MEMORY = 0.05
"""A node with less than this share of its memory available fails its health check (a
leaked process from an earlier job, a full tmpfs)."""


def memory_short(meminfo: Path = Path("/proc/meminfo")) -> str:
    """"" when at least MIN_FREE_MEMORY of the node's memory is available, else why not."""
    try:
        fields = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in
                                                         meminfo.read_text().splitlines()) if v}
    except (OSError, ValueError):
        return ""  # not Linux, or no /proc: nothing to judge by
    total, available = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
    if total and available < MIN_FREE_MEMORY * total:
        return (f"{available / 2**20:.1f} GiB of {total / 2**20:.0f} GiB memory available, under "
                f"{MIN_FREE_MEMORY:.0%} (a process left from another job?)")
    return ""


def free_port() -> int:
    """A port for the next cycle's rendezvous, on this host (node 0 hosts it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


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
    """This launcher was stopped (its node frozen) and its peers went on without it."""


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


class Supervisor:
    """A node's ranks, cycle after cycle, until they finish, stop, or the budget ends."""

    def __init__(self, node: Any, run_dir: Path, spec: RunSpec, ranks: RankEnv,
                 start: Callable[[Any, dict[str, str]], Agent],
                 grace: float | None = None) -> None:
        self.node, self.run_dir, self.spec, self.ranks = node, run_dir, spec, ranks
        self.start = start
        self.grace = grace
        """Own scripts: how long after a notice their ranks may run before they are killed."""
        self.proc: Agent | None = None
        self.ending = False
        """A TERM or INT came (cancel, the scheduler): the ranks end, nothing restarts."""
        self.noticed: float | None = None
        """When a stop notice came: the ranks stop cleanly; a failure then is not restarted."""
        self.killed = False
        """The grace period ran out and the ranks were killed."""
        self.where = {"node": node.node_rank, "host": socket.gethostname(),
                      **({"slurm_node": os.environ["SLURMD_NODENAME"]}
                         if os.environ.get("SLURMD_NODENAME") else {})}
        """This node, in every record it writes."""
        self.beaten = self.looked = 0.0
        self.began = time.time()
        self.heard_since = self.began
        """Since when this launcher's own heartbeats reach the run directory: a peer's
        silence counts from then (on a full or hung disk nobody's beats land, and nobody
        is lost for it)."""
        self.roster = Roster.first(node.nnodes, spec.nodes)
        """Who trains in the current cycle, and who waits."""
        self.seen_bad: set[int] = set()
        self.at_cycle = 0
        self.fenced = False
        """It stood still while the run went on without it: it has left the run."""

    @property
    def me(self) -> int:
        return int(self.node.node_rank)

    def beat(self, done: int | None = None) -> None:
        """Say this launcher is alive, at most every BEAT_S (called from every wait); `done`:
        it ends with this exit code (never to be taken for lost, nor waited for)."""
        if time.monotonic() - self.beaten >= BEAT_S or done is not None:
            stalled = time.monotonic() - self.beaten if self.beaten else 0.0
            self.beaten = time.monotonic()
            if stalled > LOST_S:
                self._stood_still(stalled)
            try:
                launchers.beat(self.run_dir, self.ranks.attempt, self.me,
                               {**self.where, **({"done": done} if done is not None else {})})
            except OSError:  # a full disk must not end supervision, nor lose every peer
                self.heard_since = math.inf
                return
            if self.heard_since == math.inf:
                self.heard_since = time.time()

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
        decided = launchers.decision(self.run_dir, attempt, cycle) or {}
        kept = [*decided.get("active", []), *decided.get("spares", [])]
        if (decided.get("restart") and self.me not in kept) or any(
                r.get("node") == self.me for r in ledger.bad_nodes(self.run_dir, attempt, lost=True)):
            raise Fenced(f"declared lost while it stood still for {seconds:.0f} s")
        if ledger.moved_on(self.run_dir, attempt, cycle):
            raise Fenced(f"the run started again without it while it stood still for {seconds:.0f} s")
        if self.heard_since != math.inf:
            self.heard_since = time.time()

    def lost(self, nodes: list[int] | tuple[int, ...]) -> list[int]:
        """Which of these nodes are lost: silent for LOST_S (or never heard of, UNHEARD_S
        after this launcher began). One that said it ended is not."""
        self.beat()  # (a launcher stopped since its last beat must not judge before it knows)
        now, beats = time.time(), launchers.beats(self.run_dir, self.ranks.attempt, self.node.nnodes)
        unheard = self.began + UNHEARD_S - LOST_S
        return [n for n in nodes if "done" not in beats.get(n, {})
                and now - max(beats.get(n, {}).get("time", unheard), self.heard_since) > LOST_S]

    # -- one cycle -------------------------------------------------------------------
    def run(self) -> int:
        """Supervise this node's ranks until the run ends here; the exit code. A launcher
        fenced off (`_stood_still`) returns 0 and must write nothing more (`fenced`)."""
        try:
            code = self._run()
            self.beat(done=code)
        except Fenced as why:  # its ranks must not train on, nor it speak for the run
            self.fenced = True
            below = descendants(os.getpid())  # agents, ranks, zygote, a health check
            send(below, signal.SIGCONT)
            send(below, signal.SIGKILL)
            print(f"hpcshard: node {self.me} leaves the run: {why}", file=sys.stderr, flush=True)
            return 0  # (not a failure: a non-zero exit would take the others' job down)
        return code

    def _run(self) -> int:
        self.beat()
        cycle, unhealthy = 0, False
        node = replace(self.node, nnodes=len(self.roster.active))
        why = self.health()
        if why:  # this node must not train: node 0 (or whoever decides) replaces it or stops
            unhealthy = True
            self.bad(0, self.me, self.where, f"health check: {why}")
            if self.me in self.roster.active:  # (a spare that fails is simply never used)
                launchers.declare_fault(self.run_dir, self.ranks.attempt, 0, {
                    "cause": f"node {self.me} failed its health check: {why}", **self.where})
            name = self.where.get("slurm_node", self.where["host"])
            print(f"hpcshard: node {self.me} ({name}) failed its health check: {why}",
                  file=sys.stderr, flush=True)
        while True:
            self.at_cycle = cycle
            if self.me in self.roster.active and not unhealthy:
                watch = self.cycle(replace(node, node_rank=self.roster.active.index(self.me)), cycle)
            else:
                watch = self.idle(cycle)
            if watch.fault is None:
                return watch.code
            decided = self.recover(cycle, watch)
            if not decided.get("restart") or self.ending:
                return int(decided.get("code", 1))
            cycle += 1
            self.roster = Roster(tuple(decided["active"]), tuple(decided["spares"]))
            node = replace(self.node, nnodes=len(self.roster.active), rdzv_host=decided["host"],
                           rdzv_port=int(decided["port"]), run_id=f"{self.node.run_id}-c{cycle}")

    def idle(self, cycle: int) -> Watch:
        """A launcher without ranks this cycle (a spare, or a node declared bad): alive and
        watching until a fault needs it (it takes part in the recovery, and may be given a
        lost node's place) or every launcher with ranks has ended (it ends as they did)."""
        while True:
            self.beat()
            fault = launchers.fault(self.run_dir, self.ranks.attempt, cycle)
            if fault is not None:
                return Watch(code=1, fault=fault)
            beats = launchers.beats(self.run_dir, self.ranks.attempt, self.node.nnodes)
            ended = [n for n in self.roster.active if "done" in beats.get(n, {})]
            if ended and set(ended) | set(self.lost(self.roster.active)) >= set(self.roster.active):
                return Watch(code=int(beats[ended[0]]["done"]))
            if self.ending:
                return Watch(code=0)
            time.sleep(POLL_S)

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
            self.bad(cycle, n, launchers.beats(self.run_dir, self.ranks.attempt, self.node.nnodes)
                     .get(n, {}), f"lost: its launcher was silent for {LOST_S:.0f} s (a spare)")
        gone = [n for n in lost if n in roster.active]
        if gone:
            launchers.declare_fault(self.run_dir, self.ranks.attempt, cycle, {
                **self.where, "noticed": self.noticed is not None, "lost": gone,
                "cause": f"node(s) {gone} lost: silent for {LOST_S:.0f} s"})

    def cycle(self, node: Any, cycle: int) -> Watch:
        path = board_path(node.run_id, node.node_rank)
        board = Board.create(path, node.per_node)
        env = replace(self.ranks, cycle=cycle, board=str(path),
                      resume=self.ranks.resume if cycle == 0 else "auto")
        self.proc = self.start(node, env.to_environ())
        try:
            return self._watch(self.proc, board, cycle)
        finally:
            board.close(remove=True)

    def _watch(self, proc: Agent, board: Board, cycle: int) -> Watch:
        attempt = self.ranks.attempt
        dog = Watchdog(Limits.from_config(self.spec.resolved.get("config", {})), poll_s=POLL_S)
        hang: dict[str, Any] | None = None
        started, told, learned = time.monotonic(), False, False
        before = launchers.decision(self.run_dir, attempt, cycle - 1) if cycle else None
        while True:
            self.beat()
            self.watch_peers(cycle)
            code = proc.poll()
            slots = board.read()
            reached = max((s.step for s in slots), default=0)
            if before is not None and self._recovered(cycle, before, slots):
                before = None
            if (self.noticed is not None and not told and self.noticed < started
                    and len(slots) == board.slots):
                # The notice came while the ranks were down (a fault's recovery): the new
                # ones hear it as soon as they are up (their handler is in by then).
                send([s.pid for s in slots], self.ranks.notice_signal)
                told = True
            # A cancel, a script's grace that ran out, or a script told to stop (its ranks
            # may die of the notice, or save inside a step for any time): they end as they
            # will; nothing is a fault now.
            if self.ending or self.killed or (self.noticed is not None and self.spec.script):
                self._grace(proc)
                # (another node may have declared a fault before its notice came: take part)
                if code is not None or (self.spec.script and not self.ending and not self.killed
                                        and launchers.fault(self.run_dir, attempt, cycle)):
                    break
                time.sleep(POLL_S)
                continue
            dead = [{"rank": s.rank, "pid": s.pid, "step": s.step, "phase": s.phase, **self.where}
                    for s in slots if s.phase != "done" and not alive(s.pid)]
            if code is None and not dead:
                hang = dog.look(slots)
                if not learned and dog.step_limit() is not None:
                    learned = self._learned(dog, cycle)
            if code is not None or dead or hang or launchers.fault(self.run_dir, attempt, cycle):
                break
            time.sleep(POLL_S)
        fault = launchers.fault(self.run_dir, attempt, cycle)
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
        if code == 0 or self.ending or self.killed or (self.noticed is not None and fault is None and (
                self.spec.script or (code is not None and not dead))):
            # Done, cancelled, or stopped on the notice (whatever the exit: not restarted).
            return Watch(code=code if code is not None else proc.wait(), reached=reached)
        if code is not None and not dead and self._final(cycle):
            return Watch(code=code, reached=reached)  # restarting would change nothing
        # A fault, also after a notice (a rank that died while the job stopped): node 0
        # then sends the job back through the queue instead of restarting it here.
        info: dict[str, Any] = {**self.where, "noticed": self.noticed is not None}
        if hang:
            info.update({k: hang[k] for k in ("cause", "rank", "step", "phase", "pid", "state",
                                              "limit", "silent_s")})
        elif dead:
            info.update(cause=f"rank {dead[0]['rank']} died (its process is gone)", rank=dead[0]["rank"],
                        step=dead[0]["step"])
        elif code is not None and (slow := self._straggled(cycle)):
            info.update(cause="a node with every link slow (health_link_gbps): stopped before training"
                        if slow[0].get("kind") == "link" else
                        "a straggler (straggler_policy=bad_node): the ranks saved and stopped")
        else:
            info.update(cause=f"the ranks of node {self.me} failed (exit {code})")
        if fault is None:
            launchers.declare_fault(self.run_dir, attempt, cycle, info)
        now = board.read()
        where = [{"rank": s.rank, "pid": s.pid, "step": s.step, "phase": s.phase, **self.where,
                  "state": process_state(s.pid) or "gone"} for s in now]
        left = [s for s in now if s.phase != "done" and alive(s.pid)]
        stopped = [{"rank": s.rank, "pid": s.pid, "step": s.step, "phase": s.phase, **self.where,
                    "state": "stopped"} for s in left if process_state(s.pid) in ("T", "t")]
        live = [s.pid for s in left]
        if proc.poll() is None:
            kill_tree(proc, stacks=live, also=live)
        elif live:  # the agent died and left its ranks behind: they must not train on
            kill_tree(proc, also=live)
        return Watch(code=proc.returncode or 1, fault=launchers.fault(self.run_dir, attempt, cycle),
                     dead=dead + stopped, reached=reached, ranks=where)

    def _learned(self, dog: Watchdog, cycle: int) -> bool:
        """The leader, once per cycle: the step limit its watchdog learned, in the ledger."""
        if self.me == self.roster.leader:
            limits = dog.limits
            ledger.append(self.run_dir, {
                "event": "watchdog", "attempt": self.ranks.attempt, "cycle": cycle,
                "step_limit": round(dog.step_limit() or 0, 3), "median_step": round(dog.median(), 4),
                "factor": limits.factor, "floor_s": limits.floor_s, "phase_s": limits.phase_s,
                "join_s": limits.join_s})
        return True

    def _recovered(self, cycle: int, decided: dict[str, Any], slots: list[Any]) -> bool:
        """The leader, after a restart: once a rank trains past the step it resumed from, the
        ledger says how long the fault cost (declared -> training again)."""
        resumed = int(decided.get("committed") or 0)
        if self.me != self.roster.leader or not any(s.phase == "step" and s.step > resumed for s in slots):
            return False
        fault = launchers.fault(self.run_dir, self.ranks.attempt, cycle - 1) or {}
        ledger.append(self.run_dir, {"event": "recovered", "attempt": self.ranks.attempt,
                                     "cycle": cycle, "step": resumed + 1,
                                     "seconds": round(time.time() - fault.get("time", time.time()), 2)})
        return True

    def _grace(self, proc: Agent) -> None:
        """A script still running `grace` seconds after the notice: kill its ranks (torchrun
        then ends); an hpcshard job stops at its next step by itself."""
        if (self.grace is not None and self.noticed is not None and not self.killed
                and time.monotonic() - self.noticed > self.grace):
            send(children(proc.pid), signal.SIGKILL)
            self.killed = True

    def _final(self, cycle: int) -> bool:
        """The runtime ended this cycle on purpose: a bad value (exit 2, one line) or a
        non-finite loss (which stops the run). Not faults: a restart changes nothing."""
        end = ledger.end_of(self.run_dir, self.ranks.attempt) or {}
        return end.get("cycle", 0) == cycle and bool(end.get("user_error")
                                                       or end.get("reason") == "nonfinite")

    # -- between cycles --------------------------------------------------------------
    def recover(self, cycle: int, watch: Watch) -> dict[str, Any]:
        """Say this node is down, then wait for the decision: node 0's, or, once the
        launchers below this one are all lost, this one's own."""
        attempt = self.ranks.attempt
        launchers.mark_down(self.run_dir, attempt, cycle, self.me, {
            "host": self.where["host"], "dead": watch.dead, "reached": watch.reached,
            "ranks": watch.ranks})
        deadline = time.monotonic() + DOWN_TIMEOUT_S + 30
        while True:
            self.beat()  # (first: one frozen here past the deadline is fenced, not failed)
            found = launchers.decision(self.run_dir, attempt, cycle)
            if found is not None:
                return found
            if self.decider() == self.me:
                return launchers.decide(self.run_dir, attempt, cycle, self.decide(cycle, watch))
            if time.monotonic() >= deadline:
                return {"restart": False, "code": 1, "reason": "no launcher decided (are they gone?)"}
            time.sleep(POLL_S)

    def decider(self) -> int:
        """Who decides after a fault: the lowest launcher of the job not lost (not bad)."""
        members = sorted(n for n in self.roster.members if n not in self.seen_bad)
        below = [n for n in members if n < self.me]
        lost = set(self.lost(below))
        return next(n for n in [*below, self.me] if n not in lost)

    def decide(self, cycle: int, watch: Watch) -> dict[str, Any]:
        """Once every node is down (or lost): restart, on which nodes, or stop and why.
        Recorded in the ledger. A lost or unhealthy node is replaced by a spare; without
        one the run goes on with fewer nodes where `min_nodes` allows it, else back through
        the queue without it."""
        attempt, roster = self.ranks.attempt, self.roster
        members = [n for n in roster.members if n not in self.seen_bad]
        deadline = time.monotonic() + DOWN_TIMEOUT_S
        lost: list[int] = []
        while True:
            self.beat()
            missing = sorted(set(members) - set(launchers.nodes_down(self.run_dir, attempt, cycle,
                                                                     self.node.nnodes)))
            lost = self.lost(missing)
            if set(lost) == set(missing):
                break
            if time.monotonic() > deadline:
                return self._record(cycle, watch, restart=False, code=1,
                                    reason=f"node(s) {missing} did not report their ranks down "
                                    f"within {DOWN_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        beats = launchers.beats(self.run_dir, attempt, self.node.nnodes)
        for n in lost:
            self.bad(cycle, n, beats.get(n, {}), f"lost: its launcher was silent for {LOST_S:.0f} s")
        downs = launchers.downs(self.run_dir, attempt, cycle, self.node.nnodes)
        committed = self._committed()
        if self.noticed is not None or (watch.fault or {}).get("noticed"):
            return self._record(cycle, watch, downs, restart=False, code=REQUEUE_EXIT,
                                committed=committed, end="stop", lost=lost,
                                reason="a stop notice came as well: requeued, not restarted here")
        self._slow_nodes(cycle, downs)
        said = self._bad()
        bad = set(said)
        active = [n for n in roster.active if n not in bad]
        spares = [n for n in roster.spares if n not in bad]
        gone = [n for n in roster.active if n in bad]
        where: dict[str, Any] = {"lost": lost}
        if gone:
            why = f"node(s) {gone} bad ({'; '.join(sorted({said[n] for n in gone}))})"
            taken, spares = spares[:len(gone)], spares[len(gone):]
            active = sorted([*active, *taken])
            fewest = self.spec.min_nodes or len(roster.active)
            if len(active) < fewest:
                if self.spec.backend == "local" and not lost:
                    return self._record(cycle, watch, downs, restart=False, code=1, committed=committed,
                                        bad=gone, reason=f"{why}; the local backend has no other "
                                        "node to use")
                return self._record(cycle, watch, downs, restart=False, code=REQUEUE_EXIT, end="fault",
                                    committed=committed, bad=sorted(bad), **where,
                                    reason=f"{why}: requeued without them")
            where.update(bad=gone, replaced=dict(zip(map(str, gone), taken, strict=False)))
            if len(active) == len(roster.active):
                why += f": spare node(s) {taken} take their place"
            else:
                why += (f": {len(taken)} spare(s) left, going on with {len(active)} nodes "
                        f"(min_nodes {fewest}; the mesh is planned again)")
        else:
            why = ""
        bug = self._same_bug(cycle)
        stalled = 0 if gone else self._stalled(cycle, committed)
        if bug:
            return self._record(cycle, watch, downs, restart=False, code=BUG_EXIT, committed=committed,
                                reason=f"the job's own code raised {bug} again at the same step: a "
                                "bug, not a fault; not restarted")
        if stalled >= self.spec.no_progress_restarts:
            return self._record(cycle, watch, downs, restart=False, code=1, committed=committed,
                                reason=f"{stalled} restarts in a row without a newer checkpoint")
        if cycle + 1 > self.spec.max_restarts:
            # Training advanced, but this allocation has had its share of faults (a flaky
            # node?): back through the queue, as after a preemption, up to max_requeues.
            return self._record(cycle, watch, downs, restart=False, code=REQUEUE_EXIT,
                                committed=committed, end="fault", **where,
                                reason=(f"{why}; " if why else "") + f"the restart budget "
                                f"({self.spec.max_restarts}) is spent: requeued")
        return self._record(cycle, watch, downs, restart=True, port=free_port(), host=self._host(),
                            active=active, spares=spares, committed=committed, **where,
                            reason=(f"{why}; " if why else "")
                            + f"restart {cycle + 1} of {self.spec.max_restarts}")

    def _straggled(self, cycle: int) -> list[dict[str, Any]]:
        """The stragglers the ranks named in this cycle under straggler_policy=bad_node."""
        return [r for r in ledger.read(self.run_dir) if r["event"] == "straggler"
                and r.get("policy") == "bad_node" and r["attempt"] == self.ranks.attempt
                and r.get("cycle") == cycle]

    def _slow_nodes(self, cycle: int, downs: list[dict[str, Any]]) -> None:
        """The node of each straggler named under straggler_policy=bad_node is bad (the
        down records say which node each rank ran on)."""
        node_of = {int(r["rank"]): r for down in downs for r in down.get("ranks", [])}
        bad = set(self._bad())
        for r in self._straggled(cycle):
            if int(r["rank"]) in node_of:
                where = node_of[int(r["rank"])]
                if int(where["node"]) not in bad:
                    bad.add(int(where["node"]))
                    self.bad(cycle, int(where["node"]), where, f"slow link: every link of it under "
                             f"{r['floor_gbps']:g} GB/s (slowest {r['gbps']} GB/s)"
                             if r.get("kind") == "link" else f"straggler: rank {r['rank']} computed "
                             f"{r['ratio']}x slower than the median of the others")

    def _host(self) -> str:
        """Where the next rendezvous is: this launcher's host, as the others reach it."""
        if self.me == 0:
            return str(self.node.rdzv_host)
        return str(self.where.get("slurm_node") or self.node.rdzv_host)

    def _bad(self) -> dict[int, str]:
        """The nodes declared bad in this attempt (they never train in it again), and why."""
        found = {int(r["node"]): str(r["reason"]) for r in ledger.bad_nodes(self.run_dir, self.ranks.attempt)}
        self.seen_bad |= set(found)
        return found

    def health(self) -> str:
        """Before this attempt trains: can this node do its part? "" if so, else why not.
        The run directory takes a write (every node: each mounts it), has room for another
        checkpoint as big as the newest (node 0: the file system is shared), memory is
        free, the node's GPUs answer (where nvidia-smi is), and the profile's
        `health_check` command exits 0."""
        probe = self.run_dir / LAUNCH_DIR / f".health-{self.me}"
        try:
            probe.parent.mkdir(exist_ok=True)
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            return f"the run directory {self.run_dir} takes no write ({err.strerror})"
        if self.me == 0:
            newest = store.committed(self.run_dir / store.CHECKPOINTS)
            need = max((c.bytes for c in newest), default=0) * 1.1
            free = shutil.disk_usage(self.run_dir).free
            if free < need:
                return (f"{free / 1e9:.1f} GB free in {self.run_dir}, less than a checkpoint "
                        f"needs ({need / 1e9:.1f} GB)")
        why = memory_short() or self._gpus_short()
        if why:
            return why
        if self.spec.health_check:
            return self._check(["bash", "-c", self.spec.health_check], "the profile's health_check")
        return ""

    def _gpus_short(self) -> str:
        """Where nvidia-smi is (a GPU node): it must list a GPU for every rank of the node."""
        smi = shutil.which("nvidia-smi")
        if not smi:
            return ""
        with tempfile.NamedTemporaryFile("w+") as out:
            said = self._check([smi, "--query-gpu=index", "--format=csv,noheader"], "nvidia-smi",
                               out=out)
            if said:
                return said
            out.seek(0)
            found = len([line for line in out.read().splitlines() if line.strip()])
        ranks = int(self.node.per_node)
        return "" if found >= ranks else f"nvidia-smi lists {found} GPU(s); this node runs {ranks} ranks"

    def _check(self, argv: list[str], name: str, out: Any = None) -> str:
        """Run a check command, still beating (a site's check may take a minute, and a
        silent launcher is a lost one); "" when it exits 0, else what it said last.
        `out`: a file that gets what it printed (else a temporary one)."""
        with contextlib.ExitStack() as stack:
            out = out or stack.enter_context(tempfile.TemporaryFile("w+"))
            proc = stack.enter_context(subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "HPCSHARD_RUN_DIR": str(self.run_dir)}))
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while proc.poll() is None:
                try:
                    self.beat()
                except Fenced:  # (Popen's exit would wait for the command)
                    proc.kill()
                    raise
                if time.monotonic() > deadline:
                    proc.kill()
                    return f"{name} took over {HEALTH_TIMEOUT_S:.0f} s"
                time.sleep(POLL_S)
            out.seek(0)
            said = out.read().strip().splitlines()
        if not proc.returncode:
            return ""
        return f"{name} exited {proc.returncode}" + (f": {said[-1]}" if said else "")

    def bad(self, cycle: int, node: int, where: dict[str, Any], reason: str) -> None:
        """A node this run must not use again (a ledger record, with where it ran). On
        Slurm, with `bad_nodes = drain`, Slurm is told too (where the user may)."""
        self.beat()  # (a launcher stopped since its last beat must not judge before it knows)
        told: dict[str, Any] = {}
        if where.get("slurm_node") and self.spec.bad_nodes == "drain":
            from hpcshard.slurm import cluster

            refused = cluster.drain(where["slurm_node"], f"hpcshard {self.run_dir.name}: {reason}")
            told = {"drained": not refused, **({"drain_error": refused} if refused else {})}
        ledger.append(self.run_dir, {
            "event": "bad_node", "attempt": self.ranks.attempt, "cycle": cycle, "node": node,
            **{k: where[k] for k in ("host", "slurm_node") if k in where}, "reason": reason, **told})

    def _committed(self) -> int:
        """The newest step a restart resumes from: hpcshard's committed checkpoints, or a
        script's own newest save in the checkpoint directory (step from its name)."""
        if self.spec.script:
            return int(store.last_save(self.run_dir)["saved_step"] or 0)
        return max((c.step for c in store.committed(self.run_dir / store.CHECKPOINTS)), default=0)

    def _record(self, cycle: int, watch: Watch, downs: list[dict[str, Any]] | None = None,
                **decided: Any) -> dict[str, Any]:
        downs = downs or []
        dead = [d for down in downs for d in down.get("dead", [])]
        fault = watch.fault or {}
        collectives = flight.missing(flight.read(self.run_dir, self.ranks.attempt, cycle))
        # The culprit, surest first: a rank whose own code raised (it is dead too, as are
        # ranks torchrun tore down after it); one killed or stopped; a node lost; the rank where the
        # flight records' chain of waits begins (a livelock: busy while its peers wait,
        # whichever node's watchdog spoke first); the rank the watchdog named.
        everyone = {r["rank"]: r for down in downs for r in down.get("ranks", [])}
        root = [everyone[r] for r in flight.roots(collectives) if r in everyone]
        named = ("rank", "pid", "step", "phase", "node", "host", "state")
        hung: dict[str, Any] | None = ({k: fault[k] for k in named if k in fault}
                                       if "rank" in fault and "state" in fault else None)
        beats = launchers.beats(self.run_dir, self.ranks.attempt, self.node.nnodes)
        gone = [{"node": n, "state": "lost", **{k: v for k, v in beats.get(n, {}).items()
                                                 if k in ("host", "slurm_node")}}
                for n in decided.get("lost", []) if n in self.roster.active]
        culprit = self._failed_first(cycle) or (dead[0] if dead else gone[0] if gone else
                                                root[0] if len(root) == 1 else hung)
        reached = max([watch.reached, *(d.get("reached", 0) for d in downs)])
        ledger.append(self.run_dir, {
            "event": "fault", "attempt": self.ranks.attempt, "cycle": cycle,
            "cause": fault.get("cause", "unknown"), "declared": fault.get("time"),
            "culprit": culprit, "reached": reached, **decided,
            "lost_steps": max(0, reached - decided.get("committed", reached)),
            # how long the culprit had been silent when a hang was declared; a crash is
            # seen within one look
            "detect_s": fault.get("silent_s", POLL_S), "collectives": collectives})
        waits = flight.summary(collectives)
        print(f"hpcshard: fault: {fault.get('cause', 'unknown')}; {_who(culprit)}; "
              f"{waits + '; ' if waits else ''}{decided['reason']}", file=sys.stderr, flush=True)
        if decided.get("end"):  # back through the queue: how this attempt ended, for status
            ledger.append(self.run_dir, {"event": "end", "attempt": self.ranks.attempt, "cycle": cycle,
                                         "reason": decided["end"], "how": decided["reason"],
                                         "saved_step": decided.get("committed")})
        return decided

    def _failures(self, cycle: int) -> list[dict[str, Any]]:
        return [r for r in ledger.read(self.run_dir) if r.get("event") == "rank_failed"
                and r.get("attempt") == self.ranks.attempt and r.get("cycle", 0) == cycle]

    def _failed_first(self, cycle: int) -> dict[str, Any] | None:
        """The first rank whose own code raised (not a peer's death seen as a comms error)."""
        own = [r for r in self._failures(cycle) if r.get("error") not in COMMS_ERRORS
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
            before = launchers.decision(self.run_dir, self.ranks.attempt, c) or {}
            if before.get("committed") != committed:
                break
            stalled += 1
        return stalled
