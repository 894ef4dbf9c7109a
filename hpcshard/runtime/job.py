"""The job API: a Python file (or module) that says how to build the model, the data and
the loss from a typed config. The runtime does everything else.

    from dataclasses import dataclass
    from hpcshard.config import TrainConfig
    from hpcshard.runtime import Job

    @dataclass(kw_only=True)
    class Config(TrainConfig):
        dim: int = 256

    job = Job(config=Config, model=build_model, data=build_data)
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.runtime.blocks import InitFn, reset_init
from hpcshard.runtime.data import DataSplits


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; logits are upcast so low-precision runs reduce in fp32."""
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def param_flops_per_token(cfg: Any, model: nn.Module) -> float:
    """6 FLOPs per parameter per token (forward + backward), the usual MFU convention."""
    return 6.0 * sum(p.numel() for p in model.parameters())


@dataclass(frozen=True, kw_only=True)
class Job:
    """What a job file defines as `job = Job(...)`."""

    config: type[TrainConfig]
    """The job's config dataclass (a TrainConfig subclass): its fields are the --set keys."""
    model: Callable[[Any], nn.Module]
    """Builds the model from the config. Called on the meta device: allocate nothing real."""
    data: Callable[[Any], DataSplits]
    """Returns the train and held-out token streams."""
    loss: Callable[..., torch.Tensor] = lm_loss
    """loss(model, inputs, targets) -> scalar: the mean over the learnt positions (targets
    not IGNORE). Where there is none it must stay finite with a finite gradient: divide by
    `count.clamp(min=1)` (`(ce * mask).sum() / mask.sum()` gives 0/0 and nan gradients,
    which the runtime takes for a non-finite step). The runtime weighs micro-batches by their
    learnt tokens, so a masked step's loss is the mean over all its learnt tokens. A loss
    with a `positions` keyword also gets the position ids of packed fine-tuning records
    (restarting at each record), to pass to a model that masks attention by them."""
    init: InitFn = reset_init
    """init(root, name, module) initialises one module's own parameters and buffers in
    place. Called once per module, on full-size tensors, under a seed of its name."""
    flops_per_token: Callable[[Any, nn.Module], float] = param_flops_per_token
    """Training FLOPs per token for MFU, given the config and the (meta) model."""
    shard: Callable[[Any, nn.Module, Any, Any], list[nn.Module]] | None = None
    """shard(cfg, model, mesh, plan) -> the sharded blocks: full control of FSDP2, called
    on the (meta) model instead of hpcshard's wrapping (`runtime.shard.shard_model`, which
    it may call itself). `mesh`: the data parallel mesh; `plan`: the run's ShardPlan
    (precision, reshard, offload, prefetch as configured)."""
    tp_plan: Callable[[Any, nn.Module], dict[str, Any]] | None = None
    """tp_plan(cfg, model) -> {module name pattern: ParallelStyle}: how `--set tp=K` splits
    the (meta) model over a node's tensor parallel group, as torch's `parallelize_module`
    takes it (fnmatch patterns such as `blocks.*.attn.q`; ColwiseParallel, RowwiseParallel,
    SequenceParallel, PrepareModuleInput). Every parameter must end up a DTensor of the
    tp mesh (norms under SequenceParallel, embeddings under RowwiseParallel). None: the
    job cannot run with tp > 1."""
    optimizer: Callable[[Any, nn.Module], torch.optim.Optimizer] | None = None
    """optimizer(cfg, model) -> the job's own optimizer, built on the sharded, materialised
    model's parameters (DTensors; leave out those that do not require grad, the frozen
    ones). None: AdamW from the optimizer section. Saved and resumed like AdamW's."""
    schedule: Callable[[Any, torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None
    """schedule(cfg, optimizer) -> the job's own learning-rate scheduler, stepped once per
    optimizer step; its state_dict is saved and resumed. None: `schedule` of the
    optimizer section (cosine, wsd or constant)."""


def takes_positions(loss: Callable[..., torch.Tensor]) -> bool:
    """Whether a job's loss accepts packed records' position ids (a `positions` keyword)."""
    try:
        return "positions" in inspect.signature(loss).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def require_tp_plan(job: Job, tp: int, ref: str) -> None:
    """tp > 1 needs the job's plan; one line otherwise (preflight, planner, ranks)."""
    if tp > 1 and job.tp_plan is None:
        raise UserError(f"tp={tp}: job {ref} has no tp_plan (how to split its model); add one "
                        "to its Job (see docs/user/sharding.md) or use tp=1")


def _import_file(path: Path) -> Any:
    name = f"hpcshard_job_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look classes up by module name
    spec.loader.exec_module(module)
    return module


def load_job(ref: str) -> Job:
    """A job from a file path (`jobs/charlm.py`) or a module name (`mypkg.jobs.lm`)."""
    path = Path(ref)
    if ref.endswith(".py") or path.exists():
        if not path.is_file():
            raise UserError(f"job file {ref!r} does not exist; give a .py file or a module name")
        module = _import_file(path.resolve())
    else:
        try:
            module = importlib.import_module(ref)
        except ModuleNotFoundError as err:
            raise UserError(f"job {ref!r} is neither a file nor an importable module ({err})") from None
    job = getattr(module, "job", None)
    if not isinstance(job, Job):
        found = [k for k, v in vars(module).items() if isinstance(v, Job)]
        if len(found) != 1:
            raise UserError(f"{ref!r} defines no job; it needs a module-level "
                            "`job = hpcshard.runtime.Job(config=..., model=..., data=...)`")
        job = getattr(module, found[0])
    return job
