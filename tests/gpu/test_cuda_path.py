"""The demo on one CUDA rank end to end: NCCL, the warm agent's forked ranks, mixed
precision, activation checkpointing, saves and a resume, torch.compile, CPU offload."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hpcshard, metrics


def _submit(run: Path, *settings: str, env: dict[str, str] | None = None) -> None:
    sets = [arg for s in settings for arg in ("--set", s)]
    out = hpcshard("submit", "--backend", "local", "--nodes", "1", "--gpus", "1", "jobs/charlm.py",
                   "--run-dir", str(run), "--max-restarts", "0", *sets, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + _log(run)


def _log(run: Path) -> str:
    log = run / "logs" / "rank-0.log"
    return log.read_text()[-3000:] if log.exists() else "(no rank log)"


@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm-forked", "plain-torchrun"])
def test_bf16_with_activation_checkpointing_saves_and_resumes_on_cuda(tmp_path: Path, warm: str) -> None:
    """The forked ranks of the warm agent: it must not touch CUDA before the fork (its
    LaunchConfig asked torch about CUDA, and every forked rank then died at its first CUDA
    call on an H100)."""
    run = tmp_path / "run"
    env = {"HPCSHARD_WARM_START": warm}
    _submit(run, "steps=30", "precision=bf16", "ac=full", "ckpt_every=15", "eval_every=15", "log_every=5",
            env=env)
    out = hpcshard("resume", str(run), "--set", "steps=40", timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:] + _log(run)
    steps = [m["step"] for m in metrics(run) if "loss" in m and "eval_loss" not in m]
    assert steps[-1] == 40 and "resumed from" in _log(run)


def test_fp16_with_torch_compile_and_its_grad_scaler_on_cuda(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _submit(run, "steps=30", "precision=fp16", "compile=true", "ckpt_every=15", "eval_every=15",
            "log_every=5")
    losses = [m["loss"] for m in metrics(run) if "loss" in m and "eval_loss" not in m]
    assert losses and all(loss == loss for loss in losses) and losses[-1] < losses[0]


def test_async_saves_from_gpu_memory(tmp_path: Path) -> None:
    """Three async saves (DCP's DefaultStager reused: torch 2.11 and 2.12 fail the second,
    pytorch#183413, and the package excludes them)."""
    run = tmp_path / "run"
    _submit(run, "steps=30", "precision=bf16", "async_save=true", "ckpt_every=10", "eval_every=0",
            "log_every=5")
    assert "checkpoint step 30 committed" in _log(run)


def test_cpu_offload_keeps_parameters_in_pinned_host_memory_and_trains(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _submit(run, "steps=20", "precision=bf16", "cpu_offload=true", "ckpt_every=10", "eval_every=10",
            "log_every=5")
    losses = [m["loss"] for m in metrics(run) if "loss" in m and "eval_loss" not in m]
    assert losses and losses[-1] < losses[0]
