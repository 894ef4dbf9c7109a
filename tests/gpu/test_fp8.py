"""float8=true on one CUDA rank: the demo's blocks train in float8 (torchao's Float8Linear
and `torch._scaled_mm`) about as bf16 does. Skips, with the reason, on a GPU without float8
(compute capability below 8.9) or without torchao (the fp8 extra). One rank means one rank
per shard group: the float8 all-gathers are off here (the emulated CPU runs of
tests/unit/test_runtime_float8.py and two-GPU runs are where they are exercised)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, hpcshard, metrics

# Asked in a subprocess: CUDA initialised in pytest's own process poisons a later fork of it.
ASK = ("import torch; from hpcshard.runtime.float8 import refusal; "
       "print(refusal(torch.device('cuda', 0)))")


@pytest.fixture(scope="module")
def has_float8() -> None:
    why = subprocess.run([sys.executable, "-c", ASK], cwd=ROOT, capture_output=True, text=True,
                         timeout=120).stdout.strip()
    if why:
        pytest.skip(why)


def _train(run: Path, *settings: str) -> list[float]:
    sets = [arg for s in ("steps=30", "precision=bf16", "eval_every=0", "log_every=5", *settings)
            for arg in ("--set", s)]
    out = hpcshard("submit", "--backend", "local", "--nodes", "1", "--gpus", "1", "jobs/charlm.py",
                   "--run-dir", str(run), "--max-restarts", "0", *sets, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + _log(run)
    return [m["loss"] for m in metrics(run) if "loss" in m and "eval_loss" not in m]


def _log(run: Path) -> str:
    log = run / "logs" / "rank-0.log"
    return log.read_text() if log.exists() else "(no rank log)"


def test_float8_trains_the_demo_about_as_bf16_does(tmp_path: Path, has_float8: None) -> None:
    fp8 = _train(tmp_path / "fp8", "float8=true")
    bf16 = _train(tmp_path / "bf16")
    # 4 blocks x (q, k, v, proj, fc, out); the head (outside the blocks) stays bf16
    assert "float8: 24 Linear layers converted to Float8Linear" in _log(tmp_path / "fp8")
    assert "Float8Linear" not in _log(tmp_path / "bf16")
    assert all(math.isfinite(loss) for loss in fp8) and fp8[-1] < fp8[0] - 0.5, fp8
    assert abs(fp8[-1] - bf16[-1]) < 0.1 * bf16[-1], (fp8, bf16)


def test_float8_with_torch_compile_and_selective_ac(tmp_path: Path, has_float8: None) -> None:
    """torchtitan's float8 runs compiled (inductor fuses the casts); selective AC keeps the
    `_scaled_mm` outputs."""
    losses = _train(tmp_path / "run", "float8=true", "compile=true", "ac=selective")
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.5, losses
