"""The demo job with a fault on request, for the supervision tests: its own code raises at a
chosen forward pass of a rank's process (`fail_at`), as a bug in a job would, or returns a
nan loss (`nan_at`). FAULTY_SLOW=N in the environment makes every save and evaluation N
times slower (and at least FAULTY_SLOW_MIN_S seconds, 3 by default): slow storage, a long
evaluation, which the watchdog must not take for a hang. `sleep_s` makes every forward
pass sleep that long: a step that waits, not computes (a test that trains for a span of
time, not for a number of steps, then costs the CPU of far fewer steps)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from hpcshard.runtime import Job
from hpcshard.runtime.checkpoint.manager import Checkpointer
from hpcshard.runtime.data import GlobalBatches
from hpcshard.runtime.job import lm_loss
from hpcshard.runtime.train import Trainer

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
    fail_with: str = "runtime"
    """What it raises: runtime (a RuntimeError), or json (json's JSONDecodeError: a
    ValueError that is the job's bug, not a bad value of the user's)."""
    nan_at: int = 0
    """Return a nan loss in this process's N-th forward pass (0: never)."""
    nan_batch: int = 0
    """Return a nan loss on the N-th global batch of the data (epoch 0): a bad batch, met
    again by any replay that does not skip it (0: never)."""
    spin_at: int = 0
    """Spin forever, busy, in this process's N-th forward pass of the first cycle (a hang
    that is not a stopped process: a livelock in the job's own code)."""
    sleep_s: float = 0.0
    """Sleep this long in every forward pass (0: never)."""


calls = 0
batch = (0, 0)
"""Where the global batch being trained on starts (epoch, offset)."""


def _next(self: GlobalBatches) -> list[tuple[torch.Tensor, ...]]:
    global batch
    batch = self.upcoming()
    return _batches_next(self)


_batches_next = GlobalBatches.next
GlobalBatches.next = _next  # type: ignore[method-assign]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    global calls
    calls += 1
    cfg: Config = model.cfg  # type: ignore[assignment]
    rank = int(os.environ.get("RANK", "0"))
    if cfg.fail_at and calls == cfg.fail_at and cfg.fail_rank in (-1, rank):
        if cfg.fail_with == "json":
            json.loads("{injected bug in the job's loss")
        raise RuntimeError(f"injected bug in the job's loss (forward pass {calls})")
    if (cfg.spin_at and calls == cfg.spin_at and cfg.fail_rank in (-1, rank)
            and os.environ.get("HPCSHARD_CYCLE") == "0"):
        while True:
            pass
    if cfg.sleep_s:
        time.sleep(cfg.sleep_s)
    value = lm_loss(model, x, y)
    if cfg.nan_at and calls == cfg.nan_at and cfg.fail_rank in (-1, rank):
        return value * float("nan")
    if cfg.nan_batch and batch == (0, (cfg.nan_batch - 1) * cfg.batch_size):
        return value * float("nan")
    return value


def model(cfg: Config) -> nn.Module:
    net = charlm.CharLM(cfg)
    net.cfg = cfg  # the loss reads fail_at and fail_rank from it
    return net


job = Job(config=Config, model=model, data=charlm.data, loss=loss, init=charlm.init,
          flops_per_token=charlm.flops_per_token)


def _slowed(what: str, method: Callable[..., object]) -> Callable[..., object]:
    factor, least = float(os.environ.get("FAULTY_SLOW", "0")), float(os.environ.get("FAULTY_SLOW_MIN_S", "3"))

    def slow(self: object, *args: object) -> object:
        start = time.perf_counter()
        out = method(self, *args)
        took = time.perf_counter() - start
        pause = max((factor - 1) * took, least - took)
        time.sleep(pause)
        print(f"faulty: {what} slowed from {took:.2f} s to {took + pause:.2f} s", flush=True)
        return out
    return slow


if os.environ.get("FAULTY_SLOW"):
    Checkpointer.save = _slowed("save", Checkpointer.save)  # type: ignore[method-assign,assignment]
    Trainer.evaluate = _slowed("eval", Trainer.evaluate)  # type: ignore[method-assign,assignment]
