"""The loss and the gradient reduction on 4 ranks (2 nodes x 2), one torchrun launch:
`torchrun --nproc_per_node=4 loss_worker.py OUT`; rank 0 writes the facts to OUT as JSON.

A masked step (uneven masks, accumulation) on HSDP and with tensor parallelism is
compared with the loss and gradients of its whole global batch computed in one process,
on each rank, from the same parameters; `sharding=none` with accumulation is counted.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hpcshard.config import build_config  # noqa: E402
from hpcshard.runtime.data import GlobalBatches  # noqa: E402
from hpcshard.runtime.device import init_distributed  # noqa: E402
from hpcshard.runtime.train import Trainer  # noqa: E402
from tests.distributed.worker import BASE, JOB, count, spying  # noqa: E402
from tests.unit.test_runtime_train_choices import masked_data  # noqa: E402

MASKED = dataclasses.replace(JOB, data=masked_data)


def trainer(env: Any, job: Any = JOB, **sets: str) -> Trainer:
    return Trainer(job, build_config(job.config, {**BASE, "grad_clip": "0", **sets}), env, None)


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_batch(t: Trainer) -> tuple[float, list[torch.Tensor]]:
    """The loss and gradients of the next global batch, in this process alone: a plain
    (unsharded) model with the trainer's parameters, all the batch's sequences at once, the
    mean over their learnt tokens."""
    cfg = t.cfg
    model = t.job.model(cfg)
    model.load_state_dict({k: full(v) for k, v in t.model.state_dict().items()})
    b = t.batches
    everything = GlobalBatches(t.splits.train, seq_len=b.seq_len, batch_size=b.batch_size, micro=b.batch_size,
                               rank=0, world=1, seed=b.seed, targets=t.splits.train_targets,
                               order=cfg.data_order)
    everything.load_state_dict(b.state_dict())
    (x, y, *_), = everything.next()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]  # type: ignore[misc]


def masked_step(t: Trainer) -> dict[str, Any]:
    """One masked step (forward and backward, accumulated and reduced) against its whole
    batch in one process: the largest relative gradient difference and both losses."""
    want_loss, want_grads = whole_batch(t)
    got = t.mean_over_ranks(t.forward_backward(t.batches.next()))
    # Relative to the whole gradient: a key bias's gradient is zero in exact arithmetic
    # (softmax ignores it), so its own relative error is noise over noise.
    diff = sum(float((full(p.grad) - w).norm()) ** 2 for p, w in zip(t.params, want_grads, strict=True))
    norm = sum(float(w.norm()) ** 2 for w in want_grads)
    # Element by element too, with an absolute tolerance at the scale of the whole gradient
    # (a key bias's gradient, zero in exact arithmetic, is float reduction noise).
    scale = max(float(w.abs().max()) for w in want_grads)
    close = all(torch.allclose(full(p.grad), w, rtol=1e-4, atol=1e-6 * scale)
                for p, w in zip(t.params, want_grads, strict=True))
    return {"loss": got, "whole_loss": want_loss, "grad_error": (diff / norm) ** 0.5, "close": close,
            "accum": t.accum, "dp_world": t.dp_world, "mode": t.mode}


def none_accumulation(env: Any) -> dict[str, Any]:
    """sharding=none with 2 micro-batches: the all-reduce across the replicas once per step
    (on the summed gradients), and the same losses as without accumulation."""
    t = trainer(env, sharding="none", micro_batch_size="1")
    ref = trainer(env, sharding="none")
    ranks = tuple(range(env.world))
    losses, ref_losses, per_step = [], [], []
    for _ in range(2):
        with spying() as calls:
            loss, _ = t.train_step()
        per_step.append(count(calls, "all_reduce", ranks))
        losses.append(t.mean_over_ranks(loss))
        ref_losses.append(ref.mean_over_ranks(ref.train_step()[0]))
    return {"accum": t.accum, "all_reduces": per_step, "losses": losses, "ref_losses": ref_losses,
            "fsdp_modules": sum(isinstance(m, FSDPModule) for m in t.model.modules())}


def main() -> None:
    out = Path(sys.argv[1])
    env = replace(init_distributed(), per_node=2)  # 2 nodes x 2 ranks inside one torchrun
    facts: dict[str, Any] = {
        "hybrid": masked_step(trainer(env, MASKED, micro_batch_size="1")),
        "tp": masked_step(trainer(env, MASKED, micro_batch_size="1", tp="2")),
        "none": none_accumulation(env),
    }
    if env.is_main:
        out.write_text(json.dumps(facts))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker(main)
