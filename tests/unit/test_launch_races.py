"""Races a review of the run-directory lease and the supervisor's refactor found (issue 26),
each reproduced before it was mended: two launchers of one job taking one lease, a command
whose lease nobody renewed, a lock left by a dead holder, a slow holder and two breakers, a
local run whose command was killed, a leader that found its run taken over, a TERM while a
restart's agent starts, a script's bug stop (the health probe's errors: test_launch_storage)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import node as lnode
from hpcshard.launch import policy
from hpcshard.launch import slurm as lslurm
from hpcshard.launch.liveness import LOST_S
from hpcshard.launch.supervise import Supervisor, TakenOver
from hpcshard.rundir import events, files, launchers, lease, ledger, proc
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.launchers import LAUNCH, attempt_file
from hpcshard.rundir.rankenv import BUG_EXIT, RankEnv
from hpcshard.rundir.spec import RunSpec

pytestmark = pytest.mark.unit


def make_spec(run_dir: Path, nodes: int = 1) -> RunSpec:
    spec = RunSpec(job="jobs/charlm.py", sets={}, nodes=nodes, gpus=1, backend="local", name="t")
    run_dir.mkdir(parents=True, exist_ok=True)
    spec.write(run_dir)
    return spec


def make_supervisor(run_dir: Path, owner: str, node_rank: int = 0, nnodes: int = 1) -> Supervisor:
    spec = make_spec(run_dir, nodes=nnodes)
    node = lnode.NodeEnv(node_rank=node_rank, nnodes=nnodes, per_node=1, rdzv_host="127.0.0.1",
                         rdzv_port=29999, run_id="races")

    def start(*_: Any) -> Any:
        raise AssertionError("no agent is started here")

    return Supervisor(node, run_dir, spec, RankEnv(attempt=0, owner=owner), start,
                      local=spec.backend == "local")


def gone_process() -> lease.Process:
    """The identity of a process of this host that has exited (a command killed -9)."""
    p = subprocess.Popen(["sleep", "30"])
    found = proc.identity(p.pid)
    p.kill()
    p.wait()
    assert found is not None
    return lease.Process(**found)


@pytest.fixture
def short_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease, "WATCH_S", 1.0)
    monkeypatch.setattr(lease, "SUBMIT_WAIT_S", 0.0)


def test_every_launcher_of_one_job_gets_the_run_from_a_command_that_died(
        tmp_path: Path, short_watch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command that submitted job 77 died on the login node after sbatch, before it
    named the job the owner: the first launcher takes the run, the next one must find its
    own job there (it exited, and the rendezvous waited for it)."""
    cli = lease.Process(host="login1", pid=4242, start=1, boot="other-boot")
    lease.path(tmp_path).write_text(lease.Owner(kind="process", process=cli, epoch=1, what="hpcshard submit")
                                    .to_json())
    monkeypatch.setattr(lslurm.cluster, "job_alive", lambda job: True)
    got: dict[int, lease.Owner | None] = {}
    threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, lslurm.own_run(tmp_path, "77")))
               for n in range(2)]
    threads[0].start()
    time.sleep(0.5)  # srun starts the tasks of one job a moment apart
    threads[1].start()
    for t in threads:
        t.join(10)
    assert got[0] is not None and got[1] is not None and got[0].token == got[1].token


def test_a_commands_lease_stays_its_own_seen_from_a_host_that_cannot_look_it_up(tmp_path: Path) -> None:
    """A `resume` in its preflight, seen from a compute node: only its beat can tell it is
    alive, so the command renews it while it holds the run."""
    from hpcshard.cli.request import take_run

    claim = take_run(tmp_path, "hpcshard resume")
    seen = lease.read(tmp_path)
    assert seen is not None and seen.process is not None
    lease.path(tmp_path).write_text(replace(seen, process=replace(seen.process, boot="the-login-node"))
                                    .to_json())
    with pytest.raises(lease.Busy, match="renews the lease"):
        lease.take(tmp_path, lease.Owner.of_job("20"), lambda j: False, watch_s=lease.RENEW_S * 2 + 1)
    assert lease.read(tmp_path).token == claim.token  # type: ignore[union-attr]  # it keeps the run


HOLD = """
import sys, time
from pathlib import Path
from hpcshard.rundir.files import locked
with locked(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def die_holding(path: Path) -> None:
    """A process killed inside `files.locked` (a rank SIGKILLed while it appends)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    p.kill()
    p.wait()
    assert path.with_name(path.name + ".lock").exists()


def test_a_lock_whose_holder_of_this_host_died_is_broken_at_once(tmp_path: Path) -> None:
    """It was waited for LOCK_STALE_S (30 s): the fault path's ledger appends with it, and
    a launcher silent for LOST_S is taken for lost by its peers."""
    die_holding(tmp_path / ledger.LEDGER)
    began = time.monotonic()
    ledger.append(tmp_path, events.GaveUp(attempt=0, reason="x"))
    assert time.monotonic() - began < LOST_S / 2


def test_a_slow_holder_whose_lock_was_broken_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A holder that stood still past LOCK_STALE_S (a frozen node, a stalled file server) is
    told before it writes: it would write back what it read, undoing what others did."""
    monkeypatch.setattr(files, "LOCK_STALE_S", 0.3)
    target = tmp_path / "spec.json"
    with pytest.raises(files.LockLost), files.locked(target) as held:
        with files.locked(target, timeout=5):  # another waiter breaks it meanwhile
            pass
        held()


def test_a_stale_lock_broken_by_two_waiters_at_once_has_one_holder_after(tmp_path: Path) -> None:
    target = tmp_path / "owner.json"
    lock = target.with_name(target.name + ".lock")
    dead = tmp_path / ".holder"
    dead.write_text('{"pid": 4242, "host": "n9"}\n')
    lock.hardlink_to(dead)
    holder = dead.read_text()
    files._break(lock, holder)  # waiter A breaks it...
    with files.locked(target, timeout=2):  # ...and takes it
        files._break(lock, holder)  # waiter B, on its earlier read of the dead holder
        assert lock.exists() and lock.read_text() != holder  # A's lock is still A's
        with pytest.raises(TimeoutError), files.locked(target, timeout=0.3):
            pass  # a third waiter does not get it


def test_a_local_run_whose_command_was_killed_is_not_taken_while_its_launchers_run(tmp_path: Path) -> None:
    """A refused `resume` used to take the lease and then release it: the launchers' next
    renewal failed, and the live run was killed."""
    lease.path(tmp_path).write_text(lease.Owner(kind="process", process=gone_process(), epoch=1,
                                                what="a local run").to_json())
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from hpcshard.rundir import launchers; "
        f"launchers.write_pid_file(Path({str(tmp_path)!r}), 0); print('up', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "up"
        with pytest.raises(lease.Busy, match="its launchers .* still run"):
            lease.take(tmp_path, lease.Owner.of_process("hpcshard resume"), lambda j: None)
    finally:
        launcher.kill()
        launcher.wait()
    taken = lease.take(tmp_path, lease.Owner.of_process("hpcshard resume"), lambda j: None)
    lease.release(tmp_path, taken, restore=True)  # (a resume that then gave up)
    assert lease.read(tmp_path).what == "a local run"  # type: ignore[union-attr]


def test_a_leader_that_finds_the_run_taken_over_says_so_and_its_peers_leave_without_blame(
        tmp_path: Path) -> None:
    """It left without a last heartbeat: its peers took it for lost 8 s later and drained
    its node."""
    mine = lease.take(tmp_path, lease.Owner.of_job("5"), lambda j: False)
    (tmp_path / launchers.LAUNCH).mkdir()
    leader = make_supervisor(tmp_path, owner=mine.token, nnodes=2)
    leader.renewed = -1e9
    lease.take(tmp_path, lease.Owner.of_job("6"), lambda j: False)  # a guard or a resume took the run
    assert leader.run() == 0 and leader.fenced
    said = launchers.beats(tmp_path, 0, 2)[0]
    assert "done" in said and "fenced" in said
    peer = make_supervisor(tmp_path, owner=mine.token, node_rank=1, nnodes=2)
    with pytest.raises(TakenOver, match="node 0 found the run taken over"):
        peer.lost([0])


def test_a_cancel_while_a_restarts_agent_starts_reaches_the_new_agent(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`forward` gave the TERM to the previous cycle's agent, long reaped, and the new one
    trained on to the end."""
    make_spec(tmp_path)
    monkeypatch.setenv("HPCSHARD_WARM_START", "0")
    agents: list[subprocess.Popen[bytes]] = []

    class Restarting(Supervisor):
        def run(self) -> int:
            old = subprocess.Popen(["true"])
            old.wait()
            self.proc = old  # cycle 0's agent, ended (a fault, then a restart decision)

            def start(node: Any, env: Any) -> Any:  # the TERM comes while the new agent starts
                os.kill(os.getpid(), signal.SIGTERM)
                agents.append(subprocess.Popen(["sleep", "4"]))
                return agents[-1]

            self.start = start  # type: ignore[method-assign]
            return self.cycle(replace(self.node, run_id="races-c1"), 1).code

    monkeypatch.setattr(lnode, "Supervisor", Restarting)
    term = signal.getsignal(signal.SIGTERM)
    try:
        node = lnode.NodeEnv(node_rank=0, nnodes=1, per_node=1, rdzv_host="127.0.0.1", rdzv_port=29998,
                             run_id="races")
        lnode.run_node(node, tmp_path)
    finally:
        signal.signal(signal.SIGTERM, term)
    assert agents and agents[0].returncode == -signal.SIGTERM


def test_a_scripts_bug_stop_still_names_the_rank_that_failed_first(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The supervisor now closes the attempt itself (a bug); the script's failure summary
    was printed only when nothing had."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.log").write_text("Traceback ...\nKeyError: 'tokens'\n")
    for cycle in (0, 1):
        ledger.append(tmp_path, events.RankFailed(attempt=0, cycle=cycle, rank=1, host="n2", code=1, step=7,
                                                  error="exit 1", message="",
                                                  log=str(tmp_path / "logs" / "rank-1.log")))
    ledger.append(tmp_path, events.End(attempt=0, cycle=1, reason=EndReason.BUG, how="the same error",
                                       saved_step=0))
    capsys.readouterr()
    code = lnode._script_outcome(tmp_path, True, 0, BUG_EXIT, noticed=False, killed=False, grace=60)
    assert code == BUG_EXIT
    assert "rank 1 failed first" in capsys.readouterr().err


def test_a_cancel_between_two_attempts_of_a_local_run_reaches_its_owning_command(tmp_path: Path) -> None:
    """Between a requeue's two attempts no launcher runs: `cancel` found nothing to cancel,
    and the next attempt started."""
    from click.testing import CliRunner

    from hpcshard.cli import main
    from tests.unit.test_rundir_lease import held

    make_spec(tmp_path)
    with held(tmp_path, "hpcshard submit") as owner:
        result = CliRunner().invoke(main, ["cancel", str(tmp_path)])
        assert result.exit_code == 0 and "between two attempts" in result.output, result.output
        assert owner.wait(10) == -signal.SIGTERM


def load_fault(cycle: int) -> events.RankFailed:
    # What runtime.main._failed records for a LoadFault raised by Checkpointer.resume: the
    # trainer is built, not yet trained (step 0), in every cycle.
    return events.RankFailed(
        attempt=0, cycle=cycle, rank=0, host="n1", step=0, error="LoadFault",
        message="checkpoint /r/checkpoints/step-00000040 could not be read (transient: OSError: "
                "[Errno 5] Input/output error); it is left as it is, for the restarted ranks to read again",
        log="/r/logs/rank-0.log")


def test_a_load_fault_that_persists_over_one_restart_is_not_a_bug(tmp_path: Path) -> None:
    """LoadFault says 'the launchers restart the ranks, which read the same checkpoint again'.
    The supervisor takes it for the job's own exception: the second one (same type, step 0)
    is a 'bug' (BUG_EXIT, end 'bug', never restarted nor requeued) after ~70 s of NFS/Lustre
    trouble or a GPU whose memory is still held, within max_restarts=3 and before
    no_progress_restarts=2 would have had its say."""
    sup = make_supervisor(tmp_path, owner="")
    for cycle in (0, 1):
        ledger.append(tmp_path, load_fault(cycle))
    assert sup._same_bug(1) == ""
    decided = policy.decide(policy.Facts(cycle=1, active=(0,), bug=sup._same_bug(1), stalled=1,
                                         committed=40, max_restarts=3, no_progress_restarts=2))
    assert decided.end != "bug"


def test_a_guard_takes_over_an_attempt_whose_fault_was_restarted_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycle 0: a rank raised; rank 0's _failed wrote end(reason=error, cycle 0); the
    supervisor restarted the ranks in place (cycle 1 trains). Then the batch node fails:
    job 7 FAILED. Its attempt was never closed by a decision, yet the guard reads the cycle-0
    end record as 'attempt 0 ended (end)' and declines: the run is left for a manual resume."""
    from hpcshard.launch import slurm

    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=1, backend="slurm", name="x", spares=1,
            jobs=["7"]).write(tmp_path)
    (tmp_path / LAUNCH).mkdir()
    lease.take(tmp_path, lease.Owner.of_job("7"), lambda job: None)
    for r in [events.Start(attempt=0, cycle=0, world=2, nodes=2, host="n1"),
              events.End(attempt=0, reason=EndReason.ERROR, cycle=0,
                         error="RuntimeError: CUDA error: an illegal memory access"),
              events.Start(attempt=0, cycle=1, world=2, nodes=2, host="n1")]:
        ledger.append(tmp_path, r)
    failed = slurm.cluster.JobInfo.of_scontrol("7", {"JobState": "NODE_FAIL"})
    monkeypatch.setattr(slurm.cluster, "show_job", lambda job, timeout=0: failed)
    monkeypatch.setattr(slurm.cluster, "job_alive", lambda job, timeout=0: False)
    env = slurm.SlurmEnv(job_id="9", ref="9", nodes=["n1", "n2"], node_id=0, restart_count=0, gpus_on_node=1)
    assert slurm._take_over(tmp_path, env, "7", 0, 2)
    assert attempt_file(tmp_path, "9").read_text() == "1\n"


def test_a_console_on_a_full_disk_never_fails_a_launcher_or_a_rank(tmp_path: Path) -> None:
    """Under Slurm a launcher's stderr is a file in the run directory: in the chaos soak a
    launcher died of printing that its heartbeat could not be written (ENOSPC from
    `print`), before its last heartbeat, and its peers waited for it until they gave up."""
    with open("/dev/full", "w") as full:
        said = subprocess.run([sys.executable, "-c", (
            "import sys; from hpcshard.rundir import console; console.harden(); "
            "print('x' * 100000, file=sys.stderr, flush=True); print('y', flush=True); sys.exit(7)")],
            stderr=full, stdout=subprocess.PIPE, text=True, timeout=60)
        unhardened = subprocess.run(
            [sys.executable, "-c", "import sys; print('x', file=sys.stderr, flush=True)"], stderr=full,
            timeout=60)
    assert said.returncode == 7 and said.stdout == "y\n"
    assert unhardened.returncode != 0  # (what it guards against)


def test_a_launcher_that_ended_never_decides(tmp_path: Path) -> None:
    """In the chaos soak node 0's launcher ended (its last heartbeat said so) while node 1
    declared a fault: node 1 and the spare waited for node 0 to decide until they gave up
    (150 s), and the run stopped."""
    (tmp_path / launchers.LAUNCH).mkdir(parents=True)
    sup = make_supervisor(tmp_path, owner="", node_rank=1, nnodes=2)
    launchers.beat(tmp_path, 0, 0, {"node": 0, "pid": 1, "seq": 7})
    assert sup.decider() == 0  # alive and well: it decides
    launchers.beat(tmp_path, 0, 0, {"node": 0, "pid": 1, "seq": 8, "done": 1})
    assert sup.decider() == 1


def test_a_decider_whose_decision_lost_blames_and_records_nothing(tmp_path: Path) -> None:
    """A 2-node job cut in two: node 0 takes node 1 for lost while node 1 (through the
    files) already decided that node 0 is. Node 0 goes by node 1's decision, and neither
    marks node 1 bad (in the ledger, and in Slurm a drain) nor records the fault: the
    decider whose decision stands does (before, each side drained the other's healthy node)."""
    from hpcshard.launch import coord
    from hpcshard.launch.supervise import Watch
    from hpcshard.rundir import launchers, ledger

    run = tmp_path / "run"
    sup = make_supervisor(run, owner="", node_rank=0, nnodes=2)
    (run / launchers.LAUNCH).mkdir()
    sup.peers.began -= coord.UNHEARD_S + coord.LOST_S + 1  # node 1 never heard of since: lost
    sup.peers.heard_since -= coord.UNHEARD_S + coord.LOST_S + 1
    theirs = {"action": "stop", "code": 1, "reason": "node(s) [0] lost", "end": "fault", "lost": [0],
              "bad": [0]}
    launchers.decide(run, 0, 0, theirs)
    launchers.mark_down(run, 0, 0, 0, {"dead": [], "reached": 7})  # (its own ranks, as recover() says)
    decided = sup.decide(0, Watch(code=1, fault={"cause": "node(s) [1] lost: silent for 8 s"}))
    assert decided.reason == "node(s) [0] lost" and decided.lost == (0,)
    assert not ledger.bad_nodes(run) and not [r for r in ledger.read(run) if r["event"] == "fault"]
