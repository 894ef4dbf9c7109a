"""Sharding decisions that need no process group: block finding, modes, schedule."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hpcshard.config import TrainConfig
from hpcshard.runtime.blocks import canonical_name, find_blocks, module_seed, repeated_classes
from hpcshard.runtime.mesh import mesh_shape, resolve_sharding
from hpcshard.runtime.train import lr_factor
from hpcshard.sections import OptimizerSection


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 2)])  # repeats, but small
        self.layers = nn.ModuleList(Layer() for _ in range(3))


def meta_model() -> Model:
    with torch.device("meta"):
        return Model()


def test_auto_detects_the_largest_repeated_class() -> None:
    model = meta_model()
    assert repeated_classes(model) == {"Linear": 36, "Layer": 216}
    assert [type(b).__name__ for b in find_blocks(model)] == ["Layer"] * 3


def test_named_block_and_missing_name() -> None:
    model = meta_model()
    assert len(find_blocks(model, block="Linear")) == 5
    with pytest.raises(ValueError, match="block='Decoder' is not a class.*Embedding.*Layer"):
        find_blocks(model, block="Decoder")


def test_several_block_classes_children_first() -> None:
    """"Layer,Embedding,Linear": every module of those classes, a child before its parent
    (fully_shard goes bottom-up), siblings in model order."""
    chosen = [type(m).__name__ for m in find_blocks(meta_model(), block="Layer,Embedding,Linear")]
    assert chosen == ["Embedding", "Linear", "Linear"] + ["Linear", "Layer"] * 3
    with pytest.raises(ValueError, match="block='Nope' is not a class"):
        find_blocks(meta_model(), block="Layer,Nope")


def test_size_based_wraps_innermost_modules_over_the_bound() -> None:
    chosen = find_blocks(meta_model(), min_params=70)
    assert [type(m).__name__ for m in chosen] == ["Embedding", "Linear", "Linear", "Linear"]


def test_no_repeated_block_says_how_to_choose() -> None:
    with pytest.raises(ValueError, match="block=ClassName"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


@pytest.mark.parametrize("mode,nodes,want", [("auto", 2, "hybrid"), ("auto", 1, "full"),
                                             ("grad-op", 4, "grad-op")])
def test_resolve_sharding(mode: str, nodes: int, want: str) -> None:
    assert resolve_sharding(mode, nodes) == want


def test_mesh_shapes() -> None:
    assert mesh_shape("hybrid", 2, 4) == ((2, 4), ("replicate", "shard"))
    assert mesh_shape("full", 2, 4) == ((8,), ("shard",))
    assert mesh_shape("none", 2, 4) == ((8, 1), ("replicate", "shard"))


def test_tensor_parallel_is_the_innermost_dimension_inside_a_node() -> None:
    assert mesh_shape("hybrid", 2, 4, tp=2) == ((2, 2, 2), ("replicate", "shard", "tp"))
    assert mesh_shape("hybrid", 2, 4, tp=4) == ((2, 1, 4), ("replicate", "shard", "tp"))
    assert mesh_shape("full", 2, 4, tp=2) == ((4, 2), ("shard", "tp"))
    assert mesh_shape("none", 2, 4, tp=2) == ((4, 1, 2), ("replicate", "shard", "tp"))
    assert mesh_shape("full", 1, 4, tp=1) == ((4,), ("shard",))  # tp=1: as before
    with pytest.raises(ValueError, match=r"tp=3 does not divide the 4 ranks of a node; use one of 1, 2, 4"):
        mesh_shape("hybrid", 2, 4, tp=3)


def test_init_seed_ignores_wrappers() -> None:
    wrapped = "blocks.0._checkpoint_wrapped_module.attn.q"
    assert canonical_name(wrapped) == "blocks.0.attn.q"
    assert module_seed(0, canonical_name(wrapped)) == module_seed(0, "blocks.0.attn.q")
    assert module_seed(0, "a") != module_seed(1, "a")


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(s, OptimizerSection.of(cfg)) for s in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))


def test_offloaded_parameters_live_on_the_host_whatever_the_compute_device(world_of_one: None) -> None:
    """CPU offload: FSDP2 refuses offloaded parameters anywhere but in host memory, so they
    are materialised on the CPU while the buffers go to the compute device (here the meta
    device stands in for a GPU: without param_device the parameters would land there)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpcshard.runtime.shard import ShardPlan, materialize, shard_model

    class WithBuffer(Model):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(8))

    with torch.device("meta"):
        model = WithBuffer()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    shard_model(model, mesh, ShardPlan(mode="full", cpu_offload=True))
    materialize(model, torch.device("meta"), seed=0, param_device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.scale.device.type == "meta"


@pytest.mark.parametrize("reshard,last,want", [("auto", False, True), ("auto", True, False),
                                              ("false", False, False), ("true", True, True),
                                              ("4", False, 4)])
def test_reshard_after_forward_choices(reshard: str, last: bool, want: bool | int) -> None:
    from hpcshard.runtime.shard import ShardPlan

    assert ShardPlan(mode="hybrid", reshard=reshard).reshard_after_forward(last) == want
    assert ShardPlan(mode="grad-op").reshard_after_forward(False) is False


def test_a_jobs_shard_hook_takes_over_sharding(world_of_one: None) -> None:
    """Job(shard=...) is called instead of hpcshard's wrapping, with the run's plan: here it
    shards the embeddings as blocks of their own too."""
    import sysconfig
    from dataclasses import replace
    from pathlib import Path

    from hpcshard.config import build_config
    from hpcshard.runtime.device import DistEnv
    from hpcshard.runtime.job import load_job
    from hpcshard.runtime.shard import ShardPlan, shard_model
    from hpcshard.runtime.train import Trainer

    root = Path(__file__).resolve().parents[2]
    plans: list[ShardPlan] = []

    def shard(cfg: object, model: nn.Module, mesh: object, plan: ShardPlan) -> list[nn.Module]:
        plans.append(plan)
        return shard_model(model, mesh, replace(plan, block="Block,Embedding"))  # type: ignore[arg-type]

    job = replace(load_job(str(root / "jobs" / "charlm.py")), shard=shard)
    cfg = build_config(job.config, {"dim": "32", "n_heads": "2", "n_layers": "2", "seq_len": "16",
                                    "batch_size": "2", "prefetch": "1",
                                    "data": str(Path(sysconfig.get_paths()["stdlib"]) / "json")})
    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    t = Trainer(job, cfg, env, None)
    assert len(plans) == 1 and plans[0].prefetch == 1
    assert [type(b).__name__ for b in t.blocks] == ["FSDPEmbedding"] * 2 + ["FSDPBlock"] * 2
