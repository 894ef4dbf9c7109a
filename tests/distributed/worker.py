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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
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
    w = t.blocks[0].get_parameter("_checkpoint_wrapped_module.attn.q.weight" if t.cfg.ac != "none"
                                  else "attn.q.weight")
    assert isinstance(w, DTensor)
    return {"placements": [repr(p) for p in w.placements], "mesh": list(w.device_mesh.shape),
            "mesh_dims": list(w.device_mesh.mesh_dim_names or ()),
            "local_rows": w.to_local().shape[0], "rows": w.shape[0]}


@dataclass(frozen=True)
class Call:
    """One collective as FSDP2 issued it: which op, over which ranks, on which dtypes."""

    op: str
    ranks: tuple[int, ...]
    dtypes: tuple[str, ...]


# The collectives FSDP2 (torch 2.13) calls, each as `dist.<name>(...)` looked up at call
# time, so replacing the module attribute sees every call. DTensor's own reductions (the
# global grad norm) go through functional collectives and are not seen, which is wanted.
# If a torch upgrade renames them, the counts drop to 0 and the tests fail loudly.
# torch 2.9 to 2.12 name them all_gather_into_tensor and reduce_scatter_tensor: each is
# spied under the name 2.13 uses (the op names the tests count).
SPIED = {"all_reduce": "all_reduce",
         "reduce_scatter_single": "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
         else "reduce_scatter_tensor",
         "all_gather_single": "all_gather_single" if hasattr(dist, "all_gather_single")
         else "all_gather_into_tensor"}


@contextmanager
def spying() -> Iterator[list[Call]]:
    """Record every spied collective issued inside the block, on this rank."""
    calls: list[Call] = []
    real = {name: getattr(dist, attr) for name, attr in SPIED.items()}

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        ranks = tuple(dist.get_process_group_ranks(group) if group is not None
                      else range(dist.get_world_size()))
        dtypes = tuple(str(a.dtype) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        calls.append(Call(name, ranks, dtypes))
        return real[name](*args, **kwargs)

    for name, attr in SPIED.items():
        setattr(dist, attr, partial(spy, name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, SPIED[name], fn)


def count(calls: list[Call], op: str, ranks: tuple[int, ...] | None = None) -> int:
    return sum(c.op == op and (ranks is None or c.ranks == ranks) for c in calls)


def replicate_ranks(rank: int) -> tuple[int, ...]:
    """The cross-node group of `rank` on the 2x2 mesh: the same shard on both nodes."""
    return (rank % 2, rank % 2 + 2)


def unsharded(params: Iterable[nn.Parameter]) -> bool:
    """FSDP2 swaps a module's DTensor shards for plain full tensors while it is unsharded
    (all-gathered) and swaps the shards back when it reshards."""
    return not any(isinstance(p, DTensor) for p in params)


def observe_reshard(t: Trainer) -> dict[str, Any]:
    """One step, observed between forward and backward: which blocks (and the root) are
    still unsharded, and how many all-gathers the backward had to issue again."""
    seen: dict[str, Any] = {}
    with spying() as calls:
        def after_forward(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            # Registered after fully_shard's own post-forward hook, so it runs after any
            # reshard: exactly what the backward will find.
            seen["blocks_unsharded"] = [unsharded(b.parameters()) for b in t.blocks]
            in_blocks = {id(p) for b in t.blocks for p in b.parameters()}
            seen["root_unsharded"] = unsharded(p for p in t.model.parameters()
                                               if id(p) not in in_blocks)
            seen["forward_gathers"] = count(calls, "all_gather_single")

        handle = t.model.register_forward_hook(after_forward)
        loss, _ = t.train_step()
        handle.remove()
    seen["backward_gathers"] = count(calls, "all_gather_single") - seen["forward_gathers"]
    gathers = [c for c in calls if c.op == "all_gather_single"]
    seen["backward_group_sizes"] = sorted({len(c.ranks) for c in gathers[seen["forward_gathers"]:]})
    seen["loss"] = t.mean_over_ranks(loss)
    return seen


def gathers_before_block_1(t: Trainer) -> int:
    """All-gathers issued in one step before block 1's forward begins (before FSDP's own
    pre-forward hook of it): the root's and block 0's, plus whatever was prefetched."""
    seen: list[int] = []
    with spying() as calls:
        handle = t.blocks[1].register_forward_pre_hook(
            lambda *_: seen.append(count(calls, "all_gather_single")), prepend=True)
        t.train_step()
        handle.remove()
    return seen[0]


def output_dtype(t: Trainer) -> str:
    seen: list[str] = []
    handle = t.model.register_forward_hook(partial(record_dtype, seen))
    t.train_step()
    handle.remove()
    return seen[0]


def local_shards(t: Trainer) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
            for p in t.params]


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def record_grad_dtypes(t: Trainer, seen: set[str]) -> None:
    """Note the sharded gradients' dtypes just before each step clears them."""
    clear: Callable[..., None] = t.model.zero_grad  # (the trainer clears every parameter's)

    def zero_grad(*args: Any, **kwargs: Any) -> None:
        seen.update(str(p.grad.dtype) for p in t.params if p.grad is not None)
        clear(*args, **kwargs)

    t.model.zero_grad = zero_grad  # type: ignore[method-assign]  # this instance only


def reduce_dtypes(t: Trainer) -> list[str]:
    """The reduce dtype each FSDP module was given (FSDP2 has no public getter for it)."""
    return sorted({str(m._get_fsdp_state()._mp_policy.reduce_dtype)
                   for m in t.model.modules() if isinstance(m, FSDPModule)})


def overflow_step(t: Trainer) -> dict[str, Any]:
    """Force an fp16 overflow (a loss scale of 2**40 turns the fp16 gradients to inf) and
    check the scaler's answer: skip the optimizer step and halve the scale."""
    assert t.scaler is not None
    t.scaler.update(new_scale=2.0**40)  # the public way to set the scale
    before = local_shards(t)
    _, norm = t.train_step()
    return {"scale_before": 2.0**40, "scale_after": float(t.scaler.get_scale()),
            "norm_finite": bool(torch.isfinite(norm).item()),
            "params_unchanged": same_tensors(before, local_shards(t))}


def accumulation(t: Trainer, rank: int) -> dict[str, Any]:
    """4 steps of `accum` micro-batches on HSDP, counting the collectives: reduce-scatters
    inside the node and all-reduces across nodes; then one more step with the trainer's
    once-per-step switch disabled, for the count it saves."""
    steps = 4
    with spying() as calls:
        out: dict[str, Any] = {"accum": t.accum, "mode": t.mode, "steps": steps,
                               "losses": losses(t, steps)}
    fsdp_modules = sum(isinstance(m, FSDPModule) for m in t.model.modules())
    out |= {"fsdp_modules": fsdp_modules, "reduce_scatters": count(calls, "reduce_scatter_single"),
            "cross_node": count(calls, "all_reduce", replicate_ranks(rank))}
    # With FSDPModule.set_requires_all_reduce a no-op (it was left True by the last
    # micro-batch), every micro-batch's backward all-reduces, as without the trainer's switch.
    with patch.object(t.model, "set_requires_all_reduce", lambda *_a, **_k: None), \
            spying() as calls:
        t.train_step()
    out["cross_node_without_switch"] = count(calls, "all_reduce", replicate_ranks(rank))
    return out


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


def init_hash(t: Trainer) -> float:
    return sum(float(v.double().sum()) for v in full_state(t).values())


def compiled(t: Trainer) -> dict[str, Any]:
    """Losses of 4 compiled steps, and proof that inductor ran them: every block compiled,
    graphs captured with no break, inductor's graph cache asked (hit or miss)."""
    from torch._dynamo.utils import counters

    counters.clear()
    out: dict[str, Any] = {"losses": losses(t, 4)}
    return out | {"compiled": all(b._compiled_call_impl is not None for b in t.blocks),
                  "graphs": counters["stats"]["unique_graphs"],
                  "breaks": sum(counters["graph_break"].values()),
                  "inductor": counters["inductor"]["fxgraph_cache_hit"]
                  + counters["inductor"]["fxgraph_cache_miss"]}


@contextmanager
def logits_layout(t: Trainer) -> Iterator[dict[str, Any]]:
    """What the model's head hands the loss in the steps inside the block: its type,
    placements and local vocabulary (a tp=2 step costs seconds: no step of its own)."""
    seen: dict[str, Any] = {}

    def hook(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        seen.update(dtensor=isinstance(out, DTensor), local_vocab=out.to_local().shape[-1]
                    if isinstance(out, DTensor) else out.shape[-1], vocab=out.shape[-1],
                    placements=[repr(p) for p in out.placements] if isinstance(out, DTensor) else [])

    handle = t.model.get_submodule("head").register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def chosen_shard(env: Any) -> dict[str, Any]:
    """The four ranks as 4 nodes x 1 rank with shard=2: a shard group spans two nodes and
    is replicated on the other two. 4 steps, its collectives counted by group."""
    from hpcshard.sections import Parallel

    nodes4 = replace(env, per_node=1)
    t = trainer(nodes4, shard="2")
    degrees = Parallel(nodes=4, per_node=1, shard=2)
    with spying() as calls:
        out: dict[str, Any] = {**placements(t), "mode": t.mode, "losses": losses(t, 4)}
    shard_group, replicas = degrees.shard_group(env.rank), degrees.replica_group(env.rank)
    return out | {"shard_group": list(shard_group), "replica_group": list(replicas),
                  "gathers": count(calls, "all_gather_single"),
                  "gathers_in_shard_group": count(calls, "all_gather_single", shard_group),
                  "all_reduces_across_replicas": count(calls, "all_reduce", replicas),
                  "all_placed": all_block_params_placed(t, (Replicate(), Shard(0)))}


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed()
    if env.world == 4:  # emulate 2 nodes x 2 ranks inside one torchrun
        env = replace(env, per_node=2)
    facts: dict[str, Any] = {"world": env.world}

    base = trainer(env)
    facts["init_hash"] = init_hash(base)
    facts["ref_norms"] = []
    facts["ref_losses"] = losses(base, 4, facts["ref_norms"])
    if env.world == 1:
        if env.is_main:
            out.write_text(json.dumps(facts))
        return
    facts["hybrid"] = placements(base)
    facts["hybrid_all_placed"] = all_block_params_placed(base, (Replicate(), Shard(0)))
    facts["replicas_identical"] = replicas_identical(base)
    facts["blocks_auto"] = [type(b).__name__ for b in base.blocks]

    for mode in ("full", "grad-op", "none"):
        t = trainer(env, sharding=mode)
        facts[mode] = placements(t)
        if mode == "none":
            facts[mode]["losses"] = losses(t, 2)
        else:  # the first of the two steps is the observed one
            seen = observe_reshard(t)
            facts[mode]["losses"] = [seen.pop("loss"), *losses(t, 1)]
            facts[mode]["after_forward"] = seen
    for precision in ("bf16", "fp16"):
        t = trainer(env, precision=precision)
        dtypes: list[str] = []  # the dtype a block computes in (sharded params stay fp32)
        t.blocks[0].register_forward_hook(partial(record_dtype, dtypes))
        grad_dtypes: set[str] = set()
        record_grad_dtypes(t, grad_dtypes)
        before = local_shards(t)
        with spying() as calls:
            facts[precision] = {"losses": losses(t, 2), "compute_dtype": dtypes[0],
                                "master_dtype": str(t.blocks[0].get_parameter("attn.q.weight").dtype)}
        facts[precision] |= {
            "reduce_dtypes": reduce_dtypes(t), "grad_dtypes": sorted(grad_dtypes),
            "reduce_scatter_dtypes": sorted({d for c in calls if c.op == "reduce_scatter_single"
                                             for d in c.dtypes}),
            "cross_node_dtypes": sorted({d for c in calls if c.op == "all_reduce"
                                         and c.ranks == replicate_ranks(env.rank) for d in c.dtypes}),
            "trained": not same_tensors(before, local_shards(t))}
        if precision == "fp16":
            facts[precision]["overflow"] = overflow_step(t)
    for ac in ("full", "2"):
        t = trainer(env, ac=ac)
        wrapped = [type(b).__name__ for b in t.blocks]
        facts[f"ac_{ac}"] = {"losses": losses(t, 4), "wrapped": wrapped}
    t = trainer(env, block="Block")
    facts["block_named"] = len(t.blocks)
    t = trainer(env, block_min_params="2000")
    facts["block_min_params"] = [type(b).__name__ for b in t.blocks]
    t = trainer(env, micro_batch_size="1")
    facts["accumulation"] = accumulation(t, env.rank)
    t = trainer(env, cpu_offload="true")
    facts["cpu_offload"] = {"losses": losses(t, 2)}
    # FSDP2's controls.
    t = trainer(env, precision="bf16", reduce_dtype="bf16")
    with spying() as calls:
        facts["reduce_bf16"] = {"losses": losses(t, 2)}
    facts["reduce_bf16"]["reduce_scatter_dtypes"] = sorted(
        {d for c in calls if c.op == "reduce_scatter_single" for d in c.dtypes})
    facts["reduce_bf16"]["cross_node_dtypes"] = sorted(
        {d for c in calls if c.op == "all_reduce" and c.ranks == replicate_ranks(env.rank) for d in c.dtypes})
    facts["output_dtype"] = {"bf16": output_dtype(trainer(env, precision="bf16")),
                             "bf16_fp32": output_dtype(trainer(env, precision="bf16", output_dtype="fp32"))}
    t = trainer(env, sharding="full", reshard_after_forward="2")
    seen = observe_reshard(t)
    facts["reshard_2"] = {"losses": [seen.pop("loss"), *losses(t, 1)], "after_forward": seen}
    facts["prefetch"] = {"0": gathers_before_block_1(trainer(env)),
                         "2": gathers_before_block_1(trainer(env, prefetch="2"))}
    t = trainer(env, prefetch="2")
    facts["prefetch"]["losses"] = losses(t, 2)
    # Tensor parallelism: 1 node x (2 shard x 2 tp), and 2 nodes x (1 shard x 2 tp).
    for name, shaped in (("tp_1x4", replace(env, per_node=4)), ("tp_2x2", env)):
        t = trainer(shaped, tp="2")
        norms: list[float] = []
        facts[name] = {**placements(t), "init_hash": init_hash(t)}
        with logits_layout(t) as logits:
            facts[name]["losses"] = losses(t, 4, norms)
        facts[name] |= {"norms": norms, "logits": logits,
                        "all_dtensors": all(isinstance(p, DTensor) for p in t.params),
                        "dp": [t.dp_rank, t.dp_world]}
    facts["shard_2_of_4_nodes"] = chosen_shard(env)
    # torch.compile (each block; inductor's C++ on CPU) on 2x2 HSDP, then with tp=2. The
    # ranks compile the same kernels: inductor's cache lets one build them, ~20 s each here.
    facts["compile_2x2"] = compiled(trainer(env, compile="true"))
    facts["compile_tp_2x2"] = compiled(trainer(env, compile="true", tp="2"))
    if env.is_main:
        out.write_text(json.dumps(facts))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker(main)
