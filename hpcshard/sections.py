"""`TrainConfig` in sections, each owned by the component that reads it, and `Parallel`, the
one object that owns a run's parallel degrees and what follows from them.

The flat fields stay the storage and the surface: `--set lr=...`, a site file's
`train = {...}`, spec.json's `sets` and `resolved`, and a job's `cfg.lr` are all flat. A
section is a typed, read-only view of some of them, built where a component starts
(`OptimizerSection.of(cfg)`) or, where only a stored resolved config is at hand (the
launcher's watchdog), from that flat dict (`SupervisionSection.from_flat`). Views, not
attributes of the config: a job's own field may be named like a section (`data`).
Every `TrainConfig` field belongs to exactly one section (tests/unit/test_config_sections.py).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from hpcshard.config import SHARDING_MODES, TrainConfig, _choice, _convert
from hpcshard.errors import UserError


@dataclass(frozen=True)
class Section:
    """A typed view of the `TrainConfig` fields a subclass names (their meaning: there)."""

    @classmethod
    def of(cls, cfg: TrainConfig) -> Self:
        """This section of a built (validated) config."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> Self:
        """This section of a stored flat config (spec.json's resolved config, `--set`
        strings): a key it lacks (a run written before the key existed) takes
        TrainConfig's default; a string is parsed as `--set` parses it."""
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        hints = typing.get_type_hints(cls)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value, kind = values.get(f.name, defaults[f.name]), hints[f.name]
            if isinstance(value, str) and kind is not str:
                value = _convert(value, kind)
            elif kind in (int, float):
                value = kind(value)
            out[f.name] = value
        return cls(**out)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class OptimizerSection(Section):
    """AdamW and its schedule: `runtime.optim` (`build_optimizer`, `lr_factor`), unless the job's
    `optimizer` and `schedule` hooks give their own; gradient clipping: `runtime.train`."""

    steps: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    schedule: str
    decay_fraction: float
    decay_shape: str
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float


@dataclass(frozen=True)
class DataSection(Section):
    """The batches and their order, evaluation: `runtime.data` (GlobalBatches) through the
    trainer; the micro batch and accumulation come from `Parallel.accumulation`."""

    batch_size: int
    micro_batch_size: int
    seq_len: int
    seed: int
    eval_every: int
    eval_batches: int


@dataclass(frozen=True)
class ModelSection(Section):
    """Where the weights start and what trains: `runtime.train.build_model` (LoRA and freeze
    through `runtime.adapters`, init_from through `runtime.pretrained`)."""

    init_from: str
    freeze: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: str


@dataclass(frozen=True)
class ParallelSection(Section):
    """Sharding, tensor parallelism, precision, activation checkpointing: `runtime.mesh`
    (through `Parallel`) and `runtime.shard` (ShardPlan)."""

    sharding: str
    tp: int
    precision: str
    reduce_dtype: str
    output_dtype: str
    reshard_after_forward: str
    prefetch: int
    ac: str
    block: str
    block_min_params: int
    compile: bool
    cpu_offload: bool


@dataclass(frozen=True)
class CheckpointSection(Section):
    """When to save and what to keep: `runtime.checkpoint` (Checkpointer)."""

    ckpt_every: int
    ckpt_minutes: float
    keep_last: int
    keep_every: int
    async_save: bool
    on_storage_full: str


@dataclass(frozen=True)
class SupervisionSection(Section):
    """Stops, hangs, non-finite steps, stragglers and slow links: `launch.watchdog` (read by
    the launcher from the resolved config), `runtime.stop`, `runtime.straggler`,
    `runtime.links` and the trainer's nan policy."""

    stop_signals: str
    watchdog_factor: float
    watchdog_floor_s: float
    watchdog_warmup_steps: int
    watchdog_phase_s: float
    watchdog_join_s: float
    nan_policy: str
    nan_skip: int
    nan_rollbacks: int
    straggler_every: int
    straggler_margin: float
    straggler_patience: int
    straggler_policy: str
    health_link_mb: float
    health_link_gbps: float


@dataclass(frozen=True)
class TrackerSection(Section):
    """Metrics records and the trackers they also go to: `runtime.metrics`,
    `runtime.trackers`."""

    log_every: int
    tensorboard: bool
    wandb_project: str
    wandb_entity: str
    wandb_mode: str
    peak_tflops: float


SECTIONS: tuple[type[Section], ...] = (OptimizerSection, DataSection, ModelSection, ParallelSection,
                                       CheckpointSection, SupervisionSection, TrackerSection)
"""Every section, in the order the settings reference lists them."""


def resolve_sharding(mode: str, nodes: int) -> str:
    """`auto` is hybrid when there is more than one node, else full."""
    _choice("sharding", mode, SHARDING_MODES)
    if mode == "auto":
        return "hybrid" if nodes > 1 else "full"
    return mode


def check_tp(tp: int, per_node: int) -> None:
    """A tensor parallel group lives inside one node (its collectives run every layer)."""
    if tp < 1 or per_node % tp:
        divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
        raise UserError(f"tp={tp} does not divide the {per_node} ranks of a node; "
                        f"use one of {', '.join(map(str, divisors))}")


@dataclass(frozen=True)
class Parallel:
    """A run's parallel degrees and everything derived from them, built once where a shape
    meets a config (preflight, the planner, each rank's trainer, the mesh).

    Ranks of one node are contiguous (torchrun numbers each agent's workers together) and
    tp is the innermost dimension, inside a node: tensor parallel ranks share their data, so
    the data-parallel world (what FSDP shards and replicates over, what the global batch
    divides over) is the world divided by tp, and a rank's data-parallel rank its rank
    divided by tp.
    """

    nodes: int
    per_node: int
    tp: int = 1
    sharding: str = "auto"
    """As asked; `mode` is what it resolves to on this many nodes."""

    def __post_init__(self) -> None:
        check_tp(self.tp, self.per_node)
        resolve_sharding(self.sharding, self.nodes)

    @classmethod
    def of(cls, cfg: TrainConfig, nodes: int, per_node: int) -> Parallel:
        asked = ParallelSection.of(cfg)
        return cls(nodes=nodes, per_node=per_node, tp=asked.tp, sharding=asked.sharding)

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def dp_world(self) -> int:
        return self.world // self.tp

    @property
    def dp_per_node(self) -> int:
        """Data-parallel ranks in a node: the shard group of hybrid sharding."""
        return self.per_node // self.tp

    @property
    def mode(self) -> str:
        return resolve_sharding(self.sharding, self.nodes)

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def accumulation(self, cfg: TrainConfig) -> tuple[int, int]:
        """(micro batch per rank, accumulation steps) of cfg's batch over the data-parallel
        world, or a UserError that says what divides."""
        return cfg.accumulation(self.dp_world)
