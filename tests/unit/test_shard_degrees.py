"""Shard and replicate degrees of the user's choice (`shard`): the mesh `Parallel` derives
from them, the refusals (one line each), the fewer-nodes decision, and what the planner and
the preflight make of them."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.runtime.mesh import mesh_shape
from hpcshard.sections import Parallel

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


@pytest.mark.parametrize("nodes,per_node,tp,sharding,shard,want", [
    # (mode, mesh shape, mesh names)
    (4, 8, 1, "auto", 16, ("hybrid", (2, 16), ("replicate", "shard"))),
    (4, 8, 1, "hybrid", 16, ("hybrid", (2, 16), ("replicate", "shard"))),
    (4, 8, 1, "auto", 0, ("hybrid", (4, 8), ("replicate", "shard"))),  # hybrid stays the default
    (4, 8, 1, "hybrid", 8, ("hybrid", (4, 8), ("replicate", "shard"))),
    (4, 8, 1, "auto", 32, ("full", (32,), ("shard",))),
    (4, 8, 1, "full", 32, ("full", (32,), ("shard",))),
    (4, 8, 1, "auto", 1, ("none", (32, 1), ("replicate", "shard"))),
    (4, 8, 1, "auto", 4, ("hybrid", (8, 4), ("replicate", "shard"))),  # inside a node, 2 per node
    (4, 8, 2, "auto", 8, ("hybrid", (2, 8, 2), ("replicate", "shard", "tp"))),
    (1, 8, 1, "auto", 4, ("hybrid", (2, 4), ("replicate", "shard"))),
    (4, 1, 1, "auto", 2, ("hybrid", (2, 2), ("replicate", "shard"))),  # the distributed test's
])
def test_the_shard_degree_gives_the_mesh(nodes: int, per_node: int, tp: int, sharding: str, shard: int,
                                         want: tuple[str, tuple[int, ...], tuple[str, ...]]) -> None:
    p = Parallel(nodes=nodes, per_node=per_node, tp=tp, sharding=sharding, shard=shard)
    assert (p.mode, *p.mesh()) == want
    assert mesh_shape(sharding, nodes, per_node, tp, shard) == p.mesh()
    assert p.replicate * p.shard_degree == p.dp_world


def test_a_shard_group_of_16_spans_two_whole_nodes_and_replicas_the_other_two() -> None:
    p = Parallel(nodes=4, per_node=8, shard=16)
    assert p.shard_group(0) == tuple(range(16)) and p.shard_group(31) == tuple(range(16, 32))
    assert p.replica_group(0) == (0, 16) and p.replica_group(21) == (5, 21)
    assert p.nodes_per_shard_group() == 2
    # tp innermost: the shard group of rank 1 is the tp=1 column of nodes 0 and 1
    t = Parallel(nodes=4, per_node=8, tp=2, shard=8)
    assert t.shard_group(1) == tuple(range(1, 16, 2)) and t.replica_group(1) == (1, 17)
    assert t.nodes_per_shard_group() == 2
    assert Parallel(nodes=4, per_node=8).nodes_per_shard_group() == 1  # hybrid: inside a node


def test_the_config_carries_the_shard_degree_to_parallel() -> None:
    cfg = TrainConfig(shard=16, batch_size=64)
    assert Parallel.of(cfg, 4, 8) == Parallel(nodes=4, per_node=8, shard=16)
    with pytest.raises(UserError, match="shard=-1 is not valid"):
        TrainConfig(shard=-1)


@pytest.mark.parametrize("sharding,shard,needle", [
    ("auto", 12, "shard=12 does not divide the 32 data-parallel ranks (4 node(s) x 8); use one of "
                 "1, 2, 4, 8, 16, 32"),
    ("full", 16, "shard=16 contradicts sharding=full, which shards over all 32 data-parallel ranks "
                 "(shard 32); use sharding=auto or hybrid for 2 replica(s) of 16, or drop shard"),
    ("grad-op", 8, "shard=8 contradicts sharding=grad-op"),
    ("none", 2, "shard=2 contradicts sharding=none, which replicates without sharding (shard 1)"),
])
def test_a_shard_degree_that_does_not_fit_is_one_line(sharding: str, shard: int, needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        Parallel(nodes=4, per_node=8, sharding=sharding, shard=shard)
    assert "\n" not in str(err.value)


def test_tp_divides_the_world_the_shard_degree_must_divide() -> None:
    with pytest.raises(UserError, match=r"shard=32 does not divide the 16 data-parallel ranks "
                                        r"\(4 node\(s\) x 8 / tp 2\)"):
        Parallel(nodes=4, per_node=8, tp=2, shard=32)


def test_reshard_after_forward_divides_the_chosen_shard_group() -> None:
    p = Parallel(nodes=4, per_node=8, shard=16)
    p.check_reshard("8")  # a node's ranks: backward gathers inside a node
    p.check_reshard("auto")
    with pytest.raises(UserError, match="reshard_after_forward=16 must divide the shard group of 16"):
        p.check_reshard("16")
    with pytest.raises(UserError, match="reshard_after_forward=3 must divide the shard group of 16 "
                                        "ranks and be smaller; use 2, 4, 8"):
        p.check_reshard("3")


@pytest.mark.parametrize("nodes,shard,fewest,needle", [
    (4, 16, 4, ""),  # never fewer
    (4, 16, 0, ""),
    (4, 0, 1, ""),  # the mode's own degree is derived again on any count
    (4, 8, 1, ""),  # a node's worth divides every world
    (4, 16, 3, "shard=16 with min_nodes 3: on 3 node(s) the 24 data-parallel ranks do not split into "
               "shard groups of 16; use --min-nodes 4, or a shard that divides every count from 3 "
               "to 4 nodes (1, 2, 4, 8), or shard=0"),
    (6, 16, 2, "on 3 node(s) the 24 data-parallel ranks"),
    (8, 16, 6, "on 7 node(s) the 56 data-parallel ranks do not split into shard groups of 16; "
               "use --min-nodes 8"),
])
def test_fewer_nodes_with_an_indivisible_world_are_refused_at_submit(nodes: int, shard: int, fewest: int,
                                                                     needle: str) -> None:
    p = Parallel(nodes=nodes, per_node=8, shard=shard)
    if not needle:
        p.check_fewer_nodes(fewest)
        return
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        p.check_fewer_nodes(fewest)


def test_fewer_nodes_check_every_count_for_the_batch_and_reshard_and_a_modes_own_degree() -> None:
    """What depends on the node count holds on each count down to min_nodes, or the run
    would end (a rank's UserError) the night a node fails."""
    p = Parallel(nodes=4, per_node=8)
    with pytest.raises(UserError, match=r"min_nodes 3: on 3 node\(s\) \(after losing 1\): batch_size=64"):
        p.check_fewer_nodes(3, TrainConfig(batch_size=64))
    p.check_fewer_nodes(3, TrainConfig(batch_size=96))
    full = Parallel(nodes=4, per_node=8, sharding="full", shard=32)  # full's own degree: derived again
    full.check_fewer_nodes(3, TrainConfig(batch_size=96))
    with pytest.raises(UserError, match="reshard_after_forward=16 must divide the shard group of 24"):
        Parallel(nodes=4, per_node=8, sharding="full").check_fewer_nodes(
            3, TrainConfig(batch_size=96, sharding="full", reshard_after_forward="16"))
    assert Parallel(nodes=3, per_node=8, shard=12).nodes_per_shard_group() == 2  # straddles


def plan_70b(gpu_mem: int, shard: int = 0) -> dict:
    from hpcshard.runtime.planner import make_plan

    numbers = {"params": 70 * 10**9, "layers": 80, "hidden": 8192, "heads": 64, "seq_len": 4096,
               "vocab": 32000}
    return make_plan(job=None, sets={}, numbers=numbers, hf_config=None, nodes=4, gpus=8,
                     sharding="auto", precision="bf16", ac=None, micro_batch=None, gpu_mem=gpu_mem,
                     shard=shard)


def test_the_planner_shows_the_shard_degree_asked_for() -> None:
    p = plan_70b(80 * GiB, shard=16)
    assert p["sharding"] == "shard=16" and list(p["modes"]) == ["none", "grad-op", "hybrid",
                                                                  "shard=16", "full"]
    hybrid, mine, full = p["modes"]["hybrid"], p["modes"]["shard=16"], p["modes"]["full"]
    assert (mine["replicate"], mine["shard"]) == (2, 16)
    # 16-way shards hold half of hybrid's 8-way state, twice full's 32-way
    assert mine["params"] == pytest.approx(hybrid["params"] / 2, rel=1e-6)
    assert mine["optimizer"] == pytest.approx(full["optimizer"] * 2, rel=1e-6)
    assert full["total_ac"] < mine["total_ac"] < hybrid["total_ac"]
    # The checkpoint is the model's whatever the degree (shards written once)
    assert p["checkpoint_bytes"] == pytest.approx(plan_70b(80 * GiB)["checkpoint_bytes"], rel=1e-3)


def test_the_planner_recommends_the_smallest_shard_degree_that_fits() -> None:
    p = plan_70b(100 * GiB)  # hybrid does not fit, full needs AC anyway, 16 fits with AC
    assert p["modes"]["hybrid"]["total_ac"] > 100 * GiB and p["modes"]["full"]["total"] > 100 * GiB
    rec = p["recommendation"]
    assert (rec["sharding"], rec["shard"], rec["ac"]) == ("hybrid", 16, "full")
    assert "shards span 2 nodes (2 replicas of 16)" in rec["why"]
    assert plan_70b(80 * GiB)["recommendation"]["sharding"] == "full"  # 16 is 80.5 GiB


def test_the_cli_plan_takes_a_shard_degree(capsys: pytest.CaptureFixture[str]) -> None:
    from click.testing import CliRunner

    from hpcshard.cli.plan import plan

    res = CliRunner().invoke(plan, ["--params", "70B", "--layers", "80", "--hidden", "8192", "--nodes", "4",
                                    "--gpus", "8", "--precision", "bf16", "--shard", "16",
                                    "--gpu-mem", "100GiB"])
    assert res.exit_code == 0, res.output
    assert "shard=16 *" in res.output and "2 x 16" in res.output
    assert "recommended: --set sharding=hybrid --set shard=16 --set ac=full" in res.output
    bad = CliRunner().invoke(plan, ["--params", "70B", "--layers", "80", "--hidden", "8192", "--nodes", "4",
                                    "--gpus", "8", "--shard", "12"])
    assert isinstance(bad.exception, UserError) and "shard=12 does not divide" in str(bad.exception)


def preflight(sets: dict[str, str], nodes: int = 2, gpus: int = 2, min_nodes: int = 0) -> dict:
    from hpcshard.runtime.preflight import preflight

    data = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
    return preflight({"job": str(ROOT / "jobs" / "charlm.py"),
                      "sets": {"data": data, "batch_size": "8", **sets},
                      "nodes": nodes, "gpus": gpus, "min_nodes": min_nodes})


def test_the_preflight_resolves_and_checks_the_degree() -> None:
    res = preflight({"shard": "2"}, nodes=4, gpus=1)
    assert (res["sharding"], res["replicate"], res["shard"]) == ("hybrid", 2, 2)
    with pytest.raises(UserError, match=r"shard=3 does not divide the 4 data-parallel ranks"):
        preflight({"shard": "3"})
    with pytest.raises(UserError, match="shard=2 with min_nodes 3: on 3 node"):
        preflight({"shard": "2"}, nodes=4, gpus=1, min_nodes=3)


@pytest.mark.parametrize(("value", "needle"), [("fp8", "--set float8=true"), ("float8", "--set float8=true"),
                                               ("bf17", "choose one of: fp32, bf16, fp16")])
def test_the_cli_plan_names_a_bad_precision_and_the_fix(value: str, needle: str) -> None:
    """--precision takes what --set precision= takes; fp8 is its own setting, and says so."""
    from click.testing import CliRunner

    from hpcshard.cli.plan import plan

    bad = CliRunner().invoke(plan, ["--params", "7B", "--layers", "32", "--hidden", "4096",
                                    "--precision", value])
    assert isinstance(bad.exception, UserError), bad.output
    assert f"precision={value!r} is not valid" in str(bad.exception) and needle in str(bad.exception)
