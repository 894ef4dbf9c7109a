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
    """The batches, their order and their loading, evaluation: `runtime.data` (GlobalBatches,
    with `runtime.order` and `runtime.loader`) through the trainer; the micro batch and
    accumulation come from `Parallel.accumulation`."""

    batch_size: int
    micro_batch_size: int
    seq_len: int
    seed: int
    data_order: str
    data_prefetch: int
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
    (through `Parallel`) and `runtime.shard` (ShardPlan); float8: `runtime.float8`."""

    sharding: str
    shard: int
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
    float8: bool


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


@dataclass(frozen=True)
class ProfileSection(Section):
    """Profiles on a schedule (`runtime.profile`); `hpcshard profile` asks a live run for
    one without any of these."""

    profile_every: int
    profile_steps: int
    profile_ranks: str
    profile_memory: bool


SECTIONS: tuple[type[Section], ...] = (OptimizerSection, DataSection, ModelSection, ParallelSection,
                                       CheckpointSection, SupervisionSection, TrackerSection,
                                       ProfileSection)
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


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class Parallel:
    """A run's parallel degrees and everything derived from them, built once where a shape
    meets a config (preflight, the planner, each rank's trainer, the mesh).

    Ranks of one node are contiguous (torchrun numbers each agent's workers together) and
    tp is the innermost dimension, inside a node: tensor parallel ranks share their data, so
    the data-parallel world (what FSDP shards and replicates over, what the global batch
    divides over) is the world divided by tp, and a rank's data-parallel rank its rank
    divided by tp.

    The data-parallel world is `replicate x shard`, the shard dimension inner: a shard
    group is `shard` consecutive data-parallel ranks (inside a node for hybrid, whole nodes
    for a degree that is a multiple of a node's), a replica group the ranks that hold the
    same shard, one per shard group.
    """

    nodes: int
    per_node: int
    tp: int = 1
    sharding: str = "auto"
    """As asked; `mode` is what it resolves to on this many nodes (and shard degree)."""
    shard: int = 0
    """As asked; 0: the mode's own degree. `shard_degree` is the one the mesh gets."""

    def __post_init__(self) -> None:
        check_tp(self.tp, self.per_node)
        resolve_sharding(self.sharding, self.nodes)
        self._check_shard()

    @classmethod
    def of(cls, cfg: TrainConfig, nodes: int, per_node: int) -> Parallel:
        asked = ParallelSection.of(cfg)
        return cls(nodes=nodes, per_node=per_node, tp=asked.tp, sharding=asked.sharding,
                   shard=asked.shard)

    def _check_shard(self) -> None:
        s, dp, mode = self.shard, self.dp_world, self.sharding
        if not s:
            return
        if s < 0:
            raise UserError(f"shard={s} is not valid; give a shard degree that divides the "
                            f"{dp} data-parallel ranks ({_divisors(dp)}), or 0 for the sharding mode's")
        if dp % s:
            raise UserError(f"shard={s} does not divide the {dp} data-parallel ranks ({self._world_text()}); "
                            f"use one of {_divisors(dp)}")
        own = {"full": dp, "grad-op": dp, "none": 1}.get(mode)
        if own is not None and s != own:
            what = "replicates without sharding (shard 1)" if mode == "none" else \
                f"shards over all {dp} data-parallel ranks (shard {dp})"
            raise UserError(f"shard={s} contradicts sharding={mode}, which {what}; use sharding=auto "
                            f"or hybrid for {dp // s} replica(s) of {s}, or drop shard")

    def _world_text(self) -> str:
        text = f"{self.nodes} node(s) x {self.per_node}"
        return text + (f" / tp {self.tp}" if self.tp > 1 else "")

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def dp_world(self) -> int:
        return self.world // self.tp

    @property
    def dp_per_node(self) -> int:
        """Data-parallel ranks in a node: the shard group of hybrid sharding by default."""
        return self.per_node // self.tp

    @property
    def mode(self) -> str:
        """hybrid | full | grad-op | none. An explicit shard degree with `auto` is hybrid,
        unless it is every data-parallel rank (full) or 1 (none)."""
        if self.shard and self.sharding == "auto":
            return "full" if self.shard == self.dp_world else "none" if self.shard == 1 else "hybrid"
        return resolve_sharding(self.sharding, self.nodes)

    @property
    def shard_degree(self) -> int:
        """Ranks one parameter is sharded over (the mesh's shard dimension)."""
        mode = self.mode
        if mode == "hybrid":
            return self.shard or self.dp_per_node
        return 1 if mode == "none" else self.dp_world

    @property
    def replicate(self) -> int:
        """Copies of each shard (the mesh's replicate dimension; 1 for full and grad-op)."""
        return self.dp_world // self.shard_degree

    def mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, dimension names) of the device mesh: hybrid and none (replicate, shard),
        full and grad-op (shard,); with tp > 1 a `tp` dimension of that size last."""
        if self.mode in ("hybrid", "none"):
            shape: tuple[int, ...] = (self.replicate, self.shard_degree)
            names: tuple[str, ...] = ("replicate", "shard")
        else:
            shape, names = (self.dp_world,), ("shard",)
        return (shape + (self.tp,), names + ("tp",)) if self.tp > 1 else (shape, names)

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def shard_group(self, rank: int) -> tuple[int, ...]:
        """The global ranks `rank` shards its parameters with (itself included)."""
        first = self.dp_rank(rank) // self.shard_degree * self.shard_degree
        return tuple((first + s) * self.tp + rank % self.tp for s in range(self.shard_degree))

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """The global ranks that hold the same shard as `rank` (itself included)."""
        inner = self.dp_rank(rank) % self.shard_degree
        return tuple((r * self.shard_degree + inner) * self.tp + rank % self.tp
                     for r in range(self.replicate))

    def nodes_per_shard_group(self) -> int:
        """The most nodes a shard group spans (1: each stays inside a node, its all-gathers
        too); a degree that is not a multiple of a node's ranks straddles nodes."""
        s, per = self.shard_degree, self.dp_per_node
        return max(len({(g * s + i) // per for i in range(s)}) for g in range(self.replicate))

    def check_reshard(self, value: str) -> None:
        """reshard_after_forward=N keeps parameters sharded over groups of N ranks of the
        shard group after forward: N must divide it and be smaller."""
        if not value.isdigit():
            return
        n, group = int(value), self.shard_degree
        if group % n or n >= group:
            fits = [d for d in range(2, group) if group % d == 0]
            raise UserError(f"reshard_after_forward={n} must divide the shard group of {group} "
                            f"ranks and be smaller; use " + (", ".join(map(str, fits)) if fits
                                                           else "true or false on this shape"))

    def check_fewer_nodes(self, fewest: int, cfg: TrainConfig | None = None) -> None:
        """A run that may go on with fewer nodes (min_nodes) plans its mesh again on each
        count down to `fewest`: what depends on the count must hold on every one of them,
        refused here, at submit, rather than on the night a node fails (a rank's UserError
        ends the run). An explicit shard degree must divide each count's data-parallel ranks
        (the mode's own degree, shard=0 or the one the mode means, is derived again); with
        `cfg`, its batch must divide over them and an integer reshard_after_forward its
        shard group."""
        if not 0 < fewest < self.nodes:
            return
        shard = 0 if self.shard == self._own_degree() else self.shard
        bad = [n for n in range(fewest, self.nodes) if shard and self.dp_per_node * n % shard]
        if bad:
            ok = [n for n in range(fewest, self.nodes + 1) if n > max(bad)]
            every = [d for d in range(1, self.dp_per_node * fewest + 1)
                     if all(self.dp_per_node * n % d == 0 for n in range(fewest, self.nodes + 1))]
            raise UserError(
                f"shard={shard} with min_nodes {fewest}: on {bad[0]} node(s) the "
                f"{bad[0] * self.dp_per_node} data-parallel ranks do not split into shard groups "
                f"of {shard}; use --min-nodes {ok[0]}, or a shard that divides every count "
                f"from {fewest} to {self.nodes} nodes ({', '.join(map(str, every))}), or shard=0")
        if cfg is None:
            return
        for n in range(fewest, self.nodes):
            try:
                fewer = Parallel(nodes=n, per_node=self.per_node, tp=self.tp, sharding=self.sharding,
                                 shard=shard)
                fewer.accumulation(cfg)
                fewer.check_reshard(cfg.reshard_after_forward)
            except UserError as err:
                raise UserError(f"min_nodes {fewest}: on {n} node(s) (after losing {self.nodes - n}): "
                                f"{err}; or raise --min-nodes above {n}") from None

    def _own_degree(self) -> int:
        """The degree the sharding mode itself means (0: hybrid's and auto's vary)."""
        return {"full": self.dp_world, "grad-op": self.dp_world, "none": 1}.get(self.sharding, 0)

    def accumulation(self, cfg: TrainConfig) -> tuple[int, int]:
        """(micro batch per rank, accumulation steps) of cfg's batch over the data-parallel
        world, or a UserError that says what divides."""
        return cfg.accumulation(self.dp_world)
