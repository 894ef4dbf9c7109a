"""The demo job with a fault on request, for the supervision tests: its own code raises at a
chosen forward pass of a rank's process (`fail_at`), as a bug in a job would."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from hpcshard.runtime import Job
from hpcshard.runtime.job import lm_loss

_spec = importlib.util.spec_from_file_location("faulty_charlm",
                                               Path(__file__).parents[2] / "jobs" / "charlm.py")
assert _spec is not None and _spec.loader is not None
charlm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = charlm  # dataclasses look their module up there
_spec.loader.exec_module(charlm)


@dataclass(kw_only=True)
class Config(charlm.Config):  # type: ignore[name-defined,misc]
    fail_at: int = 0
    """Raise in this process's N-th forward pass (0: never)."""
    fail_rank: int = -1
    """Only this global rank raises (-1: every rank)."""
    nan_at: int = 0
    """Return a nan loss in this process's N-th forward pass (0: never)."""


calls = 0


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    global calls
    calls += 1
    cfg: Config = model.cfg  # type: ignore[assignment]
    rank = int(os.environ.get("RANK", "0"))
    if cfg.fail_at and calls == cfg.fail_at and cfg.fail_rank in (-1, rank):
        raise RuntimeError(f"injected bug in the job's loss (forward pass {calls})")
    value = lm_loss(model, x, y)
    if cfg.nan_at and calls == cfg.nan_at and cfg.fail_rank in (-1, rank):
        return value * float("nan")
    return value


def model(cfg: Config) -> nn.Module:
    net = charlm.CharLM(cfg)
    net.cfg = cfg  # the loss reads fail_at and fail_rank from it
    return net


job = Job(config=Config, model=model, data=charlm.data, loss=loss, init=charlm.init,
          flops_per_token=charlm.flops_per_token)
