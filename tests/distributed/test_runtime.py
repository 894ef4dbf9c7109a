"""The runtime on 4 ranks (2 nodes x 2) and on 1 rank, each started once per session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import quiet_env

WORKER = Path(__file__).with_name("worker.py")


def _run(cmd: list[str], out: Path) -> dict[str, Any]:
    proc = subprocess.run(cmd + [str(out)], env=quiet_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dist") / "facts4.json"
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                 str(WORKER)], out)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dist") / "facts1.json"
    return _run([sys.executable, str(WORKER)], out)


def test_hsdp_places_every_block_param_replicate_shard(four: dict[str, Any]) -> None:
    hybrid = four["hybrid"]
    assert hybrid["mesh_dims"] == ["replicate", "shard"] and hybrid["mesh"] == [2, 2]
    assert hybrid["placements"] == ["Replicate()", "Shard(dim=0)"]
    assert four["hybrid_all_placed"]
    assert hybrid["local_rows"] * 2 == hybrid["rows"]  # each rank holds half of each block


def test_replicas_hold_identical_values_after_training(four: dict[str, Any]) -> None:
    assert four["replicas_identical"]


def test_one_rank_and_four_ranks_agree(one: dict[str, Any], four: dict[str, Any]) -> None:
    # Initialisation does not depend on the world size: bit-for-bit the same parameters.
    assert one["init_hash"] == four["init_hash"]
    # Losses differ only by the order of floating-point reductions: 1e-5 relative.
    assert four["ref_losses"] == pytest.approx(one["ref_losses"], rel=1e-5)
    # The clipped norm is the global one over all shards (clipping is active: norm > 1).
    assert four["ref_norms"] == pytest.approx(one["ref_norms"], rel=1e-4)
    assert one["ref_norms"][0] > 1.0


def test_compiled_blocks_train_the_same(one: dict[str, Any]) -> None:
    assert one["compile"]["compiled"]
    assert one["compile"]["losses"] == pytest.approx(one["ref_losses"], rel=1e-5)


@pytest.mark.parametrize("mode,placements,mesh,split", [
    ("full", ["Shard(dim=0)"], [4], 4),
    ("grad-op", ["Shard(dim=0)"], [4], 4),
    ("none", ["Replicate()", "Shard(dim=0)"], [4, 1], 1),
])
def test_sharding_modes(four: dict[str, Any], mode: str, placements: list[str],
                        mesh: list[int], split: int) -> None:
    facts = four[mode]
    assert facts["placements"] == placements and facts["mesh"] == mesh
    assert facts["local_rows"] * split == facts["rows"]
    # Sharding changes where the bytes live, not the maths.
    assert facts["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-5)


def test_mixed_precision(four: dict[str, Any]) -> None:
    assert four["bf16"]["compute_dtype"] == "torch.bfloat16"
    assert four["fp16"]["compute_dtype"] == "torch.float16"
    for p in ("bf16", "fp16"):
        assert four[p]["master_dtype"] == "torch.float32"  # sharded master weights stay fp32
    assert four["bf16"]["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-2)
    assert four["fp16"]["losses"][0] == pytest.approx(four["ref_losses"][0], rel=1e-2)
    # The grad scaler is live: it started at 2**16 and backed off on the first overflow.
    assert 0 < four["fp16"]["scale"] <= 2.0**16


def test_activation_checkpointing_is_exact(four: dict[str, Any]) -> None:
    assert four["ac_full"]["wrapped"] == ["FSDPCheckpointWrapper"] * 3
    assert four["ac_2"]["wrapped"] == ["FSDPCheckpointWrapper", "FSDPBlock",
                                       "FSDPCheckpointWrapper"]
    assert four["ac_full"]["losses"] == four["ref_losses"]
    assert four["ac_2"]["losses"] == four["ref_losses"]


def test_block_detection(four: dict[str, Any]) -> None:
    assert four["blocks_auto"] == ["FSDPBlock"] * 3  # found as the class filling a ModuleList
    assert four["block_named"] == 3
    assert "FSDPBlock" not in four["block_min_params"]
    assert "FSDPLinear" in four["block_min_params"]


def test_gradient_accumulation_matches_one_big_batch(four: dict[str, Any]) -> None:
    assert four["accumulation"]["accum"] == 2
    assert four["accumulation"]["losses"] == pytest.approx(four["ref_losses"], rel=1e-5)


def test_cpu_offload_trains(four: dict[str, Any]) -> None:
    assert four["cpu_offload"]["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-5)
