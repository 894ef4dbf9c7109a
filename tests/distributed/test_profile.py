"""`hpcshard profile` on a live run of the demo on 2 nodes x 1 rank, and profiles on a
schedule: traces per chosen rank that parse as Chrome/Perfetto traces, while the run trains
on and ends bitwise equal to an unprofiled one. (2 x 1: one rank on each node is chosen
and the other is not, by the schedule and by the ask; 2 x 2 would start two more ranks and
write more traces, about 25 CPU-s.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard.rundir import profiles
from hpcshard.rundir.launchers import launchers
from tests.conftest import ROOT, STEPS, hpcshard, hpcshard_bg, metrics, sets, wait_for
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load

pytestmark = pytest.mark.dist


def assert_trace(path: Path) -> None:
    """The Trace Event Format Perfetto and chrome://tracing read (and TensorBoard's profiler
    plugin): a traceEvents list whose complete events have a name, a phase, times and ids;
    here with the aten ops of a training step in it."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    assert complete, path
    for e in complete:
        assert isinstance(e["name"], str) and isinstance(e["ts"], int | float) and e["dur"] >= 0
        assert "pid" in e and "tid" in e
    names = {e["name"] for e in complete}
    assert {"aten::mm", "aten::addmm"} & names, sorted(names)[:40]


def test_a_live_run_is_profiled_on_the_chosen_ranks_and_ends_bitwise_equal(uninterrupted_2x1: Path,
                                                                          tmp_path: Path) -> None:
    run = tmp_path / "profiled"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=STEPS, ckpt_every=1, keep_last=1000, eval_every=STEPS,
                             profile_every=6, profile_steps=2, profile_ranks="0"))
    wait_for(lambda: launchers(run), 120, "the run's launchers")
    asked = hpcshard("profile", str(run), "--steps", "2", "--ranks", "1", "--timeout", "240")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert asked.returncode == 0, asked.stdout + asked.stderr
    taken = profiles.taken(run, 1)
    assert taken is not None and taken["ranks"] == [1]
    window = profiles.window_dir(run, taken["step"])
    for rank in (1,):
        assert f"rank {rank} trace: {profiles.trace_path(window, rank)}\n" in asked.stdout
        assert_trace(profiles.trace_path(window, rank))
    assert not profiles.trace_path(window, 0).exists()
    # the schedule: after steps 6 and 12, two steps each, on rank 0 (node 0's; the ask's
    # window, on node 1's rank, if it met one of these, queued behind it)
    scheduled = [w for w in profiles.windows(run) if w != window]
    assert len(scheduled) == 2, profiles.windows(run)
    for w in scheduled:
        assert sorted(p.name for p in w.glob("*.pt.trace.json")) == ["rank-0.pt.trace.json"]
        assert_trace(profiles.trace_path(w, 0))
    events = [r for r in metrics(run) if r.get("event") == "profile"]
    assert [e["rank"] for e in events] == [0, 0] and all(not e["partial"] for e in events)
    status = hpcshard("status", str(run))
    assert "profiles (3)" in status.stdout, status.stdout
    # the profiled run trained the same numbers
    assert_bitwise_equal(load(committed(uninterrupted_2x1)[STEPS]), load(committed(run)[STEPS]))


def test_a_slow_trace_is_not_a_hung_rank_nor_the_others_communication(tmp_path: Path) -> None:
    """Writing rank 1's trace takes 12 s (far over the steps' learned limit, whose floor is
    5 s): every rank reports the profile phase, which the watchdog judges as it does a
    save, so no rank is declared hung; rank 0's wait for the writer is neither training nor
    communication in its step split."""
    run = tmp_path / "slow"
    env = {"PYTHONPATH": f"{Path(__file__).parent / 'slow_export'}:{ROOT}", "SLOW_EXPORT_S": "12"}
    out = hpcshard("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                   "--max-restarts", "0", *sets(steps=12, ckpt_every=100, profile_every=6, profile_steps=1,
                                                profile_ranks="1"), env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "fault" not in out.stdout + out.stderr
    assert profiles.done(profiles.window_dir(run, 7), 1) is not None
    at = {r["step"]: r for r in metrics(run) if "split_s" in r}
    assert at[7]["split_s"]["comm"] < 2 and at[7]["step_s"] < 6, at[7]  # (not the writer's 12 s)
