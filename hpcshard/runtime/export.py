"""`hpcshard ckpt export`: a sharded DCP checkpoint -> one full state dict that a plain,
single-process model loads with `load_state_dict` (for inference or another framework).

Runs in one process without a process group: DCP reads every shard and reassembles full
tensors. Only the model is read, not the optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from hpcshard.config import build_config
from hpcshard.rundir import store
from hpcshard.rundir.spec import RunSpec
from hpcshard.runtime.blocks import on_meta
from hpcshard.runtime.job import load_job

FORMATS = (".safetensors", ".pt", ".pth", ".bin")


def export(run_dir: Path, step: int | None, out: Path) -> store.Checkpoint:
    if out.suffix not in FORMATS:
        raise ValueError(f"--out {str(out)!r}: unknown format; end it in one of {', '.join(FORMATS)}")
    if out.exists():
        raise ValueError(f"--out {str(out)!r} exists; choose a new file (nothing is overwritten)")
    ckpt, _ = store.select(run_dir / store.CHECKPOINTS, "auto" if step is None else str(step))
    if ckpt is None:
        raise ValueError(f"no committed checkpoint in {run_dir / store.CHECKPOINTS}")
    store.check_safe(ckpt)
    spec = RunSpec.read(run_dir)
    job = load_job(spec.job)
    cfg = build_config(job.config, spec.sets)
    with on_meta():
        model = job.model(cfg)
    model.to_empty(device="cpu")  # every saved tensor is overwritten by the load
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt.path))
    tensors = {k: v.contiguous() for k, v in state["model"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("writing .safetensors needs the safetensors package (pip install "
                             "'hpcshard[hf]' or pip install safetensors); or export to a .pt file") from None
        save_file(tensors, str(out), metadata={"step": str(ckpt.step)})
    else:
        torch.save(tensors, out)
    return ckpt
