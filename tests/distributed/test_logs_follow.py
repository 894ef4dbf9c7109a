"""`hpcshard logs RUN -f` follows the run, not one attempt: a 2x1 run on the local backend
preempted once (requeued here as attempt 1) shows both attempts' lines of both ranks in
one stream, each attempt under its header, and the command ends when the run does."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from hpcshard.rundir import ledger
from tests.conftest import NOT_ABOUT_HANGS, hpcshard, hpcshard_bg, sets, step_records, wait_for


def trained_to(run: Path, step: int) -> bool:
    return any(r["step"] >= step for r in step_records(run))


def test_logs_follow_shows_two_attempts_in_one_stream(tmp_path: Path) -> None:
    run = tmp_path / "followed"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=12, ckpt_every=4, log_every=1, **NOT_ABOUT_HANGS))
    follow = None
    try:
        wait_for(lambda: (run / "logs" / "rank-1.log").exists(), 180, "the ranks to log")
        follow = hpcshard_bg("logs", str(run), "-f")
        wait_for(partial(trained_to, run, 3), 180, "step 3")
        assert hpcshard("preempt", str(run)).returncode == 0
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "requeued as attempt 1" in out, out[-4000:]
        shown, _ = follow.communicate(timeout=60)  # it ends by itself once the run has
    finally:
        for p in (proc, follow):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert follow.returncode == 0, shown[-4000:]
    stop = ledger.end_of(run, 0)
    assert stop is not None and stop["reason"] == "stop"
    lines = shown.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("==> attempt ")]
    assert [lines[i].split(":")[0] for i in heads] == ["==> attempt 0 (restart 0)",
                                                      "==> attempt 1 (restart 0)"], heads
    for head in heads:  # both ranks started in each (rank 1 says little more: its start line)
        assert "2 nodes on " in lines[head] and "ranks 0,1" in lines[head], lines[head]
    before, after = lines[heads[0] + 1:heads[1]], lines[heads[1] + 1:]
    assert any("[rank 0]" in line and "step 3/12" in line for line in before)
    assert any("[rank 0] INFO resumed from" in line for line in after)
    assert any("[rank 1] INFO resumed from" in line for line in after)
    # the stream holds what the logs hold: the same lines as reading them afterwards
    whole = hpcshard("logs", str(run))
    assert whole.returncode == 0
    assert sorted(whole.stdout.splitlines()) == sorted(lines)
