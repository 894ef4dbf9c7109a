"""Sharding decisions that need no process group: block finding, modes, schedule."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hpcshard.config import TrainConfig
from hpcshard.runtime.blocks import canonical_name, find_blocks, module_seed, repeated_classes
from hpcshard.runtime.mesh import mesh_shape, resolve_sharding
from hpcshard.runtime.train import lr_factor


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
    factors = [lr_factor(s, cfg) for s in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
