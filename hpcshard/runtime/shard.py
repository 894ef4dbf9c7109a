"""FSDP2 sharding: find the repeated block, wrap it (AC, compile), `fully_shard` it, then
materialise the meta-device model with the same values on every world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hpcshard.errors import UserError
from hpcshard.runtime.blocks import InitFn, canonical_name, find_blocks, module_seed, reset_init

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The compute dtype FSDP casts parameters to (None: they stay fp32)."""
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """How to shard one model: the answer to every FSDP2 question in one place."""

    mode: str
    """Resolved sharding mode: hybrid | full | grad-op | none."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16: compute dtype; gradients are always reduced in fp32."""
    block: str = ""
    """Block class name; empty: auto-detect."""
    block_min_params: int = 0
    """Size-based wrapping when no block class is used."""
    ac_every: int = 0
    """0: no activation checkpointing; K: blocks 0, K, 2K, ... are checkpointed."""
    ac_selective: bool = False
    """The checkpointed blocks keep their matmul and attention outputs and recompute the
    rest (op-level, `selective_context`); False: they keep only their input."""
    compile: bool = False
    """torch.compile each block."""
    cpu_offload: bool = False
    """CPUOffloadPolicy for parameters, gradients and optimizer state."""
    reduce_dtype: str = "fp32"
    """fp32 | bf16 | fp16: the dtype gradients are reduced in."""
    output_dtype: str = ""
    """"": as computed; else the dtype the model's output is cast to."""
    reshard: str = "auto"
    """reshard_after_forward: auto (the mode's) | true | false | N (groups of N ranks)."""
    prefetch: int = 0
    """Explicit forward and backward prefetch of the next N blocks; 0: FSDP2's own."""

    def mp_policy(self, root: bool = True) -> MixedPrecisionPolicy:
        """The root's casts its output (`output_dtype`); a block's output stays in the compute
        dtype, which the next block and the root's own layers (a norm, the head) expect."""
        return MixedPrecisionPolicy(param_dtype=DTYPES[self.precision],
                                    reduce_dtype=TORCH_DTYPES[self.reduce_dtype],
                                    output_dtype=TORCH_DTYPES.get(self.output_dtype) if root else None)

    def reshard_after_forward(self, last: bool) -> bool | int:
        """For a block (`last`: the last one, or the root): auto keeps the last block
        gathered (backward needs it at once) and every block under grad-op."""
        if self.reshard == "auto":
            return self.mode != "grad-op" and not last
        if self.reshard in ("true", "false"):
            return self.reshard == "true"
        return int(self.reshard)

    def offload_policy(self) -> OffloadPolicy:
        # pin_memory needs an accelerator; on CPU-only hosts pinning is meaningless anyway.
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()


SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, name))
"""What selective activation checkpointing keeps for backward: the outputs of matmuls and
attention, the costly ops to recompute (torchtitan's `_save_list`, less its float8 and
communication entries; torchtitan also recomputes every second mm, this keeps them all).
Everything else (norms, activations, elementwise) is recomputed from them."""


def _save_matmuls(_ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """A fresh pair of forward and recompute contexts per checkpointed call, as
    `torch.utils.checkpoint`'s `context_fn` takes them."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def _replace_child(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise AssertionError("block is not a child of the model")


class Replicated(ParallelStyle):
    """A tensor parallel style for a module every rank of the group computes whole (a norm
    outside sequence parallelism, a router): its parameters become Replicate DTensors of
    the tp mesh (so FSDP and the optimizer see one kind of parameter), its tensor inputs
    are taken as replicated, its outputs handed back as plain tensors. torchtitan's
    `NoParallel`; torch has no public one."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                # src_data_rank=None: every rank already holds the same values
                mod.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p.data, mesh, [Replicate()], src_data_rank=None),
                    requires_grad=p.requires_grad))

        def inputs(_mod: nn.Module, args: Any, mesh: DeviceMesh) -> Any:
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                         for a in args)

        def outputs(_mod: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    """Tensor parallelism on the (meta) model before FSDP: `plan` as `parallelize_module`
    takes it, over the tp mesh. Every parameter must then be a DTensor of that mesh: FSDP
    and the optimizer cannot mix a plain tensor with them."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not plan:
        raise UserError("the job's tp_plan is empty; name the modules to split "
                        "(see docs/user/sharding.md on tensor parallel plans)")
    # src_data_rank=None: nothing to send, the model is on the meta device (materialize
    # initialises every shard the same way on every rank).
    parallelize_module(model, mesh, plan, src_data_rank=None)
    left = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise UserError(f"the job's tp_plan leaves {len(left)} parameter(s) out of tensor "
                        f"parallelism, e.g. {left[0]!r}: give its module a style "
                        "(SequenceParallel for a norm, RowwiseParallel for an embedding)")


def shard_model(model: nn.Module, mesh: DeviceMesh, plan: ShardPlan) -> list[nn.Module]:
    """Wrap and `fully_shard` every block, then the root. Returns the sharded blocks."""
    blocks = find_blocks(model, plan.block, plan.block_min_params)
    mp, offload = plan.mp_policy(root=False), plan.offload_policy()
    sharded = []
    for i, block in enumerate(blocks):
        wrapped = block
        if plan.ac_every and i % plan.ac_every == 0:
            # The wrapper strips its prefix from state-dict keys, so AC on and off
            # checkpoints are interchangeable.
            wrapped = (checkpoint_wrapper(block, context_fn=selective_context) if plan.ac_selective
                       else checkpoint_wrapper(block))
            _replace_child(model, block, wrapped)
        if plan.compile:
            wrapped.compile()
        # The last block's parameters are needed again right away by the backward pass,
        # so resharding them after forward only costs an extra all-gather (auto).
        reshard = plan.reshard_after_forward(i == len(blocks) - 1)
        fully_shard(wrapped, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=offload)
        sharded.append(wrapped)
    root = plan.reshard_after_forward(False) if plan.reshard != "auto" else plan.mode != "grad-op"
    fully_shard(model, mesh=mesh, reshard_after_forward=root, mp_policy=plan.mp_policy(),
                offload_policy=offload)
    if plan.prefetch:  # issue the next blocks' all-gathers early, both ways
        for i, block in enumerate(sharded):
            assert isinstance(block, FSDPModule)
            block.set_modules_to_forward_prefetch(sharded[i + 1:i + 1 + plan.prefetch])  # type: ignore[arg-type]
            block.set_modules_to_backward_prefetch(sharded[max(0, i - plan.prefetch):i][::-1])  # type: ignore[arg-type]
    return sharded


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int,
                init: InitFn = reset_init, param_device: torch.device | None = None,
                loaded: frozenset[str] = frozenset()) -> None:
    """Allocate a sharded meta-device model on `device` and initialise it.

    Each module is initialised on full-size scratch tensors under a seed derived from its
    name, and every rank keeps only its shard. The values therefore do not depend on the
    world size or the mesh (1 rank and 4 ranks start identical), replicas are equal, and
    at most one module's parameters exist unsharded at a time, never the whole model.
    `param_device`: where the parameters live if not on `device` (CPU offload: host
    memory, the buffers still on `device`). `loaded`: canonical names of parameters a
    checkpoint will overwrite (init_from); a module holding only such parameters is left
    uninitialised, which spares a full-size scratch copy of each (a 128k-vocabulary
    embedding's is gigabytes).
    """
    model.to_empty(device=param_device or device)
    if param_device is not None and param_device != device:
        for module in model.modules():
            for bname, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[bname] = buf.to(device)
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params and not any(True for _ in module.buffers(recurse=False)):
            continue
        prefix = canonical_name(name) + "." if name else ""
        if (params and all(prefix + p in loaded for p in params)
                and not any(True for _ in module.buffers(recurse=False))):
            continue
        full = seeded_init(model, name, module, seed, init, param_device or device, device)
        for pname, p in params.items():
            if isinstance(p, DTensor):
                # src_data_rank=None: every rank computed the same full tensor, so each
                # slices out its own shard without communication.
                local = distribute_tensor(full[pname], p.device_mesh, p.placements,
                                          src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.data.copy_(full[pname])


def seeded_init(model: nn.Module, name: str, module: nn.Module, seed: int, init: InitFn,
                device: torch.device, compute: torch.device | None = None) -> dict[str, torch.Tensor]:
    """`module`'s own parameters initialised full-size on `device` under the seed of its
    canonical name: what every rank, and `ckpt export` for a frozen weight, compute alike.
    Its registered parameters are left as they were; returns the full tensors by name.
    (`compute`: a CUDA device whose RNG the job's init may also draw from.)"""
    kept = dict(module.named_parameters(recurse=False))
    for pname, p in kept.items():
        module._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                 requires_grad=p.requires_grad)
    rng = [d for d in (compute, device) if d is not None and d.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=rng):
            cname = canonical_name(name)
            torch.manual_seed(module_seed(seed, cname))
            init(model, cname, module)
        return {pname: module._parameters[pname].data for pname in kept}  # type: ignore[union-attr]
    finally:
        for pname, p in kept.items():
            module._parameters[pname] = p


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters, their gradients and the optimizer state
    (the sharded local tensors: what `hpcshard plan` predicts)."""
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for state in optimizer.state.values()
                         for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0),
    }
