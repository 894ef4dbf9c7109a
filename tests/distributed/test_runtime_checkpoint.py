"""Checkpoints under real preemption and real faults, 2 nodes x 2 ranks on CPU/gloo,
through the CLI and the local backend (the same launcher Slurm runs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from hpcshard.launch.procs import ranks_below
from hpcshard.rundir import ledger, store
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.rankenv import REQUEUE_EXIT, STORAGE_EXIT
from tests.conftest import (
    ROOT,
    STEPS,
    hpcshard,
    hpcshard_bg,
    metrics,
    quiet_env,
    sets,
    step_records,
    tmpfs,
    wait_for,
)
from tests.distributed.test_runtime_planner import assert_planned

FAULTY = str(ROOT / "tests" / "jobs" / "faulty.py")
"""The demo with faults and waits on request (`--set`), for tests that need one."""


def committed(run: Path) -> dict[int, Path]:
    return {c.step: c.path for c in store.committed(run / store.CHECKPOINTS)}


def load(path: Path) -> dict[str, Any]:
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore")
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"{where} differs"
    else:
        assert a == b, where


def trained_to(run: Path, step: int) -> bool:
    return any(r["step"] >= step for r in step_records(run))


def preempted_once(run: Path, job: str, at_step: int, *args: str, nodes: int = 2, gpus: int = 2,
                   ) -> dict[str, Any]:
    """`submit` on `nodes` x `gpus` (2x2: `uninterrupted`'s shape) in the background,
    `hpcshard preempt` once past `at_step`, and the requeued attempt carried to the end.
    Returns attempt 0's end record (reason stop)."""
    proc = hpcshard_bg("submit", "--nodes", str(nodes), "--gpus", str(gpus), job, "--run-dir", str(run),
                       *args)
    wait_for(partial(trained_to, run, at_step), 180, f"step {at_step}")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "requeued as attempt 1" in out
    stop = ledger.end_of(run, 0)
    assert stop is not None and stop["reason"] == "stop"
    return stop


def test_three_preemptions_resume_bitwise_with_nothing_recomputed(uninterrupted: Path,
                                                                  tmp_path: Path) -> None:
    run = tmp_path / "preempted"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py", "--run-dir",
                       str(run), *sets(steps=STEPS, ckpt_every=4, async_save="true", keep_last=100))
    reached = 0
    for attempt in range(3):
        # Preempt once this attempt has trained a step of its own (each notice takes a few
        # steps to land on a loaded machine; attempt 2 must still stop before the last step).
        wait_for(partial(trained_to, run, reached + 1), 180, f"attempt {attempt} to train")
        if attempt == 1:  # a notice that reaches one rank only still stops every rank
            os.kill(rank_pids(run)[0], signal.SIGUSR2)
        else:
            assert hpcshard("preempt", str(run)).returncode == 0
        wait_for(partial(ledger.end_of, run, attempt), 120, f"attempt {attempt} to stop")
        reached = ledger.end_of(run, attempt)["step"]  # type: ignore[index]
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("requeued as attempt") == 3

    records = ledger.read(run)
    starts = [r for r in records if r["event"] == "start"]
    ends = [r for r in records if r["event"] == "end"]
    assert [e["reason"] for e in ends] == ["stop", "stop", "stop", "done"]
    for prev, start in zip(ends, starts[1:], strict=False):
        # Zero steps recomputed: the stop saved the step it reached, the next attempt
        # starts right after it.
        assert prev["saved_step"] == prev["step"] == start["resumed_step"]
    steps = [r["step"] for r in step_records(run)]
    assert steps == list(range(1, STEPS + 1))  # every step trained exactly once

    # Every checkpoint of the preempted run (the stops after 0, 1 and 2 cycles, the async
    # periodic ones, the end after 3 cycles) equals the uninterrupted run's, bit for bit:
    # weights, optimizer state, schedule, data position and per-rank RNG.
    reference = committed(uninterrupted)
    mine = committed(run)
    assert STEPS in mine and {e["step"] for e in ends[:3]} <= set(mine)
    for step, path in mine.items():
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")


def test_a_time_limit_notice_trains_on_until_the_deadline_less_the_save(tmp_path: Path) -> None:
    """The time limit's notice comes the lead time before the deadline (Slurm's launcher
    hands both to the ranks; here the environment does). A preemption's notice stops at
    once, but this one leaves time: the ranks train on and stop when what is left covers
    twice the measured save, two steps and a margin. No step is lost, fewer are wasted.
    The ranks train for a span of time, not a number of steps: each step sleeps 0.8 s in
    the job's loss (tests/jobs/faulty.py), so that span is not a minute and more of two busy
    ranks (89 CPU-s for 75 s at -n 1 with the demo's own steps)."""
    run = tmp_path / "deadline"
    deadline = time.time() + 100  # (a start under the suite's load takes most of a minute)
    # A lead longer than what is left at any notice: the deadline, not the notice plus the
    # lead, is the end the ranks plan for (`train.limit_end`), and the test reads it back.
    proc = hpcshard_bg("submit", "--nodes", "1", "--gpus", "2", FAULTY, "--run-dir", str(run),
                       "--max-requeues", "0", *sets(steps=2000, ckpt_every=3, keep_last=2, sleep_s=0.8),
                       env={"HPCSHARD_DEADLINE": str(int(deadline)), "HPCSHARD_NOTICE_LEAD": "120"})
    wait_for(partial(trained_to, run, 4), 180, "step 4, past a measured save")
    noticed_step = max(r["step"] for r in step_records(run))
    assert deadline - time.time() > 20, "the job started too slowly for this test's deadline"
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == REQUEUE_EXIT, out[-3000:]
    end = ledger.end_of(run, 0)
    assert end is not None and end["reason"] == "stop" and end["saved_step"] == end["step"]
    # The ranks planned a stop after the notice (a preemption stops at once), as far before
    # the deadline as two saves, two steps and the margin they measured (on a slow machine
    # that is more, and fewer steps fit: the plan is the ranks', the test reads it back).
    log = (run / "logs" / "rank-0.log").read_text()
    plans = [float(m) for m in re.findall(r"time-limit notice: training on until \S+, (\d+) s before", log)]
    assert plans, log[-3000:]
    planned = int(deadline) - plans[-1]
    assert end["step"] > noticed_step  # it trained on after the notice...
    assert planned - 1 <= end["time"] < deadline  # ...until its plan, and was done before the deadline
    # No periodic save once the notice came (each would make the stop's own save later).
    periodic = [int(line.split("checkpoint step ")[1].split()[0]) for line in log.splitlines()
                if "committed (periodic" in line]
    assert not [step for step in periodic if step > noticed_step + 10], periodic


def test_export_loads_into_a_plain_model_with_the_same_eval_loss(uninterrupted: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    proc = hpcshard("ckpt", "export", str(uninterrupted), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert hpcshard("ckpt", "export", str(uninterrupted), "--out", str(out)).returncode == 2

    from hpcshard.config import build_config
    from hpcshard.runtime.data import eval_batches
    from hpcshard.runtime.job import load_job

    job = load_job(str(ROOT / "jobs" / "charlm.py"))
    cfg = build_config(job.config, json.loads((uninterrupted / "spec.json").read_text())["sets"])
    model = job.model(cfg)
    model.load_state_dict(torch.load(out), strict=True)
    model.eval()
    splits = job.data(cfg)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(splits.eval, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                 micro=cfg.batch_size, rank=0, world=1, count=cfg.eval_batches):
            total += job.loss(model, x, y).item() * len(x)
            count += len(x)
    sharded = [r["eval_loss"] for r in metrics(uninterrupted) if "eval_loss" in r][-1]
    assert total / count == pytest.approx(sharded, rel=1e-5)

    # The same weights as safetensors (the `hf` extra brings the package), bit for bit.
    from safetensors.torch import load_file

    st = tmp_path / "model.safetensors"
    assert hpcshard("ckpt", "export", str(uninterrupted), "--out", str(st)).returncode == 0
    plain, safe = torch.load(out), load_file(str(st))
    assert plain.keys() == safe.keys() and all(torch.equal(plain[k], safe[k]) for k in plain)


@pytest.mark.parametrize("shape", [("1", "2"), ("1", "1"), ("3", "2"), ("1", "4"),
                                   ("4", "1", "shard=2")])  # a shard group over two nodes
def test_resume_on_another_shape_continues_the_same_samples(uninterrupted: Path, tmp_path: Path,
                                                            shape: tuple[str, ...]) -> None:
    run = tmp_path / "reshaped"
    shutil.copytree(uninterrupted, run)
    proc = hpcshard("resume", str(run), "--nodes", shape[0], "--gpus", shape[1], "--resume", "12",
                    *[a for s in shape[2:] for a in ("--set", s)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = [r for r in ledger.read(run) if r["event"] == "start"][-1]
    assert start["resumed_step"] == 12 and start["world"] == int(shape[0]) * int(shape[1])
    mine = [r for r in metrics(run)]
    last_start = max(i for i, r in enumerate(mine) if r.get("event") == "start")
    if shape[2:]:  # 2 replicas of a shard group over two nodes, from 2x2 hybrid's checkpoint
        assert (mine[last_start]["sharding"], mine[last_start]["mesh"]) == ("hybrid", [2, 2])
    resumed = {r["step"]: r["loss"] for r in mine[last_start:] if "loss" in r and "event" not in r}
    reference = {r["step"]: r["loss"] for r in step_records(uninterrupted)}
    # Steps 13..16 see the same global batches: a skipped or repeated sample would move
    # the loss far more than the reduction order of another world size does.
    assert sorted(resumed) == list(range(13, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=2e-4), step
    progress = load(committed(run)[STEPS])["progress"]
    assert progress["data"] == load(committed(uninterrupted)[STEPS])["progress"]["data"]
    # Replicated HSDP shards are written once: 2x2 writes the same bytes as 1x1 or 3x2 (a
    # replica would double them). DCP frames every shard of every tensor (1.7 KB each), so
    # 4 shards of this 0.9M-parameter model's 69 tensors add about 6% (the planner counts
    # them: assert_planned below holds each shape to 5%).
    size = store.inspect(committed(run)[STEPS]).bytes
    assert size == pytest.approx(store.inspect(committed(uninterrupted)[STEPS]).bytes, rel=0.10)
    assert_planned(run, int(shape[0]), int(shape[1]))


def test_damaged_newest_checkpoints_are_skipped_and_the_previous_used(uninterrupted: Path,
                                                                      tmp_path: Path) -> None:
    run = tmp_path / "damaged"
    shutil.copytree(uninterrupted, run)
    ckpts = committed(run)
    newest, second, third = ckpts[STEPS], ckpts[STEPS - 1], ckpts[STEPS - 2]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: caught by the manifest sizes
    meta = second / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)  # same size, garbage: caught by the load
    proc = hpcshard("resume", str(run), "--nodes", "1", "--gpus", "2", "--set", f"steps={STEPS + 1}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = [r for r in ledger.read(run) if r["event"] == "start"][-1]
    assert start["resumed_step"] == STEPS - 2 and start["resumed_from"] == str(third)
    reasons = dict(start["skipped"])
    assert "size differs" in reasons[newest.name] and "failed to load" in reasons[second.name]
    log = (run / "logs" / "rank-0.log").read_text()
    assert f"skipped checkpoint {newest.name}" in log and f"skipped checkpoint {second.name}" in log
    # Both damaged ones are renamed aside (kept for inspection) and never tried again; the
    # new timeline re-creates their step names without colliding.
    assert second.with_name(second.name + ".corrupt").is_dir()
    assert newest.with_name(newest.name + ".corrupt").is_dir()
    assert sorted(committed(run))[-3:] == [STEPS - 1, STEPS, STEPS + 1]


def rank_pids(run: Path) -> list[int]:
    """The ranks of `run`, by global rank: what reports on a board below its launchers."""
    return ranks_below(launchers(run))


def test_rank_killed_mid_save_resumes_from_the_previous_commit(tmp_path: Path) -> None:
    run = tmp_path / "killed"
    # A bigger model so that a save takes long enough to be caught in the middle.
    big = sets(steps=6, ckpt_every=2, dim=384, n_layers=6, n_heads=6, batch_size=4)
    proc = hpcshard_bg("submit", "--nodes", "1", "--gpus", "2", "jobs/charlm.py", "--run-dir",
                       str(run), *big)
    partial = run / store.CHECKPOINTS / (store.step_name(4) + store.TMP_SUFFIX)
    wait_for(lambda: 2 in committed(run), 240, "the first commit")
    wait_for(partial.exists, 120, "the second save to start")
    wait_for(lambda: len(rank_pids(run)) == 2, 60, "the ranks")
    victim = rank_pids(run)[-1]
    os.kill(victim, 9)
    out, _ = proc.communicate(timeout=300)
    # The launcher restarted the ranks in place from the last commit: the interrupted save
    # never became a checkpoint, and step 4 was saved again by the next cycle.
    assert proc.returncode == 0, out[-3000:]
    fault = next(r for r in ledger.read(run) if r["event"] == "fault")
    assert fault["restart"] and fault["committed"] == 2 and fault["culprit"]["pid"] == victim
    restarted = [r for r in ledger.read(run) if r["event"] == "start"][-1]
    assert (restarted["cycle"], restarted["resumed_step"]) == (1, 2)
    log = (run / "logs" / "rank-0.log").read_text()
    # The partial directory is reported and removed: by the surviving ranks when their
    # save failed, or at the next start.
    assert (f"removed incomplete checkpoint {partial.name}" in log
            or "checkpoint at step 4 FAILED" in log)
    assert not partial.exists() and sorted(committed(run)) == [2, 4, 6]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB filesystem: room for one 11 MB checkpoint, not for a second beside it."""
    with tmpfs(tmp_path / "disk", "16m") as mnt:
        yield mnt


def test_a_full_disk_stops_the_run_at_the_save_it_refused(small_disk: Path) -> None:
    """Step 2's checkpoint (11 MB) fits, step 4's beside it does not: the run stops there
    (before: it trained on unprotected to the end, and every log call printed a "Logging
    error" traceback), says what is full and how big the next checkpoint is, blames no
    node, and is neither restarted nor requeued."""
    run = small_disk / "run"
    proc = hpcshard("submit", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                    *sets(steps=8, ckpt_every=2, keep_last=1))
    out = proc.stdout + proc.stderr
    assert proc.returncode == STORAGE_EXIT, out[-3000:]
    assert "Logging error" not in out
    said = [line for line in out.splitlines() if "stopped at step 4 for the run's storage" in line]
    assert said and f"no space left on the device holding {run / store.CHECKPOINTS}" in said[0]
    assert "the next checkpoint needs about 11." in said[0] and "step 2, is intact" in said[0]
    end = ledger.end_of(run, 0)
    assert end is not None and (end["reason"], end["step"], end["saved_step"]) == ("storage", 4, 2)
    events = [r["event"] for r in ledger.read(run)]
    assert "bad_node" not in events and "fault" not in events and events.count("start") == 1
    assert max(r["step"] for r in step_records(run)) == 4
    assert [p.name for p in (run / store.CHECKPOINTS).iterdir() if p.is_dir()] == [store.step_name(2)]
    assert load(committed(run)[2])["progress"]["step"] == 2  # intact, and it loads


def test_on_storage_full_train_trains_on_unprotected_to_the_end(small_disk: Path) -> None:
    run = small_disk / "run"
    proc = hpcshard("submit", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                    *sets(steps=8, ckpt_every=2, keep_last=1, on_storage_full="train"))
    out = proc.stdout + proc.stderr
    assert "Logging error" not in out
    assert out.count("training on without it (on_storage_full=train)") == 2  # steps 4 and 6
    assert max(r["step"] for r in step_records(run)) == 8
    # Its last save failed too: the end is the storage's, and says so.
    assert proc.returncode == STORAGE_EXIT, out[-3000:]
    end = ledger.end_of(run, 0)
    assert end is not None and (end["reason"], end["step"], end["saved_step"]) == ("storage", 8, 2)
    assert sorted(committed(run)) == [2]


def test_read_only_run_dir_refuses_to_start(tmp_path: Path, small_disk: Path) -> None:
    run = small_disk / "run"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps({"job": str(ROOT / "jobs" / "charlm.py"), "sets": {},
                                               "nodes": 1, "gpus": 1, "backend": "local", "name": "x"}))
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    proc = hpcshard("resume", str(run))
    assert proc.returncode == 2
    assert "is not writable" in proc.stderr and "Read-only file system" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_requeue_cap_ends_with_a_committed_checkpoint_and_says_how_to_go_on(tmp_path: Path) -> None:
    run = tmp_path / "capped"
    proc = hpcshard_bg("submit", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                       "--max-requeues", "0", *sets(steps=200))
    wait_for(partial(trained_to, run, 3), 180, "training")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT, out[-2000:]
    assert f"continue with: hpcshard resume {run}" in out
    end = ledger.read(run)[-1]
    assert end["reason"] == "stop" and end["saved_step"] == end["step"] in committed(run)


SLOW_DELETE = '''import shutil, time
_rmtree = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if str(path).endswith(".deleting.tmp"):
        time.sleep(2)  # a big checkpoint on slow storage
    return _rmtree(path, *args, **kwargs)
shutil.rmtree = rmtree
'''
UMASK_002 = partial(os.umask, 0o002)
"""umask 0002 is common on clusters: nothing hpcshard writes may become refusable."""


@pytest.fixture(scope="module")
def retired_under_umask(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run for the two tests below (one start less, about 20 CPU-s): the demo on 1
    rank, 4 steps, a checkpoint every 2 and only the newest kept, submitted under umask 0002,
    with every process deleting retired checkpoints 2 s slower (a sitecustomize on
    PYTHONPATH). Tests copy it before they change anything."""
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(SLOW_DELETE)
    run = tmp_path_factory.mktemp("retired") / "run"
    proc = subprocess.run([sys.executable, "-m", "hpcshard", "submit", "--gpus", "1", "jobs/charlm.py",
                           "--run-dir", str(run), *sets(steps=4, ckpt_every=2, keep_last=1)], cwd=ROOT,
                          env=quiet_env(PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)])),
                          capture_output=True, text=True, preexec_fn=UMASK_002, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.mark.xdist_group("retired-under-umask")  # (one worker makes the run for both)
def test_a_group_writable_umask_still_resumes(retired_under_umask: Path, tmp_path: Path) -> None:
    run = tmp_path / "umask"
    shutil.copytree(retired_under_umask, run)  # (modes kept)
    for path in [run / store.CHECKPOINTS, *committed(run)[4].iterdir()]:
        assert not path.stat().st_mode & 0o022, path
    again = subprocess.run([sys.executable, "-m", "hpcshard", "resume", str(run), *sets(steps=5)],
                           cwd=ROOT, env=quiet_env(), capture_output=True, text=True,
                           preexec_fn=UMASK_002, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert [r for r in ledger.read(run) if r["event"] == "start"][-1]["resumed_step"] == 4


@pytest.mark.xdist_group("retired-under-umask")
def test_checkpoints_retired_by_the_last_save_are_gone_when_the_run_ends(retired_under_umask: Path) -> None:
    """A rank leaves by os._exit, which kills the thread deleting what the last commit
    retired: its step-N.deleting.tmp stayed for good (nothing starts after the last
    attempt to remove it). Every process of the run deleted retired checkpoints 2 s slower."""
    run = retired_under_umask
    assert sorted(p.name for p in (run / store.CHECKPOINTS).iterdir() if p.is_dir()) == [store.step_name(4)]


def test_a_checkpoint_that_no_longer_fits_the_model_stops_the_job(uninterrupted: Path,
                                                                  tmp_path: Path) -> None:
    run = tmp_path / "changed"
    shutil.copytree(uninterrupted, run)
    before = sorted(p.name for p in (run / store.CHECKPOINTS).iterdir())
    proc = hpcshard("resume", str(run), "--gpus", "2", "--nodes", "1", "--set", "dim=64")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "could be loaded" in out and "config differs from the checkpoint's in: dim" in out
    # Nothing renamed, nothing trained from scratch.
    assert sorted(p.name for p in (run / store.CHECKPOINTS).iterdir()) == before
    assert ledger.read(run)[-1]["reason"] == "error"


def test_resume_never_moves_the_old_timeline_aside(uninterrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "fresh"
    shutil.copytree(uninterrupted, run)
    proc = hpcshard("resume", str(run), "--nodes", "1", "--gpus", "2", "--resume", "never",
                    *sets(steps=2, ckpt_every=1))
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert sorted(committed(run)) == [1, 2]
    (aside,) = (run / store.CHECKPOINTS).glob("superseded-*")
    assert len(list(aside.iterdir())) == STEPS


def test_a_job_whose_run_was_taken_over_leaves_without_committing(tmp_path: Path) -> None:
    """Another job takes the run (its lease, owner.json) while this one trains: this one
    commits nothing more, writes no end record, is not restarted, and exits 0. Either its
    rank 0 finds it before a commit (the line below) or its launcher at a lease renewal."""
    run = tmp_path / "taken"
    proc = hpcshard_bg("submit", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=400, ckpt_every=1, keep_last=400))
    wait_for(lambda: 3 in committed(run), 180, "a few commits")
    owner = json.loads((run / "owner.json").read_text())
    taken = {**owner, "kind": "job", "job": "999", "process": None, "epoch": owner["epoch"] + 1,
             "what": "Slurm job 999"}
    (run / "owner.json.new").write_text(json.dumps(taken))
    changed = time.time()
    os.replace(run / "owner.json.new", run / "owner.json")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "left the run: Slurm job 999 owns it now" in out
    assert (f"this job no longer owns {run} (now: Slurm job 999); it stops without committing" in out
            or "leaves the run: the run was taken over by Slurm job 999" in out), out[-3000:]
    assert ledger.end_of(run, 0) is None
    after = [s for s, path in committed(run).items()
             if json.loads((path / store.MANIFEST).read_text())["time"] > changed]
    assert len(after) <= 1, after  # (one whose owner check came just before the change)
    assert json.loads((run / "owner.json").read_text())["job"] == "999"


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_refused_without_an_errno_stop_the_run_at_the_third_in_a_row(
        tmp_path: Path, async_save: bool) -> None:
    """One full Lustre OST, seen by 2 real ranks: from step 4 on, every shard write fails as
    torch.save's "unexpected pos" (no errno) and the write probe, which rank 0 alone writes
    while rank 1 waits for its word, is taken. Steps 4 and 6 are plain failures; step 8's
    is the third in a row: the run stops for its storage (exit 74, an end record that
    says so, one line naming the error and the directory once), neither restarted nor
    requeued, step 2 intact. An async save's failure is found when it is waited for: at
    the next step's boundary."""
    run, stop = tmp_path / "run", 9 if async_save else 8
    env = {"PYTHONPATH": f"{Path(__file__).parent / 'refused_saves'}:{ROOT}", "REFUSE_SAVES_FROM": "4"}
    proc = hpcshard("submit", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                    *sets(steps=12, ckpt_every=2, async_save=async_save), env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == STORAGE_EXIT, out[-3000:]
    root = run / store.CHECKPOINTS
    said = [line for line in out.splitlines() if f"stopped at step {stop} for the run's storage" in line]
    assert said and "the saves failed 3 times in a row, the last with RuntimeError: " in said[0], out[-3000:]
    assert (f"; a write probe beside them wrote fine, so the checkpoint directory {root} takes no checkpoint "
            "for a reason not known (a quota on one OST" in said[0]), said[0]
    assert said[0].count(str(root)) == 1 and "free space" not in said[0]
    assert f"step 2, is intact; find and fix the cause, then hpcshard resume {run}" in said[0]
    end = ledger.end_of(run, 0)
    assert end is not None and (end["reason"], end["step"], end["saved_step"]) == ("storage", stop, 2)
    events = [r["event"] for r in ledger.read(run)]
    assert "fault" not in events and "bad_node" not in events and events.count("start") == 1
    # (each in the ledger, for a restart or a requeue to count on: rank 0's, once)
    assert [(r["step"], r["since"], r["probe"]) for r in ledger.read(run) if r["event"] == "save_failed"] \
        == [(4, 2, "ok"), (6, 2, "ok"), (8, 2, "ok")]
    assert sorted(committed(run)) == [2] and not [p for p in root.iterdir() if p.name != store.LATEST
                                                   and p.name != store.step_name(2)]
