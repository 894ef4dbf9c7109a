"""The GPU layer: what CPU ranks cannot show (CUDA, NCCL, pinned memory, Triton, the
allocator's own figures, profiles). Every test skips, with the reason, where torch sees no
CUDA device. On a machine with one GPU: `python -m pytest tests/gpu -n 4`, or
`bash bench/gpu_device.sh` for the suite and `python -m bench gpu` with their results in
one folder (docs/user/gpu.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import os

    # (asked of the CUDA runtime, the question would poison any later fork of pytest itself)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if torch.cuda.is_available():
        return
    why = pytest.mark.skip(reason=f"no CUDA device (torch {torch.__version__}): the gpu layer needs one GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(why)


@pytest.fixture
def cuda_world() -> Iterator[object]:
    """A 1-rank NCCL process group in this process on GPU 0 (no rendezvous): the DistEnv a
    Trainer built here takes. The in-process tests read the allocator and the parameters'
    placement, which a run's subprocess keeps to itself."""
    import torch
    import torch.distributed as dist

    from hpcshard.runtime.device import DistEnv

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=device, backend="nccl")
    finally:
        dist.destroy_process_group()
