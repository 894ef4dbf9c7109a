"""The background loader on CUDA: its batches are pinned, copied without blocking, and the
same as the synchronous path's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hpcshard.runtime.corpus import load_blend
from hpcshard.runtime.data import GlobalBatches
from tests.unit.test_runtime_corpus import write_corpus


def test_prefetched_batches_are_pinned_and_the_same_on_the_device(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    write_corpus(tmp_path / "web", [rng.integers(1, 256, 200).tolist() for _ in range(60)])
    blend = load_blend(str(tmp_path / "web"))
    assert blend is not None
    args = dict(seq_len=64, batch_size=8, micro=4, rank=0, world=1, seed=0)
    sync = GlobalBatches(blend, **args)  # type: ignore[arg-type]
    ahead = GlobalBatches(blend, **args, prefetch=2, pin=True)  # type: ignore[arg-type]
    device = torch.device("cuda", 0)
    for _ in range(5):
        prepared = ahead.next()
        assert all(x.is_pinned() and y.is_pinned() for x, y in prepared)
        on_device = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in prepared]
        for (x, y), (u, v) in zip(sync.next(), on_device, strict=True):
            assert torch.equal(x, u.cpu()) and torch.equal(y, v.cpu())
    ahead.close()
