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


@pytest.mark.parametrize("name,mesh,dims,local_rows", [
    ("tp_1x4", [2, 2], ["shard", "tp"], 32 // 4),  # q's 32 rows: 2 tp x 2 shard
    ("tp_2x2", [2, 1, 2], ["replicate", "shard", "tp"], 32 // 2),
])
def test_tensor_parallel_trains_like_one_rank(one: dict[str, Any], four: dict[str, Any], name: str,
                                              mesh: list[int], dims: list[str], local_rows: int) -> None:
    """tp=2 on a 3D mesh: the same initial weights as 1 rank, bit for bit; the same losses
    and clipped gradient norms within float reduction order; tensor parallel ranks share
    their data (data parallel world 2)."""
    facts = four[name]
    assert facts["mesh"] == mesh and facts["mesh_dims"] == dims and facts["all_dtensors"]
    assert facts["local_rows"] == local_rows and facts["rows"] == 32
    assert facts["dp"][1] == 2
    assert facts["init_hash"] == one["init_hash"]
    assert facts["losses"] == pytest.approx(one["ref_losses"], rel=1e-5)
    assert facts["norms"] == pytest.approx(one["ref_norms"], rel=1e-4)
    # loss parallel: the head's logits stay split by vocabulary into the cross entropy
    assert facts["logits"]["dtensor"] and facts["logits"]["placements"][-1] == "Shard(dim=2)"
    assert facts["logits"]["local_vocab"] * 2 == facts["logits"]["vocab"]


def test_reduce_and_output_dtypes(four: dict[str, Any]) -> None:
    """reduce_dtype=bf16 puts bf16 on the wire (the reduce-scatter inside a node and the
    all-reduce across nodes); output_dtype=fp32 casts the model's bf16 output."""
    facts = four["reduce_bf16"]
    assert facts["reduce_scatter_dtypes"] == ["torch.bfloat16"]
    assert facts["cross_node_dtypes"] == ["torch.bfloat16"]
    assert facts["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-2)
    assert four["output_dtype"] == {"bf16": "torch.bfloat16", "bf16_fp32": "torch.float32"}


def test_reshard_to_a_smaller_group_gathers_inside_it_in_backward(four: dict[str, Any]) -> None:
    """reshard_after_forward=2 on a shard group of 4 (ZeRO++'s hpZ): after forward every
    block but the last is sharded over pairs, so backward's all-gathers span 2 ranks, not 4."""
    seen = four["reshard_2"]["after_forward"]
    assert seen["blocks_unsharded"] == [False, False, False]
    assert seen["backward_group_sizes"] == [2]
    assert four["full"]["after_forward"]["backward_group_sizes"] == [4]
    assert four["reshard_2"]["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-5)


def test_explicit_prefetch_gathers_the_next_blocks_early(four: dict[str, Any]) -> None:
    """prefetch=2: block 0's forward already gathered blocks 1 and 2 (before block 1 starts:
    the root, blocks 0, 1 and 2); FSDP2's own gathers block 1 only when it starts."""
    assert four["prefetch"]["0"] == 2 and four["prefetch"]["2"] == 4
    assert four["prefetch"]["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-5)


@pytest.mark.parametrize("name,eager", [("compile_2x2", "ref_losses"), ("compile_tp_2x2", "tp_2x2")])
def test_compiled_blocks_train_the_same(four: dict[str, Any], name: str, eager: str) -> None:
    """compile=true on 2x2 HSDP and on a tp=2 3D mesh: inductor compiled every block in
    whole graphs (no graph break), and the losses match the eager run's."""
    facts, ref = four[name], four[eager]
    assert facts["compiled"] and facts["graphs"] >= 1 and facts["breaks"] == 0
    assert facts["inductor"] >= 1
    assert facts["losses"] == pytest.approx(ref if isinstance(ref, list) else ref["losses"], rel=1e-5)


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


def test_a_chosen_shard_degree_spans_nodes_and_trains_like_full_sharding(four: dict[str, Any]) -> None:
    """shard=2 on 4 emulated nodes x 1 rank: shard groups {0, 1} and {2, 3} each span two
    nodes, replicated across them (hybrid would shard inside a node: over 1 rank here)."""
    facts = four["shard_2_of_4_nodes"]
    assert facts["mode"] == "hybrid" and facts["mesh"] == [2, 2] and facts["all_placed"]
    assert facts["mesh_dims"] == ["replicate", "shard"] and facts["local_rows"] * 2 == facts["rows"]
    assert facts["shard_group"] == [0, 1] and facts["replica_group"] == [0, 2]  # rank 0's
    # every all-gather inside the two-node shard group, gradients all-reduced across replicas
    assert facts["gathers"] == facts["gathers_in_shard_group"] > 0
    assert facts["all_reduces_across_replicas"] > 0
    assert facts["losses"] == pytest.approx(four["ref_losses"], rel=1e-5)
    assert facts["losses"][:2] == pytest.approx(four["full"]["losses"], rel=1e-5)


def test_mixed_precision(four: dict[str, Any]) -> None:
    assert four["bf16"]["compute_dtype"] == "torch.bfloat16"
    assert four["fp16"]["compute_dtype"] == "torch.float16"
    for p in ("bf16", "fp16"):
        assert four[p]["master_dtype"] == "torch.float32"  # sharded master weights stay fp32
    assert four["bf16"]["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-2)
    assert four["fp16"]["losses"][0] == pytest.approx(four["ref_losses"][0], rel=1e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_reduces_gradients_in_fp32(four: dict[str, Any], precision: str) -> None:
    facts = four[precision]
    assert facts["reduce_dtypes"] == ["torch.float32"]  # the policy every FSDP module got
    # What went over the wire: every reduce-scatter inside a node and every all-reduce
    # across nodes carried fp32 (the lists are empty if no such collective was seen).
    assert facts["reduce_scatter_dtypes"] == ["torch.float32"]
    assert facts["cross_node_dtypes"] == ["torch.float32"]
    assert facts["grad_dtypes"] == ["torch.float32"]  # the sharded grads the optimizer sees


def test_fp16_scaler_skips_the_step_and_backs_off_on_overflow(four: dict[str, Any]) -> None:
    fp16 = four["fp16"]
    assert fp16["trained"]  # ordinary steps do move the weights...
    overflow = fp16["overflow"]
    assert not overflow["norm_finite"]  # the forced scale really overflowed the fp16 grads
    assert overflow["params_unchanged"]  # ...the overflowing one is skipped on every shard
    assert overflow["scale_after"] == overflow["scale_before"] / 2  # backoff_factor 0.5


def test_grad_op_keeps_blocks_gathered_between_forward_and_backward(four: dict[str, Any]) -> None:
    full, grad_op = four["full"]["after_forward"], four["grad-op"]["after_forward"]
    # full reshards every block after its forward but the last (needed first by the backward,
    # so resharding it would only add an all-gather), and the root.
    assert full["blocks_unsharded"] == [False, False, True] and not full["root_unsharded"]
    # grad-op (reshard_after_forward=False) keeps everything gathered until the backward.
    assert grad_op["blocks_unsharded"] == [True, True, True] and grad_op["root_unsharded"]
    # Hence the backward gathers again under full (blocks 0, 1 and the root) but never under
    # grad-op; the forward gathers the same four FSDP modules in both.
    assert full["forward_gathers"] == grad_op["forward_gathers"] == 4
    assert full["backward_gathers"] == 3
    assert grad_op["backward_gathers"] == 0

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
    acc = four["accumulation"]
    assert acc["accum"] == 2 and acc["mode"] == "hybrid"
    assert acc["losses"] == pytest.approx(four["ref_losses"], rel=1e-5)


def test_hsdp_accumulation_all_reduces_across_nodes_once_per_step(four: dict[str, Any]) -> None:
    acc = four["accumulation"]
    groups = acc["fsdp_modules"]
    assert groups == 4  # 3 blocks + the root, each one gradient reduction
    # Inside the node every micro-batch is reduce-scattered...
    assert acc["reduce_scatters"] == acc["steps"] * acc["accum"] * groups
    # ...but the cross-node all-reduce runs once per optimizer step, on the summed shards.
    assert acc["cross_node"] == acc["steps"] * groups
    # Without the trainer's switch it would run on every micro-batch: accum times as often.
    assert acc["cross_node_without_switch"] == acc["accum"] * groups


def test_cpu_offload_trains(four: dict[str, Any]) -> None:
    assert four["cpu_offload"]["losses"] == pytest.approx(four["ref_losses"][:2], rel=1e-5)
