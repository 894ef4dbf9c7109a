"""The trainer on one rank, in this process: the masked loss over a step's learnt tokens,
packed records' position ids handed to the loss, a job's own optimizer and schedule
(and their bitwise resume), and selective activation checkpointing against none and full."""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hpcshard.config import build_config
from hpcshard.errors import UserError
from hpcshard.runtime.data import DataSplits, bytes_splits, text_files
from hpcshard.runtime.device import DistEnv
from hpcshard.runtime.job import Job, lm_loss, load_job
from hpcshard.runtime.sft import IGNORE
from hpcshard.runtime.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
JOB = load_job(str(ROOT / "jobs" / "charlm.py"))
DATA = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
BASE = {"dim": "16", "n_heads": "2", "n_layers": "2", "seq_len": "16", "batch_size": "4", "steps": "4",
        "warmup_steps": "1", "log_every": "1", "eval_every": "0", "grad_clip": "0", "data": DATA}
ENV = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")


def trainer(job: Job = JOB, run_dir: Path | None = None, **sets: str) -> Trainer:
    return Trainer(job, build_config(job.config, {**BASE, **sets}), ENV, run_dir)


def full(t: Trainer, grads: bool = False) -> list[torch.Tensor]:
    out = []
    for p in t.params:
        v = p.grad if grads else p
        assert v is not None
        out.append(v.full_tensor() if isinstance(v, DTensor) else v.detach().clone())
    return out


def masked_data(cfg: Any) -> DataSplits:
    """The stdlib's json sources as bytes, every token's target masked unevenly: long
    unlearnt stretches (prompts) beside learnt ones, whole windows without one, and
    records starting every 37 tokens."""
    plain = bytes_splits(text_files(DATA))

    def targets(tokens: np.ndarray) -> np.ndarray:
        out = tokens.astype(np.int64)
        k = np.arange(len(out))
        out[(k % 97 < 60) | ((k // 16) % 5 == 1)] = IGNORE
        return out

    def starts(tokens: np.ndarray) -> np.ndarray:
        return np.arange(len(tokens)) % 37 == 0

    held = np.asarray(plain.eval)  # bytes: an array already
    return dataclasses.replace(plain, train_targets=targets(plain.train), eval_targets=targets(held),
                               train_starts=starts(plain.train), eval_starts=starts(held))


def test_a_masked_step_is_the_mean_over_its_learnt_tokens(world_of_one: None) -> None:
    """Four micro-batches of one sequence each, masked unevenly, train as one batch of four
    does: the same loss and gradients (the mean over every learnt token of the step), not
    the mean of four means."""
    job = dataclasses.replace(JOB, data=masked_data)
    accumulated, whole = trainer(job, micro_batch_size="1"), trainer(job)
    assert accumulated.accum == 4 and whole.accum == 1 and accumulated.masked
    for _ in range(2):  # the second step starts from the first's (equal) parameters
        batches = accumulated.batches.next()
        whole.batches.next()
        counts = [int((y != IGNORE).sum()) for _, y, *_ in batches]
        assert len(set(counts)) > 1  # uneven: a mean of means would differ
        loss_a = accumulated.forward_backward(batches)
        loss_w = whole.forward_backward([tuple(torch.cat(parts) for parts in zip(*batches, strict=True))])
        assert loss_a.item() == pytest.approx(loss_w.item(), rel=1e-6)
        for a, w in zip(full(accumulated, grads=True), full(whole, grads=True), strict=True):
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
        for t in (accumulated, whole):
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=True)


def test_unmasked_data_keeps_one_over_accumulation(world_of_one: None) -> None:
    """Pretraining data (no targets): no count, no all-reduce, the old 1/accum arithmetic."""
    t = trainer(micro_batch_size="2")
    assert not t.masked
    assert t._learnt(t.batches.next()) == ([], None)


def test_packed_records_position_ids_reach_a_loss_that_takes_them(world_of_one: None) -> None:
    seen: list[torch.Tensor | None] = []

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(positions)
        return lm_loss(model, x, y)

    t = trainer(dataclasses.replace(JOB, data=masked_data, loss=loss), micro_batch_size="2")
    x, _, pos = t.batches.next()[0]
    t.train_step()
    assert len(seen) == 2 and all(p is not None and p.shape == x.shape for p in seen)
    assert pos.max() < 37 and (pos == 0).any()


def sgd(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def halving(cfg: Any, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1, 3], gamma=0.5)


def test_a_jobs_own_optimizer_and_schedule_train_and_resume_bitwise(world_of_one: None,
                                                                   tmp_path: Path) -> None:
    job = dataclasses.replace(JOB, optimizer=sgd, schedule=halving)
    straight = trainer(job, tmp_path)
    assert isinstance(straight.optimizer, torch.optim.SGD)
    assert isinstance(straight.scheduler, torch.optim.lr_scheduler.MultiStepLR)
    for _ in range(2):
        straight.train_step()
    assert straight.ckpt is not None and straight.ckpt.save(2, "periodic")
    straight.ckpt.wait()
    after = [(straight.train_step()[0].item(), straight.scheduler.get_last_lr()[0]) for _ in range(2)]
    assert [lr for _, lr in after] == [0.0125, 0.0125]  # halved at steps 1 and 3

    resumed = trainer(job, tmp_path)
    loaded = resumed.restore("2")
    assert loaded is not None and resumed.step == 2
    assert resumed.scheduler.get_last_lr()[0] == 0.025  # the schedule's state came back
    again = [(resumed.train_step()[0].item(), resumed.scheduler.get_last_lr()[0]) for _ in range(2)]
    assert again == after  # bit for bit: momentum buffers and schedule resumed
    for a, b in zip(full(straight), full(resumed), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hook,message", [
    ("optimizer", "the job's optimizer hook returned list, not a torch.optim.Optimizer"),
    ("schedule", "the job's schedule hook returned float, not a torch.optim.lr_scheduler.LRScheduler"),
])
def test_a_hook_that_returns_the_wrong_thing_is_one_line(world_of_one: None, hook: str, message: str) -> None:
    job = (dataclasses.replace(JOB, optimizer=lambda cfg, model: []) if hook == "optimizer"  # type: ignore[arg-type, return-value]
           else dataclasses.replace(JOB, schedule=lambda cfg, optimizer: 0.5))  # type: ignore[arg-type, return-value]
    with pytest.raises(UserError, match=message):
        trainer(job)


def test_an_optimizer_hook_on_other_or_too_few_parameters_is_one_line(world_of_one: None) -> None:
    """A hook must step the sharded model it is given, every trainable parameter of it: one
    built on a fresh model would train nothing, one leaving a parameter out would never
    train it (and pile up its gradient)."""
    fresh = dataclasses.replace(JOB, optimizer=lambda cfg, model: torch.optim.SGD(
        JOB.model(cfg).parameters(), lr=0.1))
    with pytest.raises(UserError, match="not the model's parameters; build it on the `model` it is given"):
        trainer(fresh)
    matrices = dataclasses.replace(JOB, optimizer=lambda cfg, model: torch.optim.SGD(
        [p for p in model.parameters() if p.ndim >= 2], lr=0.1))
    with pytest.raises(UserError, match="leaves .* trainable parameter.* out .*freeze them"):
        trainer(matrices)


def test_wsd_through_the_trainer(world_of_one: None) -> None:
    t = trainer(schedule="wsd", steps="10", warmup_steps="2", decay_fraction="0.5", min_lr_ratio="0",
                decay_shape="linear", lr="0.01")
    assert isinstance(t.scheduler, torch.optim.lr_scheduler.LambdaLR)
    lrs = [0.01 * t.scheduler.lr_lambdas[0](s) for s in range(10)]
    assert lrs == pytest.approx([0.005, 0.01, 0.01, 0.01, 0.01, 0.01, 0.008, 0.006, 0.004, 0.002])
    assert t.optimizer.defaults["foreach"] and not t.optimizer.defaults["fused"]  # CPU: foreach


def test_selective_ac_trains_bitwise_as_no_ac_and_full_ac(world_of_one: None) -> None:
    """ac=selective: every block wrapped, op-level (its policy asked about the block's ops,
    matmuls kept); the same losses, gradients and parameters as no AC and full AC, bit for bit."""
    from hpcshard.runtime import shard

    asked: list[Any] = []
    policy = shard._save_matmuls

    def spy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(func)
        return policy(ctx, func, *args, **kwargs)

    runs: dict[str, Any] = {}
    for ac in ("none", "full", "selective"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(shard, "_save_matmuls", spy)
            t = trainer(ac=ac)
            losses = [t.train_step()[0].item() for _ in range(2)]
            batches = t.batches.next()
            t.forward_backward(batches)
        runs[ac] = (losses, full(t, grads=True), full(t), [type(b).__name__ for b in t.blocks])
    assert runs["selective"][3] == ["FSDPCheckpointWrapper"] * 2
    assert torch.ops.aten.addmm.default in asked and torch.ops.aten.gelu.default in asked
    for ac in ("full", "selective"):
        assert runs[ac][0] == runs["none"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[ac][1], runs["none"][1], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(runs[ac][2], runs["none"][2], strict=True))
