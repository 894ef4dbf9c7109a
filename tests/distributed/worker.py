"""Multi-rank scenarios for the dist tests, run as `torchrun --nproc_per_node=4 worker.py OUT`
(or plain `python worker.py OUT` for the 1-rank reference).

A torchrun start costs 5-9 s here, so one launch runs every scenario on the same process
group and rank 0 writes the facts to OUT as JSON; the pytest side asserts on them.
Four ranks are treated as 2 nodes x 2 ranks (per_node=2), the shape HSDP needs.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hpcshard.config import build_config  # noqa: E402
from hpcshard.runtime.device import init_distributed  # noqa: E402
from hpcshard.runtime.job import load_job  # noqa: E402
from hpcshard.runtime.train import Trainer  # noqa: E402

JOB = load_job(str(ROOT / "jobs" / "charlm.py"))
DATA = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
BASE = {"dim": "32", "n_layers": "3", "n_heads": "2", "seq_len": "32", "batch_size": "8",
        "warmup_steps": "2", "steps": "4", "log_every": "1", "eval_every": "0", "data": DATA}


def trainer(env: Any, **sets: str) -> Trainer:
    return Trainer(JOB, build_config(JOB.config, {**BASE, **sets}), env, None)


def losses(t: Trainer, steps: int, norms: list[float] | None = None) -> list[float]:
    out = []
    for _ in range(steps):
        loss, norm = t.train_step()
        out.append(t.mean_over_ranks(loss))
        if norms is not None:
            norms.append(norm.item())
    return out


def placements(t: Trainer) -> dict[str, Any]:
    """Placements, mesh shape and local/global rows of one block weight."""
    w = t.blocks[0].get_parameter("_checkpoint_wrapped_module.qkv.weight" if t.cfg.ac != "none"
                                  else "qkv.weight")
    assert isinstance(w, DTensor)
    return {"placements": [repr(p) for p in w.placements], "mesh": list(w.device_mesh.shape),
            "mesh_dims": list(w.device_mesh.mesh_dim_names or ()),
            "local_rows": w.to_local().shape[0], "rows": w.shape[0]}


def record_dtype(seen: list[str], _module: Any, _inputs: Any, output: torch.Tensor) -> None:
    seen.append(str(output.dtype))


def all_block_params_placed(t: Trainer, want: tuple[Any, ...]) -> bool:
    return all(isinstance(p, DTensor) and tuple(p.placements) == want
               for b in t.blocks for p in b.parameters())


def replicas_identical(t: Trainer) -> bool:
    """Ranks r and r+2 hold the same shard: compare every local tensor across the mesh."""
    ok = torch.ones((), dtype=torch.int32)
    for p in t.model.parameters():
        local = p.to_local().contiguous()  # type: ignore[attr-defined]
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        if not (torch.equal(gathered[0], gathered[2]) and torch.equal(gathered[1], gathered[3])):
            ok.zero_()
    return bool(ok.item())


def full_state(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in t.model.state_dict().items()}


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed()
    if env.world == 4:  # emulate 2 nodes x 2 ranks inside one torchrun
        env = replace(env, per_node=2)
    facts: dict[str, Any] = {"world": env.world}

    base = trainer(env)
    facts["init_hash"] = sum(float(v.double().sum()) for v in full_state(base).values())
    facts["ref_norms"] = []
    facts["ref_losses"] = losses(base, 4, facts["ref_norms"])
    if env.world == 1:
        # torch.compile costs ~40 s cold on this CPU: run it once, on one rank.
        t = trainer(env, compile="true")
        facts["compile"] = {"losses": losses(t, 4),
                            "compiled": all(b._compiled_call_impl is not None for b in t.blocks)}
        if env.is_main:
            out.write_text(json.dumps(facts))
        return
    facts["hybrid"] = placements(base)
    facts["hybrid_all_placed"] = all_block_params_placed(base, (Replicate(), Shard(0)))
    facts["replicas_identical"] = replicas_identical(base)
    facts["blocks_auto"] = [type(b).__name__ for b in base.blocks]

    for mode in ("full", "grad-op", "none"):
        t = trainer(env, sharding=mode)
        facts[mode] = {**placements(t), "losses": losses(t, 2)}
    for precision in ("bf16", "fp16"):
        t = trainer(env, precision=precision)
        seen: list[str] = []  # the dtype a block computes in (sharded params stay fp32)
        t.blocks[0].register_forward_hook(partial(record_dtype, seen))
        facts[precision] = {"losses": losses(t, 2), "compute_dtype": seen[0],
                            "master_dtype": str(t.blocks[0].get_parameter("qkv.weight").dtype)}
        if precision == "fp16":
            assert t.scaler is not None
            facts[precision]["scale"] = float(t.scaler.get_scale())
    for ac in ("full", "2"):
        t = trainer(env, ac=ac)
        wrapped = [type(b).__name__ for b in t.blocks]
        facts[f"ac_{ac}"] = {"losses": losses(t, 4), "wrapped": wrapped}
    t = trainer(env, block="Block")
    facts["block_named"] = len(t.blocks)
    t = trainer(env, block_min_params="2000")
    facts["block_min_params"] = [type(b).__name__ for b in t.blocks]
    t = trainer(env, micro_batch_size="1")
    facts["accumulation"] = {"accum": t.accum, "losses": losses(t, 4)}
    t = trainer(env, cpu_offload="true")
    facts["cpu_offload"] = {"losses": losses(t, 2)}
    if env.is_main:
        out.write_text(json.dumps(facts))


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
