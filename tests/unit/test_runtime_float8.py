"""float8=true: where it is refused (the config, the device, torchao), which layers it
converts, and the preflight's part. What trains in float8 needs a GPU (tests/gpu/test_fp8.py);
torchao's emulated matmuls train the demo here where torchao is installed (the fp8 extra)."""

from __future__ import annotations

import functools
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hpcshard.config import build_config
from hpcshard.errors import UserError
from hpcshard.runtime import float8
from hpcshard.runtime.blocks import find_blocks, on_meta
from hpcshard.runtime.device import DistEnv, fp8_refusal, fp8_support
from hpcshard.runtime.job import load_job
from hpcshard.runtime.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
CHARLM = str(ROOT / "jobs" / "charlm.py")
SMALL = {"data": str(Path(sysconfig.get_paths()["stdlib"]) / "json")}
FP8 = {"float8": "true", "precision": "bf16"}


@pytest.mark.parametrize("kind,capability,name,needle", [
    ("cpu", (0, 0), "", "the ranks here run on cpu"),
    ("mps", (0, 0), "", "the ranks here run on mps"),
    ("cuda", (7, 0), "Tesla V100", "this Tesla V100 has capability 7.0"),
    ("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", "this NVIDIA A100-SXM4-80GB has capability 8.0"),
    ("cuda", (8, 6), "", "this GPU has capability 8.6"),
    ("cuda", (8, 9), "NVIDIA L40S", ""),
    ("cuda", (9, 0), "NVIDIA H100 80GB HBM3", ""),
    ("cuda", (10, 0), "NVIDIA B200", ""),
])
def test_the_device_decides_by_its_type_and_compute_capability(
        kind: str, capability: tuple[int, int], name: str, needle: str) -> None:
    why = fp8_refusal(kind, capability, name)
    assert (why == "") == (needle == "")
    if needle:
        assert needle in why and "compute capability 8.9 or later" in why and "\n" not in why


def test_this_hosts_cpu_has_no_float8() -> None:
    assert "run on cpu" in fp8_support(torch.device("cpu"))


@pytest.mark.parametrize("device_says,torchao,needle", [
    ("float8=true needs NVIDIA GPUs ...; the ranks here run on cpu", False, "run on cpu"),
    ("float8=true needs NVIDIA GPUs ...; the ranks here run on cpu", True, "run on cpu"),
    ("", False, "needs torchao >= 0.17 (pip install 'hpcshard[fp8]')"),
    ("", True, ""),
])
def test_the_device_is_asked_first_then_torchao(device_says: str, torchao: bool, needle: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(float8, "fp8_support", lambda _device: device_says)
    if torchao:
        monkeypatch.setattr(float8, "torchao_missing", lambda: "")
    else:  # absent whether or not this host has it: a None entry fails the import
        monkeypatch.setitem(sys.modules, "torchao", None)
        monkeypatch.setitem(sys.modules, "torchao.float8", None)
    why = float8.refusal(torch.device("cpu"))
    assert (needle in why and "\n" not in why) if needle else why == ""


@pytest.mark.parametrize("sets,needle", [
    ({"float8": "true"}, "float8=true needs precision=bf16 (float8 matmuls, bf16 elsewhere), not "
                         "precision=fp32; add --set precision=bf16"),
    ({"float8": "true", "precision": "fp16"}, "not precision=fp16"),
    ({**FP8, "tp": "2"}, "float8=true with tp=2: a job's tp_plan splits plain Linear layers, not "
                         "torchao's float8 ones; use tp=1"),
    ({**FP8, "cpu_offload": "true"}, "float8=true with cpu_offload=true: "),
    ({**FP8, "lora_rank": "8"}, "float8=true with lora_rank=8: "),
    ({"precision": "fp8"}, "precision='fp8' is not valid: float8 training is --set float8=true with "
                           "--set precision=bf16 (float8 matmuls in the blocks, bf16 elsewhere)"),
    ({"precision": "FLOAT8"}, "precision='FLOAT8' is not valid: float8 training is --set float8=true"),
    ({"precision": "fp64"}, "precision='fp64' is not valid; choose one of: fp32, bf16, fp16"),
    ({**FP8, "float8": "false", "tp": "2", "precision": "fp32"}, ""),
    (FP8, ""),
    ({**FP8, "compile": "true", "ac": "selective", "sharding": "hybrid"}, ""),
])
def test_the_config_takes_float8_with_bf16_alone(sets: dict[str, str], needle: str) -> None:
    job = load_job(CHARLM)
    if not needle:
        assert build_config(job.config, sets).float8 == (sets.get("float8") == "true")
        return
    with pytest.raises(UserError) as err:
        build_config(job.config, sets)
    assert needle in str(err.value) and "\n" not in str(err.value)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.odd = nn.Linear(32, 24)  # 24: not a multiple of 16
        self.attn = nn.MultiheadAttention(32, 2)  # its out_proj is a Linear subclass read directly


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 128)  # outside the blocks, multiples of 16: kept in bf16


def test_only_the_blocks_plain_linear_layers_in_multiples_of_16_are_converted() -> None:
    model = Model()
    blocks = list(model.layers)
    take = float8.convertible(blocks)
    chosen = [name for name, m in model.named_modules() if take(m, name)]
    assert chosen == ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]
    assert float8.count(model, blocks) == 4


def test_a_model_with_nothing_to_convert_is_one_line() -> None:
    model = Model()
    with pytest.raises(UserError, match="float8=true converts no layer of this model"):
        float8.count(model, [model.get_submodule("layers.0.odd")])


def test_the_demo_converts_its_six_linear_layers_per_block_and_not_its_head() -> None:
    job = load_job(CHARLM)
    cfg = build_config(job.config, {**SMALL, **FP8})
    with on_meta():
        model = job.model(cfg)
    blocks = find_blocks(model, "", 0)
    assert float8.count(model, blocks) == 6 * len(blocks)
    assert not float8.convertible(blocks)(model.get_submodule("head"), "head")


def check(sets: dict[str, str], here: bool) -> dict:
    return preflight({"job": CHARLM, "sets": {**SMALL, **sets}, "nodes": 1, "gpus": 1, "here": here})


def test_the_preflight_refuses_float8_where_the_ranks_run_here_without_it() -> None:
    with pytest.raises(UserError, match="the ranks here run on cpu"):
        check(FP8, here=True)


def test_the_preflight_leaves_a_queued_jobs_device_to_its_ranks() -> None:
    """The login node cannot see a compute node's GPU: a Slurm job's ranks refuse at model
    build instead (`float8.convert`, a UserError: exit 2, never restarted)."""
    assert check(FP8, here=False)["config"]["float8"] is True


def test_the_preflight_refuses_a_model_with_nothing_to_convert_anywhere() -> None:
    with pytest.raises(UserError, match="converts no layer"):
        check({**FP8, "dim": "24", "n_heads": "2"}, here=False)


def test_a_rank_without_float8_refuses_at_model_build(world_of_one: None) -> None:
    from hpcshard.runtime.train import Trainer

    job = load_job(CHARLM)
    cfg = build_config(job.config, {**SMALL, **FP8, "dim": "16", "n_heads": "2", "n_layers": "2",
                                    "seq_len": "8", "batch_size": "2"})
    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(UserError, match="the ranks here run on cpu"):
        Trainer(job, cfg, env, None)


def test_emulated_float8_trains_the_demo_as_bf16_does(world_of_one: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's emulation (high-precision matmuls on float8-rounded operands) on CPU: the
    conversion, FSDP, materialisation and the step's rescale run as on a GPU."""
    pytest.importorskip("torchao.float8", reason="torchao (the fp8 extra) is not installed")
    from hpcshard.runtime.train import Trainer

    monkeypatch.setattr(float8, "convert", functools.partial(float8.convert, emulate=True))
    job = load_job(CHARLM)
    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    losses = {}
    for on in ("true", "false"):
        cfg = build_config(job.config, {**SMALL, **FP8, "float8": on, "dim": "64", "n_heads": "2",
                                        "n_layers": "2", "seq_len": "32", "batch_size": "8"})
        trainer = Trainer(job, cfg, env, None)
        kinds = {type(m).__name__ for m in trainer.model.modules()}
        assert ("Float8Linear" in kinds) == (on == "true")
        assert type(trainer.model.head).__name__ == "Linear"  # type: ignore[union-attr]
        losses[on] = [trainer.train_step()[0].item() for _ in range(20)]
    assert losses["true"][-1] < losses["true"][0] - 1.0
    assert abs(losses["true"][-1] - losses["false"][-1]) < 0.05
