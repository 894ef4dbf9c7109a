"""Typed training configuration, shared by the CLI (no torch) and the runtime.

A job's own config subclasses `TrainConfig`, so one flat namespace of keys is set with
`--set key=value`. Every bad value is a `ValueError` that names the value and what is
accepted; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from hpcshard.errors import UserError
from hpcshard.rundir.rankenv import NOTICE, signal_name

SHARDING_MODES = ("auto", "hybrid", "full", "grad-op", "none")
PRECISIONS = ("fp32", "bf16", "fp16")
NAN_POLICIES = ("stop", "rollback")
STRAGGLER_POLICIES = ("warn", "bad_node")
STORAGE_POLICIES = ("stop", "train")
DATA_ORDERS = ("feistel", "randperm")
SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "1-sqrt")
AC_MODES = ("none", "full", "selective")

C = typing.TypeVar("C", bound="TrainConfig")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def check_precision(value: str) -> None:
    """precision is the dtype of everything float8 leaves alone: fp8 is its own setting (a
    UserError naming it for fp8, as for any other value not in PRECISIONS)."""
    if value.lower() in ("fp8", "float8"):
        raise UserError(f"precision={value!r} is not valid: float8 training is --set float8=true with "
                        "--set precision=bf16 (float8 matmuls in the blocks, bf16 elsewhere)")
    _choice("precision", value, PRECISIONS)


def profile_ranks(value: str) -> tuple[int, ...] | None:
    """The ranks `value` names ("0", "0,7"), or None for `all`; bad input is a UserError."""
    if value.strip() == "all":
        return None
    parts = [p.strip() for p in value.split(",")]
    if not value.strip() or not all(p.isdigit() for p in parts):
        raise UserError(f"profile ranks {value!r} are not valid; give rank numbers separated by "
                        "commas (0,7) or all")
    return tuple(sorted({int(p) for p in parts}))


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    if not math.isfinite(value):
        raise UserError(f"{name}={value!r} is not valid; it must be a finite number")
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise UserError(f"{name}={value!r} is not valid; it must be {bound}")


@dataclass(kw_only=True)
class TrainConfig:
    """Settings every job has. A job's `Config` subclasses this and adds its own fields.

    The fields are one flat namespace (`--set`, site files, spec.json, `cfg.lr`); each
    belongs to one section of `hpcshard.sections`, the typed view its component reads. A
    component takes its section once, when it is built: a config changed after the Trainer
    was built changes nothing."""

    steps: int = 200
    """Optimizer steps to train."""
    batch_size: int = 32
    """Global batch in sequences per optimizer step, the same whatever the world size."""
    micro_batch_size: int = 0
    """Sequences per rank per forward pass; 0 means batch_size / dp world (no accumulation),
    the data-parallel world being the world divided by tp. Gradient accumulation steps =
    batch_size / (micro_batch_size * dp world)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The schedule decays to lr * min_lr_ratio at the last step (cosine, wsd)."""
    warmup_steps: int = 20
    """Linear warmup steps before the schedule's decay."""
    schedule: str = "cosine"
    """The learning-rate schedule after warmup (a job's own `schedule` hook replaces it):
    cosine (decay to min_lr_ratio over the remaining steps) | wsd (warmup-stable-decay: at
    the peak until the last `decay_fraction` of the steps, then down to min_lr_ratio) |
    constant (at the peak)."""
    decay_fraction: float = 0.2
    """wsd: the share of the steps spent decaying at the end (0 to 1)."""
    decay_shape: str = "1-sqrt"
    """wsd: the decay's shape, linear | 1-sqrt (Hägele et al. 2024, which matches cosine)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 disables clipping."""
    seed: int = 0
    """Seeds initialisation (world-size independent), data order and dropout."""
    data_order: str = "feistel"
    """How each epoch shuffles the samples: feistel (a keyed permutation computed per index,
    no table: memory does not grow with the data) | randperm (a table of 8 bytes per
    sample, the order of releases before it: resumes their runs exactly mid-epoch)."""
    data_prefetch: int = 1
    """Steps whose batches a background thread prepares while the current one trains
    (pinned for a non-blocking copy on GPU); 0: each step reads its own."""
    init_from: str = ""
    """A Hugging Face checkpoint directory (config.json and *.safetensors, written by
    save_pretrained) to start from: each rank reads only the slices it holds. The run's own
    checkpoints win once they exist."""
    freeze: str = ""
    """Parameters to keep as they start (init_from's or the seed's): comma-separated fnmatch
    patterns of their names, e.g. `model.embed_tokens.*,model.layers.0.*`. Frozen parameters
    get no gradient or optimizer state and are not rewritten at each save."""
    lora_rank: int = 0
    """LoRA (PEFT) adapters of this rank on `lora_targets`; every base weight is frozen. 0: off."""
    lora_alpha: float = 16.0
    """LoRA scaling: the adapter's update is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_targets: str = ""
    """Comma-separated names (or name suffixes) of the layers to adapt, e.g. q_proj,v_proj;
    empty: PEFT's default for the transformers model type."""
    sharding: str = "auto"
    """auto (hybrid on >1 node, else full) | hybrid (shard in a node, replicate across
    nodes: HSDP) | full (shard over all ranks) | grad-op (full, but keep parameters
    gathered between forward and backward) | none (replicate only, DDP-like). `shard` picks
    hybrid's shard degree (groups spanning nodes)."""
    shard: int = 0
    """The shard degree: FSDP shards every parameter over groups of this many consecutive
    data-parallel ranks and replicates across the groups (HSDP's (replicate, shard) mesh,
    replicate = world / tp / shard); a group of 16 on 8-GPU nodes spans two whole nodes. It
    must divide the data-parallel world. 0: the sharding mode's own (hybrid: the ranks of a
    node; full, grad-op: every rank; none: 1). With sharding=auto, shard=N is hybrid with
    that degree (full when it is every rank, none when 1); full, grad-op and none take only
    their own degree."""
    tp: int = 1
    """Tensor parallel degree: this many ranks of one node share each block's matrices
    (the innermost mesh dimension; FSDP shards over the rest of the node, HSDP replicates
    across nodes). 1: no tensor parallelism. Needs the job's `tp_plan`."""
    precision: str = "fp32"
    """fp32 | bf16 (bf16 compute, fp32 reduce) | fp16 (fp16 compute with a grad scaler). fp8 is not
    a precision: float8=true with precision=bf16."""
    reduce_dtype: str = "fp32"
    """The dtype gradients are reduced in (reduce-scatter, HSDP's all-reduce): fp32 | bf16
    (half the bytes on the wire, less exact sums) | fp16."""
    output_dtype: str = ""
    """The dtype of the model's output ("": as computed, e.g. bf16 logits under bf16): fp32
    | bf16 | fp16."""
    reshard_after_forward: str = "auto"
    """auto (the sharding mode's: every block but the last reshards, none under grad-op) |
    true | false | N: after forward keep each block's parameters sharded over groups of N
    ranks of the shard dimension, so backward all-gathers inside N (ZeRO++'s hpZ; N
    divides the shard group)."""
    prefetch: int = 0
    """Explicitly prefetch the all-gathers of the next N blocks in forward and backward
    (0: FSDP2's own, one block ahead)."""
    ac: str = "none"
    """Activation checkpointing: none | full (every block recomputed in backward) | selective
    (every block, op by op: matmul and attention outputs kept, the rest recomputed) | K
    (full, every K-th block)."""
    block: str = ""
    """Class name of the repeated block to shard; empty: found automatically."""
    block_min_params: int = 0
    """If > 0 (and block is empty), shard every module with at least this many parameters
    instead of a repeated block."""
    compile: bool = False
    """torch.compile each block before sharding."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    float8: bool = False
    """Float8 training (torchao, the fp8 extra): the blocks' Linear layers whose dimensions are
    multiples of 16 multiply in float8 with dynamic tensorwise scales, and FSDP all-gathers
    their weights in float8; the rest (embeddings, norms, the output head) stays bf16.
    Needs precision=bf16 and NVIDIA GPUs of compute capability 8.9 or later (Ada, Hopper);
    refused elsewhere, with tp > 1, cpu_offload or LoRA."""
    log_every: int = 10
    """Write a metrics record every N steps."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard: one TensorBoard run across
    restarts, requeues and resumes (needs the tensorboard extra)."""
    wandb_project: str = ""
    """Also log to Weights & Biases in this project: one W&B run per hpcshard run across
    restarts, requeues and resumes (needs the wandb extra; the API key comes from the
    environment, WANDB_API_KEY). "": off."""
    wandb_entity: str = ""
    """The W&B team or user to log under; "": the key's default."""
    wandb_mode: str = ""
    """online | offline (RUN_DIR/wandb, no network; `wandb sync` uploads it later) | "":
    WANDB_MODE from the environment, else online."""
    eval_every: int = 50
    """Evaluate on the held-out split every N steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 means look it up (known GPUs only)."""
    profile_every: int = 0
    """Record a torch.profiler trace of `profile_steps` steps after every N-th step (steps
    N+1.., 2N+1..) into RUN_DIR/profiles/step-S/ (Perfetto, Chrome, TensorBoard); 0: only
    when asked (`hpcshard profile RUN`)."""
    profile_steps: int = 2
    """Steps each scheduled profile records."""
    profile_ranks: str = "0"
    """The ranks a scheduled profile records: comma-separated rank numbers, or `all`."""
    profile_memory: bool = False
    """Scheduled profiles also record a CUDA memory snapshot (allocation history with stacks:
    open it at pytorch.org/memory_viz). Only where the ranks have CUDA."""
    ckpt_every: int = 100
    """Save a checkpoint every N steps; 0: only at the end and on a stop request."""
    ckpt_minutes: float = 0.0
    """Also save when this many minutes of wall time passed since the last save; 0: off."""
    keep_last: int = 3
    """Committed checkpoints to keep (at least 1: the newest is never deleted)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this; 0: off."""
    async_save: bool = False
    """Write checkpoints in a background thread; training blocks only for the staging copy."""
    on_storage_full: str = "stop"
    """A save that fails because the run's storage is full, over its quota or read-only
    (its error says so, or a write probe after a save that failed without an errno does),
    and the third save in a row that failed for any reason (counted across restarts and
    requeues): stop (the run ends at that step, exit 74, the newest checkpoint intact; fix
    the storage, then resume) | train (train on unprotected, trying each later save again).
    A stop, straggler or final save that fails so ends the run either way."""
    stop_signals: str = NOTICE
    """Signals that request a stop at the next step boundary (comma-separated names).
    Not USR1 by default: NCCL may use it."""
    watchdog_factor: float = 3.0
    """A rank is hung when a step takes this many times the median step (launch.watchdog)."""
    watchdog_floor_s: float = 5.0
    """...but never less than this many seconds."""
    watchdog_warmup_steps: int = 3
    """Steps of each (re)start judged by watchdog_phase_s instead (cold start, compile)."""
    watchdog_phase_s: float = 1800.0
    """The limit of everything else: setup, load, save, evaluation, the warm-up steps."""
    watchdog_join_s: float = 120.0
    """The limit of joining the process group (every rank already started: seconds even at
    thousands of ranks; a rank stuck connecting to the store waits 30 min otherwise)."""
    nan_policy: str = "stop"
    """A nan/inf loss or gradient norm: stop (the checkpoint before it intact) | rollback
    (reload the newest checkpoint and skip the global batches that led to it)."""
    nan_skip: int = 1
    """rollback: global batches skipped, ending with the one whose step went non-finite."""
    nan_rollbacks: int = 3
    """rollback: at most this many per run; the next non-finite step stops it."""
    straggler_every: int = 20
    """Every this many steps each rank times the same small local computation (a few ms)
    and the times are compared (runtime.straggler); 0: off."""
    straggler_margin: float = 1.4
    """A rank is a straggler when its time exceeds the median of the others' by this factor..."""
    straggler_patience: int = 3
    """...at this many looks in a row."""
    health_link_mb: float = 64.0
    """Before an attempt trains, each node's first rank sends this many MB to its neighbours
    on a ring of the nodes, timed (runtime.links); 0: off."""
    health_link_gbps: float = 0.0
    """A link slower than this many GB/s is slow, and a node whose every link is slow is bad
    (3 nodes or more); 0: measure and report only."""
    straggler_policy: str = "warn"
    """warn (named in the log, metrics and status) | bad_node (the ranks save and stop, and
    the straggler's node is declared bad: a spare replaces it, or the run goes on without it)."""

    def __post_init__(self) -> None:
        _choice("sharding", self.sharding, SHARDING_MODES)
        check_precision(self.precision)
        _choice("reduce_dtype", self.reduce_dtype, PRECISIONS)
        if self.output_dtype:
            _choice("output_dtype", self.output_dtype, PRECISIONS)
        r = self.reshard_after_forward
        if r not in ("auto", "true", "false") and not (r.isdigit() and int(r) > 1):
            raise UserError(f"reshard_after_forward={r!r} is not valid; choose auto, true, false, "
                            "or a group size N > 1 that divides the shard group")
        _choice("nan_policy", self.nan_policy, NAN_POLICIES)
        _choice("straggler_policy", self.straggler_policy, STRAGGLER_POLICIES)
        _choice("on_storage_full", self.on_storage_full, STORAGE_POLICIES)
        _choice("data_order", self.data_order, DATA_ORDERS)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("decay_shape", self.decay_shape, DECAY_SHAPES)
        if not 0 <= self.decay_fraction <= 1:
            raise UserError(f"decay_fraction={self.decay_fraction!r} is not valid; it must be between "
                            "0 and 1 (the share of the steps spent decaying)")
        if self.wandb_mode:
            _choice("wandb_mode", self.wandb_mode, ("online", "offline"))
        for package, setting in (("tensorboard", self.tensorboard and "tensorboard=true"),
                                 ("wandb", self.wandb_project and f"wandb_project={self.wandb_project}")):
            if setting and importlib.util.find_spec(package) is None:
                raise UserError(f"{setting} needs the {package} package, which is not installed: "
                                f"pip install 'hpcshard[{package}]' (or drop the setting)")
        if self.ac not in AC_MODES and not (self.ac.isdigit() and int(self.ac) > 0):
            raise UserError(
                f"ac={self.ac!r} is not valid; choose none, full, selective, or a positive integer K "
                "(checkpoint every K-th block)"
            )
        for name in ("steps", "batch_size", "seq_len", "lr", "log_every", "eval_batches"):
            _positive(name, getattr(self, name))
        for name in ("micro_batch_size", "warmup_steps", "weight_decay", "grad_clip",
                     "eval_every", "block_min_params", "shard", "peak_tflops", "min_lr_ratio", "prefetch",
                     "ckpt_every", "ckpt_minutes", "keep_every", "watchdog_warmup_steps",
                     "nan_rollbacks", "straggler_every", "health_link_mb", "health_link_gbps",
                     "lora_rank", "lora_dropout", "data_prefetch"):
            _positive(name, getattr(self, name), zero_ok=True)
        _positive("lora_alpha", self.lora_alpha)
        if self.lora_rank and self.tp > 1:
            raise UserError(f"lora_rank={self.lora_rank} with tp={self.tp}: LoRA adapters are not "
                            "split by tensor parallelism; use tp=1 (FSDP shards them)")

        _check_float8(self)
        for name in ("tp", "keep_last", "watchdog_factor", "watchdog_floor_s", "watchdog_phase_s",
                     "watchdog_join_s", "nan_skip", "straggler_margin", "straggler_patience"):
            _positive(name, getattr(self, name))
        signal_names(self.stop_signals)
        _positive("profile_every", self.profile_every, zero_ok=True)
        _positive("profile_steps", self.profile_steps)
        profile_ranks(self.profile_ranks)

    def accumulation(self, world: int) -> tuple[int, int]:
        """(micro batch per rank, accumulation steps) for a world size, or ValueError."""
        if self.batch_size % world:
            raise UserError(
                f"batch_size={self.batch_size} does not divide over {world} ranks; "
                f"use a multiple of {world}"
            )
        per_rank = self.batch_size // world
        micro = self.micro_batch_size or per_rank
        if per_rank % micro:
            raise UserError(
                f"micro_batch_size={micro} does not divide the {per_rank} sequences per rank "
                f"(batch_size={self.batch_size} over {world} ranks); use a divisor of {per_rank}"
            )
        return micro, per_rank // micro

    def ac_every(self) -> int:
        """0: no activation checkpointing; K: checkpoint blocks 0, K, 2K, ... (selective: every
        block, `ac_selective` says how)."""
        named = {"none": 0, "full": 1, "selective": 1}
        return named[self.ac] if self.ac in named else int(self.ac)

    def ac_selective(self) -> bool:
        """Op-level checkpointing of the checkpointed blocks (ac=selective)."""
        return self.ac == "selective"


def _check_float8(cfg: TrainConfig) -> None:
    """float8 composes with bf16 alone (torchtitan's recipe: float8 matmuls, bf16 elsewhere)
    and with none of what its casts and weight subclass were not built for."""
    if not cfg.float8:
        return
    if cfg.precision != "bf16":
        raise UserError(f"float8=true needs precision=bf16 (float8 matmuls, bf16 elsewhere), not "
                        f"precision={cfg.precision}; add --set precision=bf16")
    refused = (
        # torchao splits its float8 layers with its own styles (Float8ColwiseParallel,
        # Float8RowwiseParallel, PrepareFloat8ModuleInput), which a job's tp_plan does not name
        (cfg.tp > 1, f"tp={cfg.tp}", "a job's tp_plan splits plain Linear layers, not torchao's "
                                     "float8 ones; use tp=1"),
        (cfg.cpu_offload, "cpu_offload=true", "float8 casts the sharded weights where they live, "
                                              "host memory here; drop cpu_offload"),
        (cfg.lora_rank > 0, f"lora_rank={cfg.lora_rank}", "LoRA's adapters and the layers it wraps are "
                                                         "not converted; drop one of the two"))
    for on, setting, why in refused:
        if on:
            raise UserError(f"float8=true with {setting}: {why}")


def signal_names(text: str) -> list[str]:
    """"USR2,TERM" -> ["SIGUSR2", "SIGTERM"], checked against the signals Python knows."""
    try:
        names = [signal_name(n) for n in text.split(",") if n.strip()]
    except ValueError:
        names = []
    if not names or {"SIGKILL", "SIGSTOP"} & set(names):
        raise UserError(f"stop_signals={text!r} is not valid; give signal names such as "
                        "USR2 or USR2,TERM (not KILL or STOP)")
    return names


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise UserError("expected a boolean (true/false)")


def _convert(text: str, kind: Any) -> Any:
    """Turn a --set string into the field's declared type (int, float, str, bool, Optional)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if text.lower() in ("none", "null", ""):
            return None
        return _convert(text, args[0])
    if origin is typing.Literal:
        choices = typing.get_args(kind)
        if text not in choices:
            raise UserError(f"expected one of {', '.join(map(str, choices))}")
        return text
    if kind is bool:
        return _parse_bool(text)
    if kind in (int, float, str):
        try:
            value = kind(text)
        except ValueError:
            raise UserError(f"expected {kind.__name__}") from None
        if kind is float and not math.isfinite(value):  # nan, inf: no training survives them
            raise UserError("expected a finite number")
        return value
    raise UserError(f"fields of type {kind} cannot be set from the command line")


BEFORE: dict[str, str] = {"data_order": "randperm", "held_out": "last-shard"}
"""Settings whose default changed what a run does, with the value a run resolved before the
setting existed keeps (its checkpoints' data position means that order, and that
train/held-out split)."""
MIXIN_OF: dict[str, str] = {"held_out": "token_dtype"}
"""A kept setting of a config mixin (DataConfig's), with a field that shows the mixin in a
resolved config: a job whose config lacks the mixin has no such key to keep. Not `data`: a
job's own config may have a `data` field of its own (examples/custom_job), and was handed
a held_out it does not know, every run refused at its ranks; `token_dtype` is DataConfig's
alone and older than held_out."""


def kept_sets(sets: dict[str, str], resolved: dict[str, typing.Any]) -> dict[str, str]:
    """A run's `--set` values with what `BEFORE` keeps for a run whose resolved config (spec.json's,
    flat) predates a setting: a run queued, requeued or resumed across an upgrade goes on as
    it started. A setting the run gives itself is its own."""
    if not resolved:  # (nothing resolved: a script, or a spec before any preflight)
        return sets
    kept = {k: v for k, v in BEFORE.items()
            if k not in resolved and (k not in MIXIN_OF or MIXIN_OF[k] in resolved)}
    return {**kept, **sets}


def parse_sets(items: typing.Iterable[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` -> `{"a": "1", "b": "x"}`; a missing `=` is an error."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r} is not key=value; write e.g. --set steps=100")
        out[key.strip()] = value
    return out


def build_config(cls: type[C], sets: dict[str, str]) -> C:
    """Instantiate a config dataclass from `--set` strings, checking keys and types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, text in sets.items():
        if key not in fields:
            raise UserError(
                f"unknown --set key {key!r} for {cls.__name__}; valid keys: "
                + ", ".join(sorted(fields))
            )
        try:
            values[key] = _convert(text, hints[key])
        except ValueError as err:
            raise UserError(f"--set {key}={text!r}: {err}") from None
    return cls(**values)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), from the source of `cls` and
    of the classes it inherits from: what `--set KEY` means."""
    import ast
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        for first, second in zip(body.body, body.body[1:], strict=False):
            if (isinstance(first, ast.AnnAssign) and isinstance(first.target, ast.Name)
                    and isinstance(second, ast.Expr) and isinstance(second.value, ast.Constant)
                    and isinstance(second.value.value, str)):
                docs[first.target.id] = " ".join(inspect.cleandoc(second.value.value).split())
    return docs


def markdown_reference(*classes: type, sections: typing.Sequence[type] = ()) -> str:
    """The `--set` keys of these config classes as one markdown table per class (the
    settings reference in the docs; a unit test keeps it current). A class's own fields
    that `sections` hold (TrainConfig's: `sections.SECTIONS`) get one table per
    section instead, under its name and the component that owns it."""
    out: list[str] = []
    for cls in classes:
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        inherited = {f.name for base in cls.__bases__ if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        own = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in inherited}
        out += [f"## `{cls.__module__}.{cls.__name__}`", ""]
        groups = [(f"### {s.__name__.removesuffix('Section')} (`{s.__name__}`)\n\n"
                   + " ".join(inspect.cleandoc(s.__doc__ or "").split()) + "\n",
                   [own.pop(f.name) for f in dataclasses.fields(s) if f.name in own])
                  for s in sections]
        for heading, rows in [*((h, r) for h, r in groups if r), ("", list(own.values()))]:
            if not rows:
                continue
            out += [heading] if heading else []
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
            for f in rows:
                kind = getattr(hints[f.name], "__name__", str(hints[f.name]))
                meaning = docs.get(f.name, "").replace("|", "\\|")
                out.append(f"| `{f.name}` | {kind} | `{f.default!r}` | {meaning} |")
            out.append("")
    return "\n".join(out)
