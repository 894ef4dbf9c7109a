"""The optimizer and the learning-rate schedule: hpcshard's AdamW and built-in schedules
(cosine, warmup-stable-decay, constant), or the job's own through its `optimizer` and
`schedule` hooks. Either way the checkpointer saves and resumes their state."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LRScheduler

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.runtime.job import Job
from hpcshard.sections import OptimizerSection


def build_optimizer(model: nn.Module, cfg: OptimizerSection, fused: bool = False) -> torch.optim.AdamW:
    """AdamW with decay on matrices only: biases and norm gains are not regularised.
    `fused`: one fused kernel (`device.fused_optimizer` decides), else foreach."""
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen: no state at all
    decay = [p for p in trainable if p.ndim >= 2]
    rest = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kind)


def lr_factor(step: int, cfg: OptimizerSection) -> float:
    """The learning rate at `step` as a fraction of the peak: linear warmup to 1, then
    cfg.schedule's shape (`decay_factor`) down to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        # Warmup-stable-decay (Hu et al. 2024, MiniCPM, arXiv:2404.06395): at the peak, then
        # decay over the last decay_fraction of the steps (never into the warmup).
        start = max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, cfg.steps - start))
        return decay_factor(progress, cfg.decay_shape, cfg.min_lr_ratio)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def decay_factor(progress: float, shape: str, floor: float) -> float:
    """A wsd decay's factor at `progress` (0 to 1) of it, from 1 down to `floor`: linear, or
    1-sqrt, which Hägele et al. 2024 (arXiv:2405.18392) found to match a cosine schedule."""
    drop = math.sqrt(progress) if shape == "1-sqrt" else progress
    return floor + (1 - floor) * (1 - drop)


def build_schedule(optimizer: torch.optim.Optimizer, cfg: OptimizerSection) -> LRScheduler:
    """The built-in schedule (`lr_factor`), stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


def job_optimizer(job: Job, cfg: TrainConfig, model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    """The job's own optimizer (its `optimizer` hook), else hpcshard's AdamW."""
    if job.optimizer is None:
        return build_optimizer(model, OptimizerSection.of(cfg), fused=fused)
    made = job.optimizer(cfg, model)
    if not isinstance(made, torch.optim.Optimizer):
        raise UserError(f"the job's optimizer hook returned {type(made).__name__}, not a "
                        "torch.optim.Optimizer; return one built on the model's parameters")
    check_params(made, model)
    return made


def check_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """A hook's optimizer steps the sharded model's own trainable parameters, all of them:
    one built on another model (a fresh `job.model(cfg)`) would never change the one that
    trains, and a trainable parameter left out would never learn (freeze it instead)."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    if strangers := owned - set(names):
        raise UserError(f"the job's optimizer hook holds {len(strangers)} tensor(s) that are not the "
                        "model's parameters; build it on the `model` it is given (sharded), e.g. "
                        "torch.optim.AdamW(model.parameters())")
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
    if left:
        raise UserError(f"the job's optimizer hook leaves {len(left)} trainable parameter(s) out "
                        f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): they would never "
                        "learn; give them to the optimizer, or freeze them (--set freeze=...)")


def job_schedule(job: Job, cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The job's own learning-rate schedule (its `schedule` hook), else the built-in one."""
    if job.schedule is None:
        return build_schedule(optimizer, OptimizerSection.of(cfg))
    made = job.schedule(cfg, optimizer)
    if not isinstance(made, LRScheduler):
        raise UserError(f"the job's schedule hook returned {type(made).__name__}, not a "
                        "torch.optim.lr_scheduler.LRScheduler; return one built on the optimizer")
    return made
