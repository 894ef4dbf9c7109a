"""Where a step's time goes, and MFU, on the demo at 2x1 on the local backend (one run):
every record splits its step time into parts that add up to it, saves show as the
checkpoint part, and mfu is tokens/s times the hand-counted FLOPs per token over the
peak of every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from tests.conftest import hpcshard, sets, step_records
from tests.unit.test_runtime_mfu import hand_flops

pytestmark = pytest.mark.dist

PEAK = 0.01
"""TFLOP/s per rank, as if: a CPU has no known peak."""


def test_records_split_the_step_time_and_mfu_is_the_hand_count(tmp_path: Path) -> None:
    run = tmp_path / "timed"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                    *sets(steps=20, log_every=5, ckpt_every=5, eval_every=10, micro_batch_size=6,
                          peak_tflops=PEAK))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    records = step_records(run)
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    flops = hand_flops(dim=128, layers=4, seq_len=128, vocab=256)  # the demo's defaults
    for r in records:
        split = r["split_s"]
        assert list(split) == ["data", "forward", "backward", "optimizer", "checkpoint", "comm", "other"]
        named = sum(v for k, v in split.items() if k != "other")
        assert abs(named - r["step_s"]) <= 0.05 * r["step_s"], r
        assert min(split.values()) >= 0 and split["forward"] > 0 and split["backward"] > 0
        assert r["tokens_per_s"] == pytest.approx(24 * 128 / r["step_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (PEAK * 1e12 * 2), rel=1e-9)
    # The save after step 5's record (and 10's, 15's) is in the next record: its save_s, and
    # its checkpoint part, which holds it (and may hold a little more: the agreement to save).
    assert "save_s" not in records[0]
    for r in records[1:]:
        assert 5 * r["split_s"]["checkpoint"] >= r["save_s"] - 2e-4 > 0, r
    out = CliRunner().invoke(main, ["status", str(run)])
    assert out.exit_code == 0, out.output
    assert "step time " in out.output and ", MFU " in out.output
