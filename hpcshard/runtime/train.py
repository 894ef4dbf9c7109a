"""The training loop every rank runs: mesh -> shard -> materialise -> train -> metrics."""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.rundir import events, store
from hpcshard.rundir.proc import clock
from hpcshard.rundir.rankenv import NOTICE_SLACK_S, RankEnv, limit_end
from hpcshard.runtime import float8
from hpcshard.runtime.adapters import apply_freeze, apply_lora, frozen, with_adapters
from hpcshard.runtime.blocks import find_blocks, on_meta
from hpcshard.runtime.checkpoint import Checkpointer, Loaded, TrainParts, seed_rank
from hpcshard.runtime.data import (
    GlobalBatches,
    Micro,
    data_changes,
    data_fingerprint,
    data_fingerprint_v1,
    eval_batch_count,
    eval_batches,
    unigram_entropy,
)
from hpcshard.runtime.device import DistEnv, device_peak_tflops, fused_optimizer
from hpcshard.runtime.job import Job, require_tp_plan, takes_positions
from hpcshard.runtime.mesh import build_mesh, dp_mesh, tp_mesh
from hpcshard.runtime.metrics import Metrics
from hpcshard.runtime.optim import build_optimizer, job_optimizer, job_schedule, lr_factor
from hpcshard.runtime.pretrained import Stored, aliases, load_pretrained, match, read_dir
from hpcshard.runtime.profile import Profiler
from hpcshard.runtime.sft import IGNORE
from hpcshard.runtime.shard import ShardPlan, apply_tp, materialize, shard_model, state_bytes
from hpcshard.runtime.stop import StopRequest
from hpcshard.runtime.straggler import Stragglers, crowded, gather, probe
from hpcshard.runtime.timing import StepClock
from hpcshard.runtime.trackers import Trackers
from hpcshard.sections import (
    DataSection,
    ModelSection,
    Parallel,
    ParallelSection,
    ProfileSection,
    SupervisionSection,
)

log = logging.getLogger("hpcshard")

__all__ = ["Hooks", "Past", "Summary", "Trainer", "build_model", "build_optimizer", "clip_grad_norm_",
           "lr_factor", "stop_time"]


def all_reduce_at(mode: str, micro: int, count: int) -> bool | None:
    """Whether micro-batch `micro` of a step's `count` all-reduces its gradients across the
    replicas (FSDPModule.set_requires_all_reduce), or None where that is not asked. hybrid
    and none replicate (none: every rank a replica of a shard group of one), so with
    accumulation only the last micro-batch all-reduces, on the summed gradients; the
    reduce-scatter inside a shard group still runs every micro-batch (a copy for none).
    full and grad-op have no replica dimension."""
    if mode not in ("hybrid", "none") or count < 2:
        return None
    return micro == count - 1


def learnt_weights(counts: list[int], summed: torch.Tensor, world: int) -> torch.Tensor:
    """What each micro-batch's mean loss is multiplied by so that the gradients FSDP
    averages over the data-parallel ranks are those of the mean over every learnt token of
    the step (all micro-batches, all ranks). `counts`: this rank's learnt tokens per
    micro-batch; `summed`: the counts all-reduced over all `world` ranks (tensor-parallel
    ranks share their data, so it is tp times the step's count N).

    Rank r's loss is L_r = sum_i mean_i * n_i * dp / N; FSDP averages gradients over dp,
    giving the gradient of sum over the step's tokens / N. With dp * tp = world and
    summed = tp * N, the weight n_i * dp / N is n_i * world / summed. A step with no
    learnt token at all weighs everything 0."""
    n = torch.tensor(counts, dtype=torch.float32, device=summed.device)
    return n * world / summed.clamp(min=1).float()


def backward(loss: torch.Tensor) -> None:
    """`loss.backward()`, with selective AC's refusal of a model that changes a saved matmul
    output in place (`ReLU(inplace=True)` after a Linear) said as the user's to fix: full AC
    recomputes the whole block and takes it; letting the cache be mutated would apply an
    in-place `x += b` twice on recompute, silently."""
    try:
        loss.backward()
    except RuntimeError as err:
        if "cached during selective activation checkpoint has been mutated" not in str(err):
            raise
        raise UserError("ac=selective: the model changes a saved matmul output in place (an "
                        "inplace=True activation after a Linear?); use ac=full, or out-of-place ops "
                        "in its blocks") from None


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm over every shard and replica, then clip to `max_norm`.

    Sharded grads are DTensors, so per-shard norms come back `Partial`; `full_tensor()`
    sums them across the mesh (one small all-reduce) before the clip coefficient is formed.
    Clipping each rank's shard by its local norm would silently differ per rank.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


@dataclass
class Summary:
    step: int
    loss: float
    eval_loss: float | None
    reason: str
    """done: all steps trained; stop: stopped on request at a step boundary; nonfinite: a
    nan/inf loss or gradient norm stopped it, with no save after it; straggler: saved and
    stopped for the launchers to replace a straggling node (straggler_policy=bad_node);
    storage: a save failed for the run's storage (full, over quota, read-only), and either
    on_storage_full=stop or it was the save a stop, a straggler or the end needed."""
    saved_step: int
    """The newest committed checkpoint's step (-1: none)."""
    unigram_entropy: float


STOP_MARGIN_S = 10.0
"""What a time-limit stop leaves spare beyond its estimate (the save, twice over, and two
steps): the ranks must be done before Slurm kills them."""


def stop_time(noticed: float, deadline: float | None, lead: int | None, saves: list[float],
              steps: list[float], before: float | None = None) -> float:
    """When a notice that came at `noticed` should stop training (all times on this host's
    boot clock, `rundir.proc.clock`; no wall clock). A preemption (or any notice far from
    the deadline, or without a measured save) stops at once: the job is killed a grace
    period later. The time limit's notice comes `lead` seconds before the end Slurm keeps:
    training goes on until that end (`limit_end`) less twice the slowest of the last saves,
    two steps and STOP_MARGIN_S, which loses no step and wastes less of the allocation than
    stopping at the notice.

    `before`: the stop time planned at an earlier step boundary. Planned again at every
    boundary, it only ever moves earlier: a save after the notice that ran slower than
    those before it (a busier file system) brings the stop forward, or the stop's own
    save would cross the deadline (Slurm's TIMEOUT, which is never requeued)."""
    if deadline is None or lead is None or not saves or deadline - noticed > lead + NOTICE_SLACK_S:
        return noticed if before is None else min(before, noticed)
    step = sorted(steps)[len(steps) // 2] if steps else 0.0
    at = max(noticed, limit_end(noticed, deadline, lead) - (2 * max(saves[-3:]) + 2 * step + STOP_MARGIN_S))
    return at if before is None else min(before, at)


def _no_report(phase: str, step: int) -> None:
    """Outside hpcshard's launchers no one watches a rank's progress."""


def _no_record(event: events.Event) -> None:
    """Without a run directory there is no ledger to tell."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hooks:
    """What a Trainer tells the world around it. Given at construction (the runtime's, in
    `runtime.main`); a Trainer built elsewhere (tests, benches) tells no one."""

    report: Callable[[str, int], None] = _no_report
    """Where this rank tells its launcher what it does (phase, step): the node's progress
    board under hpcshard's launchers, nothing elsewhere."""
    record: Callable[[events.Event], None] = _no_record
    """Told of each rollback and straggler (the runtime writes them into the ledger)."""


@dataclass(frozen=True, slots=True)
class Past:
    """The run's rollbacks before this start (the ledger's, across restarts and requeues):
    they count against nan_rollbacks, and the batches they skipped stay skipped."""

    rollbacks: int = 0
    skipped: frozenset[tuple[int, int]] = frozenset()
    """The (epoch, offset) of every global batch an earlier rollback skipped."""


@dataclass(frozen=True, slots=True)
class Built:
    """The model, sharded and materialised, with what was learnt on the way (`build_model`)."""

    model: nn.Module
    blocks: list[nn.Module]
    """The sharded blocks (each its own FSDP unit)."""
    frozen: frozenset[str]
    """Canonical names of the parameters that do not train (freeze, or LoRA's base)."""
    n_params: int
    flops_per_token: float
    init_from: Stored | None
    """init_from's headers, checked against the model (None: not set)."""
    init_names: dict[str, str]
    """{model name: checkpoint name} for every tensor init_from supplies."""


def build_model(job: Job, cfg: TrainConfig, env: DistEnv, mesh: DeviceMesh, mode: str) -> Built:
    """The job's model built on the meta device, adapted (LoRA, freeze), tensor parallel
    where tp > 1, sharded over the data parallel mesh, then materialised on the device."""
    own, par = ModelSection.of(cfg), ParallelSection.of(cfg)
    with on_meta():
        model = job.model(cfg)
    apply_lora(model, own)  # names change (PEFT's base_layer): before anything reads them
    apply_freeze(model, own.freeze)
    frozen_names, n_params = frozen(model), sum(p.numel() for p in model.parameters())
    # init_from: checked against the model's names and shapes now (headers only); what
    # it supplies is not initialised, only read (restore).
    init_from = read_dir(own.init_from) if own.init_from else None
    init_names = match(model, init_from) if init_from else {}
    loaded = aliases(model) if init_from else frozenset()
    flops_per_token = job.flops_per_token(cfg, model)
    if par.float8:  # torchao's order: the Linear layers swapped before TP, AC, compile, FSDP
        in_fp8 = mesh["shard"].size() > 1  # (torchtitan's: float8 all-gathers where FSDP gathers)
        n = float8.convert(model, find_blocks(model, par.block, par.block_min_params), env.device,
                           all_gather=in_fp8)
        if env.is_main:
            log.info("float8: %d Linear layers converted to Float8Linear, float8 all-gathers %s", n,
                     "on" if in_fp8 else "off (one rank per shard group)")
    plan = ShardPlan(mode=mode, precision=par.precision, block=par.block,
                     block_min_params=par.block_min_params, ac_every=cfg.ac_every(),
                     ac_selective=cfg.ac_selective(),
                     compile=par.compile, cpu_offload=par.cpu_offload,
                     reduce_dtype=par.reduce_dtype, output_dtype=par.output_dtype,
                     reshard=par.reshard_after_forward, prefetch=par.prefetch)
    tp = tp_mesh(mesh)
    if tp is not None:
        require_tp_plan(job, par.tp, "this")
        assert job.tp_plan is not None
        apply_tp(model, tp, job.tp_plan(cfg, model))
    if job.shard is not None:  # the job's own sharding, in full
        blocks = job.shard(cfg, model, dp_mesh(mesh), plan)
    else:
        blocks = shard_model(model, dp_mesh(mesh), plan)
    # Offloaded parameters live in host memory whatever the compute device (FSDP2
    # refuses them elsewhere); buffers stay with the compute.
    materialize(model, env.device, cfg.seed, with_adapters(job.init) if own.lora_rank else job.init,
                param_device=torch.device("cpu") if par.cpu_offload else None, loaded=loaded)
    return Built(model=model, blocks=blocks, frozen=frozen_names, n_params=n_params,
                 flops_per_token=flops_per_token, init_from=init_from, init_names=init_names)


class Trainer:
    """One job on one rank. Build it, then `run()`; the pieces stay usable on their own.
    Built whole: every collaborator is given here and every attribute is born in
    `__init__`; nothing outside sets one afterwards (tests/unit/test_runtime_trainer.py)."""

    def __init__(self, job: Job, cfg: TrainConfig, env: DistEnv, run_dir: Path | None, *,
                 hooks: Hooks | None = None, past: Past | None = None) -> None:
        self.job, self.cfg, self.env, self.run_dir = job, cfg, env, run_dir
        self.hooks = hooks or Hooks()
        past = past or Past()
        self.degrees = Parallel.of(cfg, env.nodes, env.per_node)
        """The parallel degrees: tensor parallel ranks share their data (Parallel)."""
        self.mode = self.degrees.mode
        self.dp_rank, self.dp_world = self.degrees.dp_rank(env.rank), self.degrees.dp_world
        self.micro, self.accum = self.degrees.accumulation(cfg)
        self.mesh = build_mesh(env.device.type, env.nodes, env.per_node, self.mode, cfg.tp,
                               shard=self.degrees.shard)
        built = build_model(job, cfg, env, self.mesh, self.mode)
        self.model, self.blocks, self.frozen = built.model, built.blocks, built.frozen
        self.n_params, self.flops_per_token = built.n_params, built.flops_per_token
        self.init_from, self.init_names = built.init_from, built.init_names
        self.params = list(self.model.parameters())
        self.optimizer = job_optimizer(job, cfg, self.model, fused_optimizer(
            env.device, ParallelSection.of(cfg).cpu_offload, scaled=cfg.precision == "fp16"))
        self.scheduler = job_schedule(job, cfg, self.optimizer)
        # fp16 overflows without loss scaling; the sharded scaler agrees on inf/nan across
        # ranks so every shard skips the same step.
        self.scaler = ShardedGradScaler(env.device.type) if cfg.precision == "fp16" else None
        self.batching = DataSection.of(cfg)
        """The batches, their order and the evaluation (the data section)."""
        splits = job.data(cfg)
        self.splits = splits
        data = self.batching
        self.batches = GlobalBatches(splits.source or splits.train, seq_len=data.seq_len,
                                     batch_size=data.batch_size, micro=self.micro, rank=self.dp_rank,
                                     world=self.dp_world, seed=data.seed, targets=splits.train_targets,
                                     starts=splits.train_starts, order=data.data_order,
                                     prefetch=data.data_prefetch, pin=env.device.type == "cuda")
        self.masked = splits.train_targets is not None or (
            splits.source is not None and splits.source.doc_mode == "whole")
        """The data masks its loss (fine-tuning; whole documents padded): micro-batches are
        weighed by their learnt tokens (`learnt_weights`); else every token is learnt and
        they weigh alike."""
        self.positions = takes_positions(job.loss)
        """The job's loss takes packed records' position ids (`positions`)."""
        if splits.train_starts is not None and not self.positions and env.is_main:
            log.warning("packed records attend across their boundaries: this job's loss takes no "
                        "`positions` to pass to its model (see docs/user/pretrained.md)")
        self.batches.skip.update(past.skipped)  # an earlier rollback's batches stay skipped
        self.eval_count = eval_batch_count(splits.eval, data.seq_len, data.batch_size,
                                           data.eval_batches) if data.eval_every else 0
        if data.eval_every and not self.eval_count and env.is_main:
            log.warning("the held-out split holds less than one batch (%d tokens); "
                        "evaluation is off", len(splits.eval))
        self.supervision = SupervisionSection.of(cfg)
        """What the Trainer does about non-finite steps and stragglers (its part of the
        supervision section; the launcher reads the rest)."""
        self.step = 0
        self.pretrained: Stored | None = None
        """The Hugging Face checkpoint this run started from (init_from), once loaded."""
        self.state_bytes: dict[str, int] | None = None
        self.recent: collections.deque[tuple[int, int]] = collections.deque(
            maxlen=self.supervision.nan_skip)
        """Where the last nan_skip global batches started (what a rollback skips)."""
        self.rollbacks = past.rollbacks
        """Rollbacks after a non-finite step so far in this run (the ledger's before this
        start, then this process's; `nan_rollbacks` is the budget)."""
        self.paused = {"save_s": 0.0, "eval_s": 0.0}
        """Seconds of saves and evaluations since the last metrics record (the next one
        carries them: the time between records, less these, is training)."""
        self.clock = StepClock(env.device)
        """Where each step's time goes (runtime.timing): marked at the phases' ends, read
        at each metrics record."""
        self.stragglers = Stragglers(self.supervision.straggler_margin,
                                     self.supervision.straggler_patience)
        self.hosts: list[str] = []
        self.crowded = ""
        """Why stragglers are not judged in this run ("": they are)."""
        self.step_times: collections.deque[float] = collections.deque(maxlen=32)
        """Seconds the last steps took (what a step costs when the time limit nears)."""
        self.stop_at: float | None = None
        """When a stop notice takes effect, on this host's boot clock: at once, or for a
        time-limit notice the limit's end less what saving needs (`stop_time`)."""
        self.planned_with = 0
        """How many of this process's saves `stop_at` was planned with."""
        self.limits = RankEnv.from_environ()
        fingerprint = data_fingerprint(splits, data.seq_len, data.data_order)
        self.data_fingerprint = fingerprint
        """What decides the samples (prepared corpora): saved with each checkpoint, compared
        on resume (`_same_data`)."""
        self.data_fingerprint_v1 = data_fingerprint_v1(splits, data.seq_len, data.data_order)
        """The same in the first format: what a checkpoint written before version 2 is
        compared with."""
        parts = TrainParts(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                           batches=self.batches, scaler=self.scaler,
                           layout={"mesh": list(self.mesh.shape), "sharding": self.mode,
                                   "tp": cfg.tp, "frozen": len(self.frozen),
                                   **({"frozen_from": self.init_from.fingerprint}
                                      if self.init_from and self.frozen else {}),
                                   **({"data": fingerprint} if fingerprint else {})})
        self.ckpt = (Checkpointer(parts, env, cfg, run_dir, owner=self.limits.owner,
                                  newest=self.limits.newest, start=(self.limits.attempt, self.limits.cycle))
                     if run_dir is not None else None)
        self.profiler = Profiler(ProfileSection.of(cfg), env, run_dir,
                                 start=f"{self.limits.attempt}.{self.limits.cycle}")
        """Profiles asked by `hpcshard profile` or the schedule (runtime.profile)."""
        # Dropout and any other in-step randomness: per rank, seeded, restorable.
        seed_rank(self.batching.seed, env.rank)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.env.device, non_blocking=True)

    def _loss_parallel(self) -> AbstractContextManager[None]:
        """With tp > 1, cross entropy on logits split by vocabulary (a plan whose head
        returns them as `Shard(-1)` DTensors) is computed where they lie: no rank gathers
        the whole (tokens x vocabulary) logits, forward or backward. Plain logits are
        unaffected."""
        return loss_parallel() if self.cfg.tp > 1 else nullcontext()

    def _loss(self, batch: Micro) -> torch.Tensor:
        x, y, *rest = batch
        extra = {"positions": self._to_device(rest[0])} if rest and self.positions else {}
        loss = self.job.loss(self.model, self._to_device(x), self._to_device(y), **extra)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel's

    def _learnt(self, micro_batches: list[Micro]) -> tuple[list[int], torch.Tensor | None]:
        """Learnt tokens per micro-batch (counted on the host, where the batches are made),
        and what each micro-batch's mean loss is multiplied by: a tensor after one
        all-reduce of this rank's count (no host sync), or None for unmasked data, whose
        micro-batches all weigh 1/accum as before."""
        if not self.masked:
            return [], None
        counts = [int((y != IGNORE).sum()) for _, y, *_ in micro_batches]
        summed = torch.tensor(sum(counts), dtype=torch.int64, device=self.env.device)
        dist.all_reduce(summed)
        self.clock.mark("comm")
        return counts, learnt_weights(counts, summed, self.env.world)

    def forward_backward(self, micro_batches: list[Micro]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, gradients accumulated (and
        reduced by FSDP); returns this rank's share of the step's loss."""
        counts, weights = self._learnt(micro_batches)
        total = torch.zeros((), device=self.env.device)
        for i, batch in enumerate(micro_batches):
            # hybrid and none: the all-reduce across replicas runs once per step, on the
            # summed gradients (for hybrid the slow links carry 1/accum).
            sync = all_reduce_at(self.mode, i, len(micro_batches))
            if sync is not None:
                assert isinstance(self.model, FSDPModule)
                self.model.set_requires_all_reduce(sync)
            with self._loss_parallel():
                loss = self._loss(batch)
                loss = loss / len(micro_batches) if weights is None else loss * weights[i]
                self.clock.mark("forward")
                backward(self.scaler.scale(loss) if self.scaler else loss)
                self.clock.mark("backward")
            if weights is None or counts[i]:  # (a mean over no token may be nan; it weighs 0)
                total += loss.detach()
        return total

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro-batches; returns (loss, grad norm)."""
        self.clock.mark("other")  # (the loop's own work since the last boundary)
        self.recent.append(self.batches.upcoming())
        batch = self.batches.next()
        self.clock.mark("data")
        total = self.forward_backward(batch)
        if self.ckpt is not None:  # an async save may still be copying the parameters
            self.ckpt.staged()
        self.clock.mark("checkpoint")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = clip_grad_norm_(self.params, self.cfg.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.cfg.float8:  # the float8 all-gathers' scales, from the weights just stepped
            float8.rescale(self.model)
        self.scheduler.step()
        if self.state_bytes is None:  # what this rank holds, for `hpcshard plan` to compare
            self.state_bytes = state_bytes(self.params, self.optimizer)
        self.model.zero_grad(set_to_none=True)  # (every parameter's, the optimizer's or not)
        self.clock.mark("optimizer")
        self.step += 1
        return total, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first eval_batches global batches of the held-out split."""
        data, env = self.batching, self.env
        self.model.eval()
        total = torch.zeros(2, device=env.device)
        for batch in eval_batches(self.splits.eval, seq_len=data.seq_len, batch_size=data.batch_size,
                                  micro=self.micro, rank=self.dp_rank, world=self.dp_world,
                                  count=self.eval_count, targets=self.splits.eval_targets,
                                  starts=self.splits.eval_starts):
            # Masked data: the mean over the learnt tokens, as in training; else over windows.
            # Every rank runs every forward (FSDP's gathers are collective), weighted or not.
            weight = int((batch[1] != IGNORE).sum()) if self.masked else len(batch[0])
            with self._loss_parallel():
                loss = self._loss(batch)
            if weight:  # (a mean over no token may be nan)
                total[0] += loss * weight
            total[1] += weight
        self.model.train()
        dist.all_reduce(total)
        return (total[0] / total[1].clamp(min=1)).item()

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """A CPU-GPU sync point: only called on logging steps."""
        value = value.detach().clone()
        dist.all_reduce(value)
        return value.item() / self.env.world

    def restore(self, how: str = "auto", pretrained: bool = True, *, reader: bool = False) -> Loaded | None:
        """Resume from a checkpoint (auto|never|STEP|PATH) before `run`; without one, and
        with `pretrained`, start from `init_from`'s weights if it is set. `reader`: only
        load, the checkpoint directory untouched (`Checkpointer.resume`)."""
        self.hooks.report("load", self.step)
        loaded = self.ckpt.resume(how, reader=reader) if self.ckpt else None
        if loaded is not None:
            self._same_data(loaded)
            self.step = loaded.step
            if pretrained and self.init_from is not None and self.frozen:
                self._frozen_again(loaded)
        elif pretrained and self.init_from is not None:
            start = time.perf_counter()
            load_pretrained(self.model, self.init_from, self.init_names)
            self.pretrained = self.init_from
            if self.env.is_main:
                log.info("started from %s (%.0f MB) in %.1f s", self.init_from.path,
                         self.init_from.bytes / 1e6, time.perf_counter() - start)
        if self.cfg.float8 and loaded is not None:  # the scales of the weights loaded (a rollback's)
            float8.rescale(self.model)
        return loaded

    def _same_data(self, loaded: Loaded) -> None:
        """The saved position means the same samples only on the same data: refuse a
        resume onto changed corpora (every rank alike: each reads the same manifest and
        data) unless data_changed=accept. A checkpoint written before the fingerprint was
        recorded has none and resumes as before."""
        changed = data_changes(loaded.manifest.get("data"), self.data_fingerprint, self.data_fingerprint_v1)
        if not changed:
            return
        if not self.splits.accept_changed:
            raise UserError(f"the data differs from what {Path(loaded.path).name} was trained on "
                            f"({changed}); its position would train other samples: restore the data, "
                            "or resume with --set data_changed=accept to train on from there")
        if self.env.is_main:
            log.warning("the data differs from what %s was trained on (%s); training on from its "
                        "position (data_changed=accept)", Path(loaded.path).name, changed)

    def _frozen_again(self, loaded: Loaded) -> None:
        """Checkpoints hold no frozen weights: read them from init_from again, which must
        be the checkpoint the run started from."""
        assert self.init_from is not None
        saved = loaded.manifest.get("frozen_from")
        if saved is not None and saved != self.init_from.fingerprint:
            raise UserError(f"init_from={str(self.init_from.path)!r} is not the checkpoint this run's "
                            f"frozen weights came from (its tensors or files changed since "
                            f"{Path(loaded.path).name}); point init_from at the original")
        load_pretrained(self.model, self.init_from,
                        {k: v for k, v in self.init_names.items() if k in self.frozen})

    def _boundary(self, stop: StopRequest | None, bad: torch.Tensor) -> str:
        """After a step: agree, in one all-reduce, on a non-finite loss or gradient norm on
        any rank, a stop request, a periodic save and an async commit. Returns why the loop
        ends here ("nonfinite", "stop", "storage") or "". No periodic save once a stop was
        asked for: the stop's own save comes soon (a time limit's, near the deadline, must
        not be made later by one more save)."""
        ckpt, last = self.ckpt, self.step >= self.cfg.steps
        writing = ckpt is not None and ckpt.pending is not None and not ckpt.pending[0].done()
        stopping = stop is not None and stop.requested
        due = ckpt is not None and not last and not stopping and ckpt.due(self.step)
        local = torch.tensor([float(self._stop_due(stop)), float(due), float(writing),
                              self.profiler.asked()], device=self.env.device)
        flags = torch.cat([local, bad.float().reshape(1)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        agreed = flags.tolist()
        stop_now, due, busy, nonfinite = (bool(v) for v in agreed[:3] + agreed[4:])
        # (a profile ask taken here is recorded from the next step; none while the loop ends)
        self.profiler.agree(int(agreed[3]), self.step, ending=stop_now or nonfinite or last)
        self._comm()
        if nonfinite:  # no save: the newest checkpoint is the last good state
            return "nonfinite"
        if ckpt is not None and ckpt.pending is not None and not busy:
            ckpt.wait()  # every rank's background write is done: commit it now
        if ckpt is not None and (stop_now or due) and not last:
            self.hooks.report("save", self.step)
            start = time.perf_counter()
            ckpt.save(self.step, "stop" if stop_now else "periodic")
            self.paused["save_s"] += time.perf_counter() - start
        self.clock.mark("checkpoint")  # (the commit of an async save, or this save)
        if ckpt is not None and ckpt.full and self.cfg.on_storage_full == "stop":
            return "storage"  # (a stop's own save that failed so: `run` ends it as "storage")
        return "stop" if stop_now and not last else ""

    def _comm(self) -> None:
        """The wait in a collective since the previous mark: communication, unless a profile
        window ended at this step (the ranks waited for its writers: not training)."""
        if self.profiler.wrote:
            self.profiler.wrote = False
            self.clock.skip()
        else:
            self.clock.mark("comm")

    def _stop_due(self, stop: StopRequest | None) -> bool:
        """This rank's view (the ranks then agree, all-reduced): does the notice stop
        training at this step? Each rank plans from its own host's clock (its notice, its
        launcher's deadline): the all-reduce stops every rank when the earliest plan says so."""
        if stop is None or not stop.requested:
            return False
        known = len(self.ckpt.save_seconds) if self.ckpt is not None else 0
        if self.stop_at is not None and known == self.planned_with:
            return clock() >= self.stop_at
        # Planned at the first boundary after the notice, and again after each save that
        # committed since (an async one in flight at the notice): never later, only earlier.
        saves, before, self.planned_with = self._save_seconds(), self.stop_at, known
        limits = self.limits
        self.stop_at = stop_time(stop.at, limits.deadline, limits.lead, saves, list(self.step_times),
                                 before=before)
        if self.stop_at > stop.at and self.stop_at != before and self.env.is_main:
            assert limits.deadline is not None and limits.lead is not None  # (else: at once)
            end = limit_end(stop.at, limits.deadline, limits.lead)
            log.info("time-limit notice: training on until %s, %.0f s before the time limit ends "
                     "(as %s says; the save takes about %.1f s)",
                     time.strftime("%H:%M:%S", time.localtime(time.time() + self.stop_at - clock())),
                     end - self.stop_at, "Slurm's time left" if end < stop.at + limits.lead else "the notice",
                     max(saves[-3:], default=0.0))
        return clock() >= self.stop_at

    def _stragglers(self, metrics: Metrics) -> str:
        """Time the probe on every rank and compare (runtime.straggler). Every rank sees the
        same gathered times, so all take the same decision. "straggler": the policy is
        bad_node and one was found: this step is saved and the ranks stop together."""
        env, cfg = self.env, self.cfg
        if env.world < 2 or self.step >= cfg.steps:
            return ""
        if not self.hosts:
            places: list[Any] = [None] * env.world
            dist.all_gather_object(places, (socket.gethostname(), os.cpu_count() or 1,
                                            torch.get_num_threads()))
            self.hosts = [str(p[0]) for p in places]
            self.crowded = crowded(places, env.device)
            if self.crowded and env.is_main:
                log.info("straggler checks are off: %s (ranks that share cores cannot be "
                         "compared)", self.crowded)
        if self.crowded:
            return ""
        seconds = probe(env.device)
        self.clock.mark("other")
        found = self.stragglers.look(gather(seconds, env.device))
        self.clock.mark("comm")
        for rank, ratio in found:
            slow = events.Straggler(attempt=self.limits.attempt, cycle=self.limits.cycle, step=self.step,
                                    rank=rank, host=self.hosts[rank], ratio=round(ratio, 2),
                                    policy=self.supervision.straggler_policy)
            if env.is_main:
                log.warning("straggler: rank %d on %s computes %.1fx slower than the median of "
                            "the others (%d looks in a row)%s", rank, self.hosts[rank], ratio,
                            self.supervision.straggler_patience, "; its node is declared bad" if
                            self.supervision.straggler_policy == "bad_node" else "")
                metrics.event("straggler", step=slow.step, rank=rank, host=slow.host, ratio=slow.ratio,
                              policy=slow.policy)
            self.hooks.record(slow)
        if not found or self.supervision.straggler_policy != "bad_node" or self.ckpt is None:
            return ""
        self.hooks.report("save", self.step)
        self.ckpt.save(self.step, "stop")
        return "straggler"

    def _save_seconds(self) -> list[float]:
        """How long saves took: this process's, else the newest committed checkpoint's."""
        if self.ckpt is None or self.run_dir is None:
            return []
        if self.ckpt.save_seconds:
            return list(self.ckpt.save_seconds)
        newest = store.committed(self.run_dir / store.CHECKPOINTS)
        return [float(newest[-1].manifest["save_seconds"])] if newest and "save_seconds" in \
            newest[-1].manifest else []

    def _nonfinite(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """This rank's loss or gradient norm is nan or inf (a tensor: no sync here). With the
        fp16 scaler an inf norm is its business (it skips the step and backs off)."""
        bad = ~torch.isfinite(loss)
        return bad if self.scaler is not None else bad | ~torch.isfinite(norm)

    def _rollback(self) -> bool:
        """nan_policy=rollback, within its budget: reload the newest committed checkpoint
        (every rank: the decision is the all-reduced flag's) and never train on the global
        batches that led here. False: stop instead (no budget left, nothing to reload)."""
        sup = self.supervision
        if sup.nan_policy != "rollback" or self.rollbacks >= sup.nan_rollbacks or self.ckpt is None:
            return False
        self.ckpt.wait()  # an async write of an earlier, good step commits first
        bad, skipped = self.step, sorted(self.recent)
        self.batches.skip.update(skipped)
        loaded = self.restore("auto", pretrained=False)
        if loaded is None:  # nothing committed yet: no state to go back to
            return False
        self.rollbacks += 1
        self.hooks.record(events.Rollback(attempt=self.limits.attempt, cycle=self.limits.cycle, step=bad,
                                          to=loaded.step, skipped=[list(p) for p in skipped],
                                          rollback=self.rollbacks, of=sup.nan_rollbacks))
        log.warning("non-finite loss or gradient norm at step %d: rolled back to step %d and "
                    "skipping %d global batch(es) (rollback %d of %d)", bad, loaded.step,
                    len(skipped), self.rollbacks, sup.nan_rollbacks)
        return True

    def run(self, stop: StopRequest | None = None, startup: dict[str, float] | None = None) -> Summary:
        """Train to cfg.steps, or until a stop, a non-finite step or the storage ends it.
        `startup`: wall-clock marks of this rank's start (entry, torch, rendezvous, built,
        loaded), for the metrics' start record."""
        cfg, env = self.cfg, self.env
        baseline = unigram_entropy(self.splits.train, self.splits.vocab_size)
        peak = cfg.peak_tflops or device_peak_tflops(env.device)
        metrics = Metrics(self.run_dir, env, total_steps=cfg.steps, trackers=self._trackers())
        metrics.event("start", params=self.n_params, world=env.world, nodes=env.nodes, device=env.device.type,
                      sharding=self.mode, mesh=list(self.mesh.shape), precision=cfg.precision,
                      accumulation=self.accum, blocks=len(self.blocks), first_step=self.step + 1,
                      unigram_entropy=baseline, train_tokens=self.splits.train_tokens,
                      startup=startup or {}, **({"data": self.splits.report} if self.splits.report else {}))
        if self.splits.report and env.is_main:
            log.info("data: %s", self.splits.report)
        tokens_per_step = self.batching.batch_size * self.batching.seq_len
        loss, eval_loss, reason = float("nan"), None, "done"
        last_step = self.step
        self.batches.wait_taken()
        self.clock.restart()
        # the loader's thread stops however the loop ends (an exception included); what it
        # prepared beyond the last step is dropped
        with metrics.progress(start=self.step) as bar, closing(self.batches):
            while self.step < cfg.steps:
                self.hooks.report("step", self.step)
                first = self.state_bytes is None
                began = time.perf_counter()
                if self.profiler.starting(self.step + 1):  # (every rank alike)
                    self.hooks.report("profile", self.step)
                    self.profiler.before(self.step + 1)
                    self.clock.skip()  # (starting a profile is not the step's)
                    self.hooks.report("step", self.step)
                try:
                    step_loss, norm = self.train_step()
                except torch.cuda.OutOfMemoryError:
                    self.profiler.oom(self.step + 1)
                    raise
                self.step_times.append(time.perf_counter() - began)
                if self.profiler.ending(self.step):  # (every rank alike)
                    # the writers stop the profiler and write the trace, the others wait for
                    # them at the next collective: seconds per recorded step on a GPU, which
                    # the watchdog must not judge by the steps' learned limit
                    self.hooks.report("profile", self.step)
                    self.profiler.after(self.step, metrics)
                    self.clock.skip()  # (nor is writing its trace)
                if first and self.state_bytes is not None:
                    metrics.event("memory", **self.state_bytes)
                bar.advance(self.step)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    loss = self.mean_over_ranks(step_loss)
                    self._comm()
                    steps = max(1, self.step - last_step)
                    step_s, split = self.clock.take(steps)
                    tps = tokens_per_step / step_s
                    metrics.record(self.step, loss=loss, lr=self.scheduler.get_last_lr()[0],
                                   grad_norm=norm.item(), tokens_per_s=tps,
                                   mfu=tps * self.flops_per_token / (peak * 1e12 * env.world)
                                   if peak else None,
                                   data_wait_s=self.batches.wait_taken() / steps, step_s=step_s,
                                   split_s={k: round(v, 6) for k, v in split.items()},
                                   **{k: round(v, 4) for k, v in self.paused.items() if v})
                    self.paused = dict.fromkeys(self.paused, 0.0)
                    bar.show(loss)
                    last_step = self.step
                    self.clock.skip()  # (writing the record is not training)
                if self.eval_count and (self.step % self.batching.eval_every == 0 or self.step == cfg.steps):
                    self.hooks.report("eval", self.step)
                    start = time.perf_counter()
                    eval_loss = self.evaluate()
                    self.paused["eval_s"] += time.perf_counter() - start
                    metrics.record(self.step, eval_loss=eval_loss)
                    self.clock.skip()  # evaluation time is not training throughput
                ended = self._boundary(stop, self._nonfinite(step_loss, norm))
                if ended == "nonfinite" and self._rollback():
                    self.hooks.report("profile", self.step)
                    self.profiler.rewound(metrics)  # (a window being recorded ends, cut short)
                    # the steps trained again are counted when they are: not the discarded
                    # ones, nor the reload (the goodput accounting has the rollback)
                    self.clock.restart()
                    last_step = self.step
                    metrics.rewound(self.step)
                    bar.advance(self.step)
                    continue
                every = self.supervision.straggler_every
                if not ended and every and self.step % every == 0:
                    ended = self._stragglers(metrics)
                if ended:
                    reason = ended
                    break
            self.profiler.close(metrics)
        saved = -1
        if self.ckpt is not None:
            if reason == "done":
                self.hooks.report("save", self.step)
                self.ckpt.save(self.step, "end")
            self.ckpt.wait()
            saved = self.ckpt.last_saved
            if self.ckpt.full and reason != "nonfinite":  # (the save a stop or the end needed)
                reason = "storage"
        summary = Summary(step=self.step, loss=loss, eval_loss=eval_loss, reason=reason,
                          saved_step=saved, unigram_entropy=baseline)
        metrics.event("end", **vars(summary))
        metrics.close()
        return summary

    def _trackers(self) -> Trackers:
        """TensorBoard and W&B on rank 0 when the config asks, told where this start resumed
        and the highest step an earlier start logged (the metrics file's)."""
        cfg = self.cfg
        if not self.env.is_main or self.run_dir is None or not (cfg.tensorboard or cfg.wandb_project):
            return Trackers.none()
        from hpcshard.rundir.metrics import read_metrics
        from hpcshard.rundir.spec import SPEC, RunSpec

        logged = max((r["step"] for r in read_metrics(self.run_dir) if "step" in r and "event" not in r),
                     default=0)
        created = RunSpec.read(self.run_dir).created if (self.run_dir / SPEC).is_file() else 0.0
        return Trackers(self.run_dir, cfg, resumed=self.step, logged=logged, created=created)
