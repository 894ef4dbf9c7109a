"""The same checkpoints for your own training loop: `save_checkpoint` / `load_checkpoint`
(exact resume with `hpcshard.preemption`; they work under a plain torchrun too)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpcshard.rundir import store
from hpcshard.rundir.spec import trusted_gid
from hpcshard.runtime.checkpoint.io import written_by_dcp
from hpcshard.runtime.checkpoint.state import rng_state, set_rng_state


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a checkpoint of your own loop holds: the model (and optimizer) as DCP state
    dicts (sharded, any mesh), and this rank's RNG under a per-rank key."""
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    state[f"rng.rank{rank}"] = rng_state(_device_of(model))
    return state


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None, keep_last: int = 2) -> Path:
    """Save `step` under ROOT/step-N, on every rank together (collective).

    The shards go into step-N.tmp; once every rank has written, rank 0 checks every file
    DCP's `.metadata` names, adds a manifest (with `extra`: JSON values such as the epoch
    or the data position, rank 0's copy), renames it into place, fsyncs and keeps the
    newest `keep_last`. A crash mid-save leaves a .tmp that `load_checkpoint` never reads.
    Returns the committed directory; raises RuntimeError on every rank when the commit
    failed (a file missing or short, the file system's error), older checkpoints intact.
    """
    root = Path(root)
    tmp = root / (store.step_name(step) + store.TMP_SUFFIX)
    final = root / store.step_name(step)
    main = not dist.is_initialized() or dist.get_rank() == 0
    done = [final.is_dir()]  # saved already (a periodic save, then the notice)
    if main and not done[0]:
        root.mkdir(parents=True, exist_ok=True, mode=0o750)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o750)
    if dist.is_initialized():
        dist.broadcast_object_list(done, src=0)  # rank 0's view of the shared directory
    if done[0]:
        return final
    start = time.perf_counter()
    dcp.save(_local_state(model, optimizer), checkpoint_id=str(tmp))
    failed = [""]
    if main:
        try:
            store.commit(tmp, step, {"world": dist.get_world_size() if dist.is_initialized() else 1,
                                     "extra": json.loads(json.dumps(extra or {})),
                                     "torch": torch.__version__,
                                     "save_seconds": round(time.perf_counter() - start, 3)},
                         keep_last, least=written_by_dcp(tmp))
        except (OSError, store.Incomplete) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = [f"checkpoint at step {step} NOT committed ({err}); earlier checkpoints "
                      "are intact"]
    if dist.is_initialized():
        # Nobody trains on (or exits) before the checkpoint is committed, and every rank
        # learns whether it was (an error raised on rank 0 alone would leave the others
        # waiting in the next collective).
        dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        raise RuntimeError(failed[0])
    return final


def _trusted() -> int | None:
    """The group whose checkpoint files load (the run's run_group), under hpcshard's
    launcher; under a plain torchrun, none: only the user's own files."""
    run_dir = os.environ.get("HPCSHARD_RUN_DIR")
    return trusted_gid(Path(run_dir)) if run_dir else None


def load_checkpoint(root: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    step: int | None = None) -> dict[str, Any] | None:
    """Load the newest committed checkpoint under ROOT (or `step`) into the model and the
    optimizer, on every rank together; restores this rank's RNG. Returns {"step": N,
    "extra": {...}}, or None when ROOT holds no committed checkpoint (a fresh start).

    Rank 0 picks the checkpoint and tells the others (another host's listing of shared
    storage can lag); incomplete and damaged ones are skipped.
    """
    root = Path(root)
    choice: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        ckpt, _ = store.select(root, "auto" if step is None else str(step))
        if ckpt is not None:
            store.check_safe(ckpt, _trusted())
            choice = [(str(ckpt.path), ckpt.step, ckpt.manifest.get("extra", {}),
                       int(ckpt.manifest.get("world", 1)))]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path, found, extra, saved_world = choice[0]
    state = _local_state(model, optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank >= saved_world:  # no RNG was saved for this rank (a larger world now)
        state.pop(f"rng.rank{rank}")
    dcp.load(state, checkpoint_id=path)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    if f"rng.rank{rank}" in state:
        set_rng_state(state[f"rng.rank{rank}"], _device_of(model))
    return {"step": found, "extra": extra, "path": path}
