"""Faults inside the allocation, injected the way they happen, on 2 nodes of the local
backend (the launchers Slurm runs): a rank killed with SIGKILL, a bug in the job's own code,
a rank that dies at every start. The killed and the stopped rank's tests run 2 x 2 against
`uninterrupted` (a node whose other rank lives on; the stopped rank named missing from a
collective of a mesh group by the flight records); the others need only two launchers and a
rank on each, and run 2 x 1 (against `uninterrupted_2x1` where they compare bit for bit): a
2 x 2 start costs about 9 CPU-s more, two more ranks to build, and the suite is CPU-bound."""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch.procs import descendants
from hpcshard.rundir import flight, ledger
from hpcshard.rundir.goodput import account
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.rankenv import BUG_EXIT, REQUEUE_EXIT
from hpcshard.rundir.spec import RunSpec
from tests.conftest import NOT_ABOUT_HANGS, ROOT, STEPS, hpcshard, hpcshard_bg, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
    trained_to,
)

FAULTY = str(ROOT / "tests" / "jobs" / "faulty.py")


def faults(run: Path) -> list[dict[str, Any]]:
    return [r for r in ledger.read(run) if r["event"] == "fault"]


def test_a_killed_rank_is_restarted_in_place_and_the_run_ends_bitwise_equal(uninterrupted: Path,
                                                                            tmp_path: Path) -> None:
    run = tmp_path / "killed"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py", "--run-dir",
                       str(run), *sets(steps=STEPS, ckpt_every=4, keep_last=100, **NOT_ABOUT_HANGS))
    wait_for(partial(trained_to, run, 6), 180, "step 6, past the commit of step 4")
    victim = rank_pids(run)[-1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]

    (fault,) = faults(run)
    assert fault["restart"] and fault["culprit"]["pid"] == victim and "died" in fault["cause"]
    # seconds, not torchrun's 300 s or gloo's 30 min (not 5: a loaded machine's launcher may
    # take longer to look, and 60 is still far from either)
    assert fault["declared"] - killed_at < 60
    starts = [r for r in ledger.read(run) if r["event"] == "start"]
    assert [(s["attempt"], s["cycle"]) for s in starts] == [(0, 0), (0, 1)]
    assert starts[1]["resumed_step"] == fault["committed"] >= 4
    # Only what the fault lost is trained twice; the rest once.
    trained = [r["step"] for r in step_records(run)]
    assert sorted(set(trained)) == list(range(1, STEPS + 1))
    assert len(trained) - STEPS == fault["reached"] - fault["committed"] == fault["lost_steps"]
    # Weights, optimizer, schedule, data position and RNG end as if nothing had happened.
    reference = committed(uninterrupted)
    mine = committed(run)
    assert STEPS in mine
    for step, path in mine.items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
    (back,) = [r for r in ledger.read(run) if r["event"] == "recovered"]
    # (seconds: not a wait for DOWN_TIMEOUT_S, 120 s, or torchrun's 300 s)
    assert back["cycle"] == 1 and back["step"] == fault["committed"] + 1 and 0 < back["seconds"] < 60
    assert fault["detect_s"] <= 0.2  # a crash is seen within one look
    # The launchers coordinated through node 0's store: no fault or down file, the decision's
    # one file (created exclusively: the arbiter of a job cut in two), and each heartbeat
    # file written only at the launcher's start and end (`launch.coord`).
    assert not [p.name for p in (run / "launch").iterdir() if p.name.startswith(("fault-", "down-"))]
    assert [p.name for p in (run / "launch").glob("next-*")] == ["next-0-0.json"]
    assert {p.name for p in (run / "launch").glob("alive-*")} == {"alive-0-0.json", "alive-0-1.json"}
    status = hpcshard("status", str(run)).stdout
    assert "0.1" in status and "faults (1):" in status and f"rank {fault['culprit']['rank']}" in status
    assert f"training again {back['seconds']:.1f} s after" in status
    # The limits the watchdog learned, per start (node 0's), and the newest in status.
    learned = [r for r in ledger.read(run) if r["event"] == "watchdog"]
    # (the floor: NOT_ABOUT_HANGS's here)
    assert [r["cycle"] for r in learned] == [0, 1] and learned[0]["step_limit"] >= 60
    assert f"watchdog (0.1): a step may take {learned[-1]['step_limit']:.1f} s" in status
    # Goodput: the wall time, cut into what it went to, adds up (the fault's share shows).
    spec = RunSpec.read(run)
    good = account(run, spec.created)
    assert sum(good.seconds.values()) == pytest.approx(good.wall, rel=0.01)
    assert good.faults == 1 and good.starts == 2
    assert all(good.seconds[k] > 0 for k in ("training", "recomputed", "start-up", "recovery"))
    shown = hpcshard("status", str(run), "--goodput").stdout
    assert "effective training time" in shown and "recomputed" in shown


def test_a_notice_during_a_faults_recovery_requeues_and_the_run_ends_bitwise_equal(
        uninterrupted_2x1: Path, tmp_path: Path) -> None:
    """A rank dies and the preemption notice comes a moment later, while the ranks are down
    or restarting: the notice is not lost. The job goes back through the queue (not
    restarted in place) and the next attempt resumes exactly."""
    run = tmp_path / "both"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir",
                       str(run), *sets(steps=STEPS, ckpt_every=4, keep_last=100, **NOT_ABOUT_HANGS))
    wait_for(partial(trained_to, run, 6), 180, "step 6, past the commit of step 4")
    os.kill(rank_pids(run)[-1], signal.SIGKILL)
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    starts = [(r["attempt"], r.get("cycle", 0)) for r in ledger.read(run) if r["event"] == "start"]
    assert starts[-1][0] == 1, starts  # requeued once...
    assert all(cycle == 0 for attempt, cycle in starts if attempt == 1)  # ...and not faulted again
    ends = [r for r in ledger.read(run) if r["event"] == "end" and r["attempt"] == 0]
    assert ends[-1]["reason"] == "stop", ends
    reference = committed(uninterrupted_2x1)
    for step, path in committed(run).items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")


def test_a_frozen_node_is_lost_in_seconds_and_the_run_requeues_and_ends_bitwise_equal(
        uninterrupted_2x1: Path, tmp_path: Path) -> None:
    """Every process of node 1 stopped (its launcher, agent and ranks: a node that froze or
    fell off the network). Node 0's ranks hang; node 1 never reports down and its heartbeat
    stops: lost after 10 s, marked bad, and the job goes back through the queue (locally: a
    new attempt, after the frozen node is killed)."""
    run = tmp_path / "frozen"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir",
                       str(run), *sets(steps=STEPS, ckpt_every=4, keep_last=100, **NOT_ABOUT_HANGS))
    wait_for(partial(trained_to, run, 7), 180, "step 7, past the warm-up and a commit")
    node1 = launchers(run)[1]
    frozen = [node1, *descendants(node1)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    frozen_at = time.time()
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    (fault,) = faults(run)
    assert fault["lost"] == [1] and fault["code"] == REQUEUE_EXIT and "lost" in fault["reason"]
    assert fault["time"] - frozen_at < 30  # its silence (LOST_S, 8 s), not DOWN_TIMEOUT_S (120 s)
    (bad,) = [r for r in ledger.read(run) if r["event"] == "bad_node"]
    assert bad["node"] == 1 and "silent" in bad["reason"]
    assert [r["attempt"] for r in ledger.read(run) if r["event"] == "start"] == [0, 1]
    reference = committed(uninterrupted_2x1)
    for step, path in committed(run).items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")
    assert "bad nodes (1)" in hpcshard("status", str(run)).stdout


def test_a_frozen_node_0_takes_its_store_with_it_and_the_others_carry_on_through_the_standby(
        uninterrupted_2x1: Path, tmp_path: Path) -> None:
    """Every process of node 0 stopped: the launchers' store (served by its launcher) stops
    answering with it. Node 1 gives the store up after LOST_S of silence for the standby it
    serves itself, declares node 0 lost there, decides (it is the lowest launcher left) and
    the job goes back through the queue; the run ends as if nothing had happened."""
    run = tmp_path / "frozen0"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir",
                       str(run), *sets(steps=STEPS, ckpt_every=4, keep_last=100, **NOT_ABOUT_HANGS))
    wait_for(partial(trained_to, run, 7), 180, "step 7, past the warm-up and a commit")
    node0 = launchers(run)[0]
    frozen = [node0, *descendants(node0)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    frozen_at = time.time()
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    # (the store gone with node 0, node 1 went on through its standby: no fault file, the
    # decision's one file is the arbiter's)
    assert "node 1: " in out and "the launchers coordinate through the standby store on node 1" in out
    assert not (run / "launch" / "fault-0-0.json").exists() and (run / "launch" / "next-0-0.json").exists()
    (fault,) = faults(run)
    assert fault["lost"] == [0] and fault["code"] == REQUEUE_EXIT and "lost" in fault["reason"]
    assert fault["time"] - frozen_at < 30
    (bad,) = [r for r in ledger.read(run) if r["event"] == "bad_node"]
    assert bad["node"] == 0 and "silent" in bad["reason"]
    assert [r["attempt"] for r in ledger.read(run) if r["event"] == "start"] == [0, 1]
    reference = committed(uninterrupted_2x1)
    for step, path in committed(run).items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")


def test_a_stopped_rank_is_a_hang_found_in_seconds_and_the_run_ends_bitwise_equal(
        uninterrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "hung"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py", "--run-dir",
                       str(run), *sets(steps=STEPS, ckpt_every=4, keep_last=100, watchdog_floor_s=4))
    wait_for(partial(trained_to, run, 7), 180, "step 7, past the warm-up and a commit")
    victim = rank_pids(run)[1]
    os.kill(victim, signal.SIGSTOP)  # a hang: the process is there and does nothing
    stopped_at = time.time()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]

    (fault,) = faults(run)
    assert fault["restart"] and "made no progress in phase step" in fault["cause"]
    assert fault["culprit"]["pid"] == victim and fault["culprit"]["state"] == "stopped"
    assert 3.7 < fault["detect_s"] < 30  # silent for its limit (the 4 s floor), a look early
    # The flight records of the ranks that could answer: the stopped one is missing from
    # a collective they wait in (gloo's flight recorder, read back by node 0).
    assert flight.roots(fault["collectives"]) == [fault["culprit"]["rank"]], fault["collectives"]
    assert f"rank {fault['culprit']['rank']} missing from gloo:" in out
    # The limit is learned from the steps (here the 4 s floor), not gloo's 30 minutes.
    assert fault["declared"] - stopped_at < 30
    # Before it was killed, the hung rank wrote where it was; `logs --culprit` shows it.
    shown = hpcshard("logs", str(run), "--culprit", "--lines", "200")
    assert shown.returncode == 0 and f"rank {fault['culprit']['rank']} (" in shown.stdout
    assert "most recent call first" in shown.stdout and "attempt 0 cycle 1 " not in shown.stdout
    reference = committed(uninterrupted)
    for step, path in committed(run).items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")


def test_a_rank_spinning_in_the_jobs_code_is_named_with_its_stack_and_the_collective(
        tmp_path: Path) -> None:
    """A livelock, not a stopped process: rank 1 (node 1) spins (running) while its peer on
    node 0 sleeps in a collective. The watchdog names the busy rank, its stack shows where,
    the flight records show it missing from the collective its peer waits in; the restart
    then finishes. (2 x 1: node 0 reads back the flight records of another node's rank.)"""
    run = tmp_path / "spin"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", FAULTY, "--run-dir", str(run),
                    *sets(steps=10, ckpt_every=4, spin_at=7, fail_rank=1, watchdog_floor_s=2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (fault,) = faults(run)
    assert fault["restart"] and fault["culprit"]["rank"] == 1 and fault["culprit"]["state"] == "R"
    assert flight.roots(fault["collectives"]) == [1], fault["collectives"]
    log = (run / "logs" / "rank-1.log").read_text()
    assert "most recent call first" in log and 'faulty.py", line' in log


def test_slow_saves_and_long_evaluations_are_not_taken_for_hangs(tmp_path: Path) -> None:
    """Every save and evaluation 3x slower and 3 s at least, while a step's limit is 1 s: the
    phases the ranks report keep the watchdog on the outer limit for them. No fault. (2 x 1:
    each node's watchdog judges its own rank.)"""
    run = tmp_path / "slow"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", FAULTY, "--run-dir", str(run),
                    *sets(steps=8, ckpt_every=4, eval_every=4, eval_batches=1, watchdog_floor_s=1),
                    env={"FAULTY_SLOW": "3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not faults(run)
    log = (run / "logs" / "rank-0.log").read_text() + proc.stdout
    slowed = [float(line.split(" to ")[1].split()[0]) for line in log.splitlines()
              if line.startswith("faulty: ")]
    assert len(slowed) >= 4 and min(slowed) >= 3  # saves and evaluations of 4 and 8
    assert sorted(committed(run)) == [4, 8]


def test_a_bug_in_the_job_stops_after_one_retry_with_one_line(tmp_path: Path) -> None:
    """Rank 1 (node 1 of 2 x 1) raises in the job's code at the same step of each start."""
    run = tmp_path / "bug"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", FAULTY, "--run-dir", str(run),
                    *sets(steps=8, ckpt_every=100, fail_at=3, fail_rank=1))
    assert proc.returncode == BUG_EXIT, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = faults(run)
    assert first["restart"] and not second["restart"] and second["code"] == BUG_EXIT
    culprit = second["culprit"]
    assert (culprit["rank"], culprit["step"], culprit["error"]) == (1, 2, "RuntimeError")
    line = next(x for x in proc.stderr.splitlines() if "not restarted" in x)
    assert "rank 1 on" in line and "at step 2" in line and "injected bug" in line
    assert "rank-1.log" in line


def test_a_rank_that_dies_at_every_start_stops_without_a_restart_storm(tmp_path: Path) -> None:
    """Rank 0 killed as soon as every rank of a start is up (2 x 1: three starts)."""
    run = tmp_path / "storm"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir",
                       str(run), "--max-restarts", "5", *sets(steps=STEPS))
    killed: set[int] = set()
    while proc.poll() is None and len(killed) < 6:
        ranks = rank_pids(run)
        if len(ranks) == 2 and not killed & set(ranks):
            killed.add(ranks[0])
            os.kill(ranks[0], signal.SIGKILL)
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    decisions = [(f["restart"], f["committed"]) for f in faults(run)]
    assert decisions == [(True, 0), (True, 0), (False, 0)]  # 2 restarts that saved nothing
    assert "2 restarts in a row without a newer checkpoint" in faults(run)[-1]["reason"]


def test_a_nan_loss_stops_the_run_with_the_checkpoint_before_it_intact(tmp_path: Path) -> None:
    """Rank 1's loss (node 1 of 2 x 1) is nan at step 7: every rank stops there."""
    run = tmp_path / "nan"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", FAULTY, "--run-dir", str(run),
                    *sets(steps=12, ckpt_every=4, nan_at=7, fail_rank=1))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if "nan or inf" in x)
    assert "at step 7" in line and "step 4, is intact" in line
    assert not faults(run)  # not a fault: a restart would only meet it again
    end = ledger.end_of(run, 0)
    assert end is not None and (end["reason"], end["step"], end["saved_step"]) == ("nonfinite", 7, 4)
    assert sorted(committed(run)) == [4]  # nothing saved after the bad step
    import torch

    weights = load(committed(run)[4])["model"]
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_nan_with_rollback_reloads_skips_the_bad_batch_and_finishes(uninterrupted_2x1: Path,
                                                                      tmp_path: Path) -> None:
    """nan_policy=rollback: the 7th global batch makes the loss nan (on every replay too).
    The ranks reload step 4, skip that batch (recorded in the ledger) and train to the end."""
    run = tmp_path / "rollback"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", FAULTY, "--run-dir", str(run),
                    *sets(steps=STEPS, ckpt_every=4, keep_last=100, nan_batch=7, nan_policy="rollback",
                          **NOT_ABOUT_HANGS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rollback,) = [r for r in ledger.read(run) if r["event"] == "rollback"]
    assert (rollback["step"], rollback["to"], rollback["skipped"]) == (7, 4, [[0, 6 * 24]])
    assert not faults(run)  # handled inside the ranks: no restart
    trained = [r["step"] for r in step_records(run)]
    assert trained.count(5) == trained.count(6) == 2 and trained.count(7) == 2
    import torch

    final = load(committed(run)[STEPS])
    assert final["progress"]["data"] == {"epoch": 0, "offset": (STEPS + 1) * 24}  # one skipped
    assert all(torch.isfinite(t).all() for t in final["model"].values())
    # Up to the commit it went back to, the run is the uninterrupted one, bit for bit.
    assert_bitwise_equal(load(committed(run)[4]), load(committed(uninterrupted_2x1)[4]), "step 4")
    assert "rolled back to step 4" in hpcshard("status", str(run)).stdout


def test_a_spent_restart_budget_goes_back_through_the_queue_and_finishes(tmp_path: Path) -> None:
    """Node 1's rank killed in two cycles of one attempt (2 x 1: three starts in all)."""
    run = tmp_path / "budget"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir",
                       str(run), "--max-restarts", "1", *sets(steps=STEPS, ckpt_every=2, **NOT_ABOUT_HANGS))
    def started(cycle: int) -> bool:
        return any(r["event"] == "start" and r.get("cycle") == cycle for r in ledger.read(run))

    def trained_since(t: float) -> bool:
        return sum(1 for r in step_records(run) if r["time"] > t) >= 3

    for cycle in range(2):  # two crashes, each after this cycle committed a checkpoint
        wait_for(partial(started, cycle), 180, f"cycle {cycle}")
        since = max(r["time"] for r in ledger.read(run) if r["event"] == "start")
        wait_for(partial(trained_since, since), 180, f"cycle {cycle} to train")
        os.kill(rank_pids(run)[-1], signal.SIGKILL)
        wait_for(partial(lambda n: len(faults(run)) > n, cycle), 60, f"fault {cycle}")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    first, second = faults(run)
    assert first["restart"] and not second["restart"] and "requeued" in second["reason"]
    starts = [(r["attempt"], r["cycle"]) for r in ledger.read(run) if r["event"] == "start"]
    assert starts == [(0, 0), (0, 1), (1, 0)]  # the requeued attempt has a budget of its own
    assert STEPS in committed(run)


def test_a_node_failing_the_profiles_health_check_never_trains(tmp_path: Path) -> None:
    """Locally there is no other node to move to: the run stops with the node and why."""
    site = tmp_path / "site.toml"
    site.write_text("[defaults]\nhealth_check = '[ \"$HPCSHARD_NODE_RANK\" != 1 ] || "
                    "{ echo \"no GPU answers\" >&2; exit 1; }'\n")
    run = tmp_path / "unhealthy"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                    *sets(steps=4), env={"HPCSHARD_SITE": str(site)})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "node 1 (" in proc.stderr and "failed its health check" in proc.stderr
    assert "no GPU answers" in proc.stderr and "no other node" in proc.stderr
    (bad,) = [r for r in ledger.read(run) if r["event"] == "bad_node"]
    assert bad["node"] == 1 and "no GPU answers" in bad["reason"]
    assert not step_records(run)
