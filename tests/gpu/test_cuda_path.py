"""The demo on one CUDA rank end to end through `hpcshard submit`: NCCL, the warm agent's
forked ranks, bf16 with activation checkpointing, saves and a resume, fp16's grad scaler
under torch.compile with Triton kernels, async saves from GPU memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hpcshard, step_records
from tests.gpu.runs import losses, rank_log, submit


@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm-forked", "plain-torchrun"])
def test_bf16_with_activation_checkpointing_saves_and_resumes_on_cuda(tmp_path: Path, warm: str) -> None:
    """The forked ranks of the warm agent: it must not touch CUDA before the fork (its
    LaunchConfig asked torch about CUDA, and every forked rank then died at its first CUDA
    call on an H100)."""
    run = tmp_path / "run"
    env = {"HPCSHARD_WARM_START": warm}
    submit(run, "steps=30", "precision=bf16", "ac=full", "ckpt_every=15", "eval_every=15", "log_every=5",
           env=env)
    out = hpcshard("resume", str(run), "--set", "steps=40", timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:] + rank_log(run)
    steps = [m["step"] for m in step_records(run)]
    assert steps[-1] == 40 and "resumed from" in rank_log(run)


@pytest.mark.timeout(300)
def test_fp16_with_torch_compile_runs_triton_kernels_and_its_grad_scaler(tmp_path: Path) -> None:
    """Inductor's cache in a folder of the test's own (nothing reused from another run):
    the generated code holds `@triton.jit` kernels and Triton's cache their compiled
    CUDA binaries, so compile really went through Triton on the GPU."""
    run, cache = tmp_path / "run", tmp_path / "inductor"
    submit(run, "steps=30", "precision=fp16", "compile=true", "ckpt_every=15", "eval_every=15",
           "log_every=5",
           env={"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")})
    loss = losses(run)
    assert loss and all(x == x for x in loss) and loss[-1] < loss[0], loss
    kernels = [p for p in cache.rglob("*.py") if "@triton.jit" in p.read_text(errors="replace")]
    binaries = list((cache / "triton").rglob("*.cubin"))
    listing = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))[:40]
    assert kernels, f"no generated Triton kernel under {cache}: {listing}"
    assert binaries, f"no compiled Triton binary (.cubin) under {cache / 'triton'}: {listing}"


@pytest.mark.timeout(240)
def test_one_async_save_from_gpu_memory_commits(tmp_path: Path) -> None:
    """One async save (the end's: async_save makes every save async): the state copied
    out of GPU memory by DCP's stager thread."""
    run = tmp_path / "run"
    submit(run, "steps=12", "precision=bf16", "async_save=true", "ckpt_every=1000", "eval_every=0",
           "log_every=4")
    assert "checkpoint step 12 committed" in rank_log(run)


@pytest.mark.timeout(240)
def test_async_saves_from_gpu_memory(tmp_path: Path) -> None:
    """Three async saves in one run (DCP's stager reused: torch 2.11 and 2.12 close its
    copier after the first save, pytorch#183413, which `checkpoint.io.HandOffStager`
    does not do)."""
    run = tmp_path / "run"
    submit(run, "steps=30", "precision=bf16", "async_save=true", "ckpt_every=10", "eval_every=0",
           "log_every=5")
    assert all(f"checkpoint step {s} committed" in rank_log(run) for s in (10, 20, 30)), rank_log(run)
