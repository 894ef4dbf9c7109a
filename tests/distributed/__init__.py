"""Multi-rank tests: torchrun on CPU/gloo. The workers (`*_worker.py`) run as scripts."""

from __future__ import annotations

from collections.abc import Callable


def run_worker(main: Callable[[], None]) -> None:
    """A worker script's entry: `main`, then its process group destroyed, whatever happened."""
    import torch.distributed as dist

    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
