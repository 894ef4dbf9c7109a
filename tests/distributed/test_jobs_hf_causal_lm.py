"""jobs/hf_causal_lm.py end to end: `hpcshard submit` on 2 local CPU ranks trains a
transformers Llama built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, hpcshard

pytest.importorskip("transformers")

LAYERS = 3


SETS = {"steps": 15, "log_every": 5, "warmup_steps": 5, "eval_every": 0, "layers": LAYERS,
        "batch_size": 8, "seq_len": 64,
        # The package's own sources: a small corpus, read faster than the stdlib's.
        "data": ROOT / "hpcshard", "pattern": "*.py"}


def train(run: Path, **extra: object) -> tuple[list[float], dict]:
    args = [arg for key, value in {**SETS, **extra}.items() for arg in ("--set", f"{key}={value}")]
    proc = hpcshard("submit", "--nodes", "1", "--gpus", "2", "jobs/hf_causal_lm.py",
                    "--run-dir", str(run), *args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r and "event" not in r]  # "end" repeats it
    return losses, next(r for r in recs if r.get("event") == "start")


@pytest.mark.dist
def test_hf_job_trains_on_two_ranks_and_with_tensor_parallelism(tmp_path: Path) -> None:
    """FSDP over 2 ranks, then the same Llama with tp=2 (transformers' own plan for its
    projections): the same losses, float reduction order apart."""
    losses, start = train(tmp_path / "hf")
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert start["blocks"] == LAYERS
    assert start["world"] == 2
    tp_losses, tp_start = train(tmp_path / "hf-tp", tp=2)
    assert tp_start["mesh"] == [1, 2]  # (shard 1, tp 2)
    assert tp_losses == pytest.approx(losses, rel=1e-4)
