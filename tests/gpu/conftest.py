"""The GPU layer: what CPU ranks cannot show (CUDA, NCCL, pinned memory, Triton). Every test
here skips, with the reason, where torch sees no CUDA device; run it alone with
`python -m pytest tests/gpu -n 0` on a machine with one GPU."""

from __future__ import annotations

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
