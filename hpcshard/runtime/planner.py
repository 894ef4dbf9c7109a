"""`hpcshard plan`: per-GPU memory of an FSDP2/HSDP job, before it runs.

The model is built on the meta device (no memory, no weights). Parameter, gradient and
optimizer bytes come from the real parameter shapes, sharded the way `fully_shard` shards
them (dim 0, padded to a multiple of the shard group), so they match what a rank holds.
Activations are measured, not guessed: one forward and loss on meta tensors with a
saved-tensors hook records every tensor autograd keeps for backward, block by block, so
activation checkpointing can be accounted for per block. A model described only by
numbers (--params/--layers/--hidden) uses the usual transformer formulas instead.

Memory model per GPU, for a mesh of R replicas x S shards (bytes):

    parameters   sharded fp32 master weights            sum(ceil(d0/S) * rest) * 4
    gradients    sharded fp32 gradients                 = parameters
    optimizer    AdamW exp_avg + exp_avg_sq              2 x parameters
    all-gather   the root's unsharded parameters, plus the current and the prefetched
                 block in the compute dtype; grad-op keeps every block unsharded until
                 backward; none (DDP-like) keeps everything unsharded and gathers nothing
    reduce       one block's unsharded gradients in fp32 before the reduce-scatter
    activations  saved tensors per micro-batch (AC: block inputs + one block recomputed)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hpcshard.runtime.blocks import find_blocks, on_meta
from hpcshard.runtime.shard import TORCH_DTYPES

GiB = 2**30
MODES = ("none", "grad-op", "hybrid", "full")
"""Preference order when several fit: less communication first."""
RESERVE = 1.0 * GiB
"""CUDA context, NCCL buffers and allocator slack: a fixed allowance per GPU."""
DTYPES = TORCH_DTYPES  # precision -> the compute dtype activations are counted in


@dataclass
class ModelShape:
    """What memory depends on, from a meta model or from numbers."""

    name: str
    params: int
    blocks: int
    block_name: str
    max_block_params: int
    root_params: int
    """Parameters outside the blocks (embeddings, final norm, head)."""
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    """Every parameter's shape (empty for a model given by numbers: no padding then)."""
    act_bytes: int = 0
    """Saved activations of one micro-batch without AC, in the compute dtype."""
    act_block_bytes: list[int] = field(default_factory=list)
    """Of which saved inside each block."""
    act_block_input_bytes: list[int] = field(default_factory=list)
    """Each block's input (what AC keeps instead)."""
    micro_batch: int = 1
    seq_len: int = 0
    act_error: str = ""
    """Why activations could not be measured (the forward does not run on meta tensors)."""
    tp: int = 1
    """Tensor parallel degree: `shapes`, the block and root sizes and the activations are
    then one tensor parallel rank's (`split_for_tp`)."""
    frozen: list[bool] = field(default_factory=list)
    """Per parameter (as `shapes`): frozen (freeze, LoRA's base weights), so without a
    gradient or optimizer state, and not in checkpoints. Empty: every one trains."""
    frozen_params: int = 0
    """Elements of the frozen parameters, of the whole model (`frozen` counts a tensor
    parallel rank's)."""

    def local_params(self, shards: int, trainable: bool = False) -> int:
        """Parameter elements rank 0 holds when dim 0 is split over `shards` (padded);
        `trainable`: of the parameters that train only."""
        if not self.shapes:
            return math.ceil(self.params / shards)
        frozen = self.frozen or [False] * len(self.shapes)
        return sum(math.ceil(s[0] / shards) * math.prod(s[1:]) if s else 1
                   for s, f in zip(self.shapes, frozen, strict=True) if not (trainable and f))

    @property
    def trainable_params(self) -> int:
        return self.params - self.frozen_params

    def activations(self, micro_batch: int, ac_every: int) -> int:
        """Bytes kept for backward for a micro-batch, with every K-th block checkpointed."""
        scale = micro_batch / self.micro_batch
        if not ac_every:
            return int(self.act_bytes * scale)
        ac = [i for i in range(len(self.act_block_bytes)) if i % ac_every == 0]
        dropped = sum(self.act_block_bytes[i] - self.act_block_input_bytes[i] for i in ac)
        recompute = max((self.act_block_bytes[i] for i in ac), default=0)
        return int((self.act_bytes - dropped + recompute) * scale)


@contextmanager
def _saved_tensors(record: list[int]) -> Iterator[None]:
    """Adds the bytes of every tensor autograd saves for backward (each storage once: the
    views of one tensor, on meta as on a GPU; three projections saving views of one norm
    output were counted three times). Attention on the meta device is counted as a GPU's
    fused kernel saves it (`_FusedAttention`)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata  # (the storage itself: saved, so alive meanwhile)
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or key in seen:
            return t  # (a weight, or its transpose a matmul saves: parameters, not activations)
        seen.add(key)
        record[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FusedOnMeta():
        yield


class _FusedAttention(torch.autograd.Function):
    """What a GPU's fused attention (flash, memory-efficient, cuDNN) saves for backward:
    q, k, v, the output and the softmax's log-sum-exp (fp32, one per query and head), the
    output laid out (batch, seq, heads, dim) as those kernels write it, so the usual
    transpose and reshape after attention is a view of it. On the meta device torch takes
    the math path, which saves fp32 copies and the seq x seq scores: the demo's activations
    came out twice what an H100 holds. Planning only: there is no backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        shape = (*q.shape[:-1], v.shape[-1])
        out = (q.new_empty(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2) if len(shape) == 4
               else q.new_empty(shape))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, mask)  # (a mask: the memory-efficient kernel's bias)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise NotImplementedError("the planner's attention has no backward")


class _FusedRMSNorm(torch.autograd.Function):
    """What a GPU's fused RMSNorm saves for backward: its input, in its own dtype, and the
    fp32 reciprocal root mean square of each row. On the meta device (and on CPU) torch
    takes the composite path, which upcasts a low-precision input to fp32 and saves that
    copy and the fp32 normalized rows: a 30M-parameter Llama's activations were planned
    25-30% above what an H200 held with torch 2.11 (its CUDA rms_norm is the fused kernel).
    Planning only: there is no backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int) -> torch.Tensor:
        rstd = x.new_empty(x.shape[:-dims], dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise NotImplementedError("the planner's rms_norm has no backward")


class _FusedOnMeta(TorchFunctionMode):
    """scaled_dot_product_attention and rms_norm on meta tensors go through the fused
    kernels' accounts (`_FusedAttention`, `_FusedRMSNorm`)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (func is F.rms_norm and args and isinstance(args[0], torch.Tensor)
                and args[0].device.type == "meta"):
            shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            dims = 1 if isinstance(shape, int) else len(shape)
            return _FusedRMSNorm.apply(args[0], weight, dims)
        if (func is F.scaled_dot_product_attention and len(args) >= 3
                and all(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args[:3])):
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            return _FusedAttention.apply(*args[:3], mask if isinstance(mask, torch.Tensor) else None)
        return func(*args, **kwargs)


def measure(job: Any, cfg: Any, micro_batch: int, dtype: torch.dtype) -> ModelShape:
    """Build the job's model on the meta device and run one micro-batch through its loss."""
    from hpcshard.runtime.adapters import apply_freeze, apply_lora

    with on_meta():
        model = job.model(cfg)
    apply_lora(model, cfg)
    apply_freeze(model, cfg.freeze)
    model = model.to(dtype)
    return measure_model(model, cfg.block, cfg.block_min_params,
                         lambda m, x, y: job.loss(m, x, y), micro_batch, cfg.seq_len,
                         name=type(model).__name__)


def measure_model(model: nn.Module, block: str, block_min: int, loss_fn: Any, micro_batch: int,
                  seq_len: int, name: str) -> ModelShape:
    blocks = find_blocks(model, block, block_min)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    params = list(model.parameters())
    counter = [0]
    per_block, inputs = [0] * len(blocks), [0] * len(blocks)
    start: dict[int, int] = {}

    def pre(i: int) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            start[i] = counter[0]
            inputs[i] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        return hook

    def post(i: int) -> Any:
        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            per_block[i] = counter[0] - start[i]
        return hook

    handles = [h for i, b in enumerate(blocks)
               for h in (b.register_forward_pre_hook(pre(i)), b.register_forward_hook(post(i)))]
    x = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    error = ""
    try:
        with _saved_tensors(counter):
            loss_fn(model, x, x)
    except (RuntimeError, NotImplementedError) as err:  # e.g. .item() on a meta tensor
        error = str(err).splitlines()[0]
        counter[0], per_block, inputs = 0, [0] * len(blocks), [0] * len(blocks)
    finally:
        for h in handles:
            h.remove()
    return ModelShape(
        name=name, params=sum(p.numel() for p in params), blocks=len(blocks),
        block_name=type(blocks[0]).__name__,
        max_block_params=max(sum(p.numel() for p in b.parameters()) for b in blocks),
        root_params=sum(p.numel() for p in params if id(p) not in in_blocks),
        shapes=[tuple(p.shape) for p in params], frozen=[not p.requires_grad for p in params],
        frozen_params=sum(p.numel() for p in params if not p.requires_grad),
        act_bytes=counter[0], act_block_bytes=per_block,
        act_block_input_bytes=inputs, micro_batch=micro_batch, seq_len=seq_len, act_error=error)


def from_numbers(params: int, layers: int, hidden: int, seq_len: int, vocab: int, micro_batch: int,
                 heads: int, dtype_bytes: int) -> ModelShape:
    """A decoder-only transformer given by numbers. Activations per layer follow Korthikanti
    et al. (2022) with flash attention (no s^2 term): about 34 s*b*h bytes at 16 bits,
    scaled to the compute dtype; the logits add s*b*V in the compute dtype plus fp32."""
    if layers < 1 or hidden < 1 or seq_len < 1 or heads < 1:
        raise ValueError("--layers, --hidden, --seq-len and --heads must be positive")
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} is not divisible by --heads {heads}")
    embed = vocab * hidden
    per_layer = max(1, (params - 2 * embed) // layers) if params > 2 * embed else max(1, params // layers)
    sbh = seq_len * micro_batch * hidden
    layer_act = int(34 * sbh * dtype_bytes / 2)
    logits = seq_len * micro_batch * vocab * (dtype_bytes + 4)
    return ModelShape(
        name=f"{params / 1e9:.3g}B-parameter transformer", params=params, blocks=layers,
        block_name="layer", max_block_params=per_layer, root_params=params - per_layer * layers,
        act_bytes=layer_act * layers + logits + sbh * dtype_bytes,
        act_block_bytes=[layer_act] * layers, act_block_input_bytes=[sbh * dtype_bytes] * layers,
        micro_batch=micro_batch, seq_len=seq_len)


@dataclass
class Memory:
    mode: str
    replicate: int
    shard: int
    params: int
    grads: int
    optimizer: int
    gather: int
    reduce: int
    activations: int
    activations_ac: int
    reserve: int

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.gather + self.reduce
                + self.activations + self.reserve)

    @property
    def total_ac(self) -> int:
        return self.total - self.activations + self.activations_ac


def mesh_of(mode: str, nodes: int, gpus: int, tp: int = 1, shard: int = 0) -> tuple[int, int]:
    """(replicate, shard) as runtime.mesh builds it (the tp dimension apart); `shard`: an
    explicit shard degree (hybrid's), 0: the mode's own."""
    from hpcshard.sections import Parallel

    degrees = Parallel(nodes=nodes, per_node=gpus, tp=tp, sharding=mode, shard=shard)
    return degrees.replicate, degrees.shard_degree


def memory(shape: ModelShape, mode: str, nodes: int, gpus: int, compute_bytes: int,
           micro_batch: int, ac_every: int, reserve: int = int(RESERVE), shard: int = 0) -> Memory:
    replicate, shard = mesh_of(mode, nodes, gpus, shape.tp, shard)
    local = shape.local_params(shard) * 4  # fp32 master weights: FSDP2 keeps the shard in fp32
    trained = shape.local_params(shard, trainable=True) * 4  # gradients, AdamW's two moments
    if mode == "none":
        gather, reduce = 0, 0
    elif mode == "grad-op":  # unsharded from forward until backward is done with them
        gather, reduce = shape.local_params(1) * compute_bytes, shape.max_block_params * 4
    else:
        gather = (shape.root_params + 2 * shape.max_block_params) * compute_bytes
        reduce = shape.max_block_params * 4
    return Memory(mode=mode, replicate=replicate, shard=shard, params=local, grads=trained,
                  optimizer=2 * trained, gather=gather, reduce=reduce,
                  activations=shape.activations(micro_batch, 0),
                  activations_ac=shape.activations(micro_batch, ac_every or 1),
                  reserve=reserve)


def checkpoint_bytes(shape: ModelShape, shards: int, world: int) -> int:
    """Committed checkpoint size: fp32 weights and AdamW's two moments, each shard written
    once (replicas do not multiply bytes), the per-rank RNG states, and DCP's own costs.

    DCP writes every shard of every tensor as its own serialized item (about 1.7 KB of
    framing each, measured with torch 2.13) and lists each in `.metadata` (about 210 B).
    Negligible for a real model, 10% of the demo's 0.9M parameters."""
    tensors = (len(shape.shapes) - sum(shape.frozen)) or shape.blocks * 10  # frozen: not saved
    items = 3 * tensors * shards + tensors + 12 * world + 40  # + AdamW steps, RNG, progress
    rng = 5_056 * world  # torch's CPU generator state, one per rank
    return shape.trainable_params * 4 * 3 + 4 * tensors + rng + items * (1_700 + 210)


def fits(m: Memory, gpu_mem: int) -> tuple[bool, bool]:
    return m.total <= gpu_mem, m.total_ac <= gpu_mem


def split_for_tp(shape: ModelShape, job: Any, cfg: Any) -> ModelShape:
    """One tensor parallel rank's share of the model: the job's tp_plan applied for real to
    a meta-device model over a fake process group of `cfg.tp` ranks (torch's own test
    backend: no memory, no communication), so the shapes are what `parallelize_module`
    gives whatever the plan (norms whole, projections split, uneven splits padded as
    DTensor pads them). Activations are taken as divided by tp: sequence parallelism
    splits what tensor parallelism does not (Korthikanti et al., 2022)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpcshard.runtime.adapters import apply_freeze
    from hpcshard.runtime.shard import apply_tp

    if dist.is_initialized():
        raise ValueError("hpcshard plan with tp > 1 cannot run inside a process group; "
                         "run `hpcshard plan` on its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.tp)
    try:
        mesh = init_device_mesh("cpu", (cfg.tp,), mesh_dim_names=("tp",))
        with on_meta():
            model = job.model(cfg)
        apply_freeze(model, cfg.freeze)  # (LoRA with tp > 1 is refused)
        apply_tp(model, mesh, job.tp_plan(cfg, model))

        def local(p: torch.Tensor) -> tuple[int, ...]:
            return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)

        blocks = find_blocks(model, cfg.block, cfg.block_min_params)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        shapes = [local(p) for p in model.parameters()]
        frozen = [not p.requires_grad for p in model.parameters()]
        max_block = max(sum(math.prod(local(p)) for p in b.parameters()) for b in blocks)
        root = sum(math.prod(local(p)) for p in model.parameters() if id(p) not in in_blocks)
    finally:
        dist.destroy_process_group()
    tp = cfg.tp
    return ModelShape(
        name=shape.name, params=shape.params, blocks=shape.blocks, block_name=shape.block_name,
        max_block_params=max_block, root_params=root, shapes=shapes, frozen=frozen,
        frozen_params=shape.frozen_params, act_bytes=shape.act_bytes // tp,
        act_block_bytes=[b // tp for b in shape.act_block_bytes],
        act_block_input_bytes=[b // tp for b in shape.act_block_input_bytes],
        micro_batch=shape.micro_batch, seq_len=shape.seq_len, act_error=shape.act_error, tp=tp)


def min_nodes_full(shape: ModelShape, gpus: int, compute_bytes: int, micro: int, ac: int,
                   gpu_mem: int, reserve: int, limit: int = 4096) -> int | None:
    """Fewest nodes on which full sharding (over every GPU) fits, with the given AC."""
    def ok(n: int) -> bool:
        m = memory(shape, "full", n, gpus, compute_bytes, micro, ac, reserve)
        return (m.total_ac if ac else m.total) <= gpu_mem

    if not ok(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def node_degrees(nodes: int, gpus: int, tp: int = 1) -> list[int]:
    """Shard degrees that span whole nodes, more than one and fewer than all (2, 4, ... nodes'
    data-parallel ranks), smallest first: between hybrid and full."""
    per = gpus // tp
    return [k * per for k in range(2, nodes) if nodes % k == 0]


WHY = {"none": "everything fits unsharded: no all-gathers at all",
       "grad-op": "parameters stay gathered from forward to backward: one all-gather per block "
                  "instead of two",
       "hybrid": "shards stay inside a node; only gradients cross nodes",
       "full": "only sharding over every GPU fits"}


def recommend(shape: ModelShape, nodes: int, gpus: int, compute_bytes: int,
              micro_choices: list[int], gpu_mem: int, reserve: int) -> dict[str, Any] | None:
    """The first sharding (least communication first: none, grad-op, hybrid, then shard
    degrees spanning 2, 4, ... nodes, the smallest first, then full) that fits without AC,
    else with it, at the largest micro-batch that fits (fewer, larger kernels)."""
    choices: list[tuple[str, int]] = [(m, 0) for m in MODES[:2]]
    if nodes > 1:
        choices += [("hybrid", 0)] + [("hybrid", s) for s in node_degrees(nodes, gpus, shape.tp)]
    choices.append(("full", 0))
    for ac in (0, 1):
        for mode, degree in choices:
            for micro in sorted(micro_choices, reverse=True):
                m = memory(shape, mode, nodes, gpus, compute_bytes, micro, ac, reserve, shard=degree)
                total = m.total_ac if ac else m.total
                if total <= gpu_mem:
                    why = WHY[mode] if not degree else (
                        f"shards span {degree // (gpus // shape.tp)} nodes ({m.replicate} replicas "
                        f"of {degree}): the smallest shard degree that fits")
                    if ac:
                        why += "; AC is needed for the activations"
                    return {"sharding": mode, "shard": degree, "ac": "full" if ac else "none",
                            "micro_batch": micro, "total": total, "why": why}
    return None


def shape_of_hf(path: Any, seq_len: int | None, micro: int, dtype: torch.dtype) -> ModelShape:
    """A Hugging Face causal LM from its config.json, built on the meta device."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError("--hf-config needs transformers: pip install 'hpcshard[hf]'") from None
    try:
        conf = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"--hf-config {str(path)!r} is not a Hugging Face config: {err}") from None
    with on_meta():
        model = AutoModelForCausalLM.from_config(conf)
    model = model.to(dtype)
    seq = seq_len or min(int(getattr(conf, "max_position_embeddings", 4096)), 4096)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x).logits.float().flatten(0, 1), y.flatten())

    return measure_model(model, "", 0, loss, micro, seq,
                         name=f"{getattr(conf, 'model_type', 'hf')} ({path})")


def make_plan(job: str | None, sets: dict[str, str], numbers: dict[str, Any], hf_config: Any,
              nodes: int, gpus: int, sharding: str, precision: str | None, ac: int | None,
              micro_batch: int | None, gpu_mem: int, reserve: int = int(RESERVE),
              shard: int = 0) -> dict[str, Any]:
    """`sharding` and `shard` as the command line gave them (auto and 0: the job's)."""
    from hpcshard.sections import Parallel

    world = nodes * gpus
    micro_choices = [1, 2, 4, 8, 16, 32, 64]
    # The job's ac=selective is estimated as full AC: the matmul and attention outputs it
    # keeps (and full AC does not) are not counted, a lower bound on its activations.
    selective = float8 = False
    if job:
        from hpcshard.config import build_config
        from hpcshard.runtime.job import load_job, require_tp_plan
        from hpcshard.sections import Parallel

        j = load_job(job)
        cfg = build_config(j.config, sets)
        precision = precision or cfg.precision
        float8 = cfg.float8
        selective = ac is None and cfg.ac_selective()
        ac = cfg.ac_every() if ac is None else ac
        tp = cfg.tp
        degrees = Parallel(nodes=nodes, per_node=gpus, tp=tp)
        require_tp_plan(j, tp, job)
        dp = degrees.dp_world
        per_rank = cfg.batch_size // dp if cfg.batch_size % dp == 0 else 0
        if not per_rank:
            raise ValueError(f"the job's batch_size {cfg.batch_size} does not divide over {nodes} x "
                             f"{gpus} = {world} GPUs" + (f" in groups of tp={tp}" if tp > 1 else "")
                             + "; pick a shape that divides it, or --set batch_size")
        micro = micro_batch or degrees.accumulation(cfg)[0]
        micro_choices = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
        if sharding == "auto" and not shard:  # the command line's, else the job's
            sharding, shard = cfg.sharding, cfg.shard
        shape = measure(j, cfg, micro, DTYPES[precision])
        shape.name = f"{job}"
        if tp > 1:
            shape = split_for_tp(shape, j, cfg)
    else:
        precision = precision or "bf16"
        ac = ac or 0
        micro = micro_batch or 1
        if hf_config is not None:
            shape = shape_of_hf(hf_config, numbers.get("seq_len"), micro, DTYPES[precision])
        else:
            shape = from_numbers(micro_batch=micro, dtype_bytes=DTYPES[precision].itemsize, **numbers)
    chosen = Parallel(nodes=nodes, per_node=gpus, tp=shape.tp, sharding=sharding, shard=shard)
    cbytes = DTYPES[precision].itemsize
    columns = [(name, name, 0) for name in MODES]
    mode = chosen.mode
    if mode == "hybrid" and chosen.shard_degree != chosen.dp_per_node:
        mode = f"shard={chosen.shard_degree}"
        columns.insert(3, (mode, "hybrid", chosen.shard_degree))
    modes = {}
    for key, name, degree in columns:
        m = memory(shape, name, nodes, gpus, cbytes, micro, ac, reserve, shard=degree)
        ok, ok_ac = fits(m, gpu_mem)
        modes[key] = {**vars(m), "total": m.total, "total_ac": m.total_ac, "fits": ok, "fits_ac": ok_ac}
    return {
        "activations_unmeasured": shape.act_error or None,
        "model": {"name": shape.name, "params": shape.params, "trainable": shape.trainable_params,
                  "blocks": shape.blocks,
                  "block": shape.block_name, "max_block_params": shape.max_block_params,
                  "root_params": shape.root_params, "seq_len": shape.seq_len},
        "nodes": nodes, "gpus": gpus, "precision": precision, "micro_batch": micro,
        # float8 is counted as bf16: its float8 all-gathers are smaller (an upper bound there),
        # its matmuls save their bf16 inputs for backward as bf16's do
        "float8": "estimated as bf16 (all-gathers an upper bound)" if float8 else None,
        "ac": "selective (estimated as full: a lower bound)" if selective
        else "none" if not ac else ("full" if ac == 1 else f"every {ac}"),
        "ac_with": "full" if (ac or 1) == 1 else f"every {ac}", "sharding": mode, "gpu_mem": gpu_mem,
        "tp": shape.tp,
        "modes": modes, "checkpoint_bytes": checkpoint_bytes(
            shape, chosen.shard_degree * shape.tp, world),
        "min_nodes_full": min_nodes_full(shape, gpus, cbytes, micro, ac or 0, gpu_mem, reserve),
        "min_nodes_full_ac": min_nodes_full(shape, gpus, cbytes, micro, ac or 1, gpu_mem, reserve),
        "recommendation": recommend(shape, nodes, gpus, cbytes, micro_choices, gpu_mem, reserve),
    }
