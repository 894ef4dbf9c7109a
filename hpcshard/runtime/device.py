"""Device and collective backend: chosen here and nowhere else.

cuda:LOCAL_RANK + nccl where GPUs exist, cpu + gloo otherwise. The rest of the runtime
takes `DistEnv.device` and stays device-agnostic; the CUDA branch is kept this thin
because CI has no GPU to run it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this rank sits. Filled from torchrun's environment (RANK, LOCAL_RANK, ...)."""

    rank: int
    world: int
    local_rank: int
    per_node: int
    device: torch.device
    backend: str

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def fused_optimizer(device: torch.device, params_on_host: bool = False, scaled: bool = False) -> bool:
    """Whether AdamW runs as one fused kernel (`fused=True`) rather than `foreach`: on CUDA,
    where the fused kernel is the fastest and FSDP2's DTensor parameters support it. Not on
    CPU (foreach, as before: the same numbers bit for bit), nor with CPU offload, whose
    parameters and optimizer state live in host memory, nor under fp16's gradient scaler
    (`scaled`): the sharded scaler's found_inf is (1,)-shaped and the fused step's counters
    0-d, and its first step fails (pytorch issue 140514)."""
    return device.type == "cuda" and not params_on_host and not scaled


FP8_CAPABILITY = (8, 9)
"""The first NVIDIA compute capability with float8 tensor cores (Ada; Hopper is 9.0):
`torch._scaled_mm` refuses float8 operands below it."""


def fp8_support(device: torch.device) -> str:
    """"" where this rank's device multiplies in float8 (`float8=true`), else why not, in
    one line."""
    if device.type != "cuda":
        return fp8_refusal(device.type)
    return fp8_refusal("cuda", torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))


def fp8_refusal(kind: str, capability: tuple[int, int] = (0, 0), name: str = "") -> str:
    """The decision of `fp8_support`, on what was asked of the device."""
    need = f"NVIDIA GPUs of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later (Ada, Hopper)"
    if kind != "cuda":
        return f"float8=true needs {need}; the ranks here run on {kind}, which has no float8 matmul"
    if capability < FP8_CAPABILITY:
        return (f"float8=true needs {need}; this {name or 'GPU'} has capability "
                f"{capability[0]}.{capability[1]}, without float8 tensor cores")
    return ""


def collective_device() -> torch.device:
    """Where a tensor for a collective on the default group must live, for a process
    group someone else created (a script's own init_process_group): its backend decides."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed() -> DistEnv:
    """Join the process group torchrun describes; a plain `python` run is a world of 1."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device, backend = pick_device(local_rank)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:  # single process without torchrun: an in-memory store is enough
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(rank=rank, world=world, local_rank=local_rank, per_node=per_node,
                   device=device, backend=backend)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on GPUs, resident-set peak on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# Dense bf16 peak TFLOP/s per device, for MFU. Unknown devices (and CPUs) report no MFU
# unless the job sets peak_tflops.
PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0,
               "L40S": 362.0, "A10G": 125.0, "V100": 125.0, "MI300X": 1307.0}


def device_peak_tflops(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
