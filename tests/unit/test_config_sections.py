"""TrainConfig in sections: every field in exactly one, each section a faithful view of the
flat fields, old spec.json files still load, and `Parallel` owns the parallel degrees."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from hpcshard.config import TrainConfig, build_config
from hpcshard.errors import UserError
from hpcshard.launch.watchdog import Limits
from hpcshard.rundir.spec import RunSpec
from hpcshard.sections import (
    SECTIONS,
    CheckpointSection,
    OptimizerSection,
    Parallel,
    SupervisionSection,
    TrackerSection,
)


def test_every_field_belongs_to_exactly_one_section_with_its_type() -> None:
    hints = typing.get_type_hints(TrainConfig)
    owners: dict[str, list[str]] = {f.name: [] for f in dataclasses.fields(TrainConfig)}
    for section in SECTIONS:
        for name, kind in typing.get_type_hints(section).items():
            assert name in owners, f"{section.__name__}.{name} is not a TrainConfig field"
            assert kind == hints[name], f"{section.__name__}.{name}: {kind} is not {hints[name]}"
            owners[name].append(section.__name__)
    wrong = {name: where for name, where in owners.items() if len(where) != 1}
    assert not wrong, f"fields not in exactly one section: {wrong}"


def test_a_section_is_a_view_of_the_flat_fields() -> None:
    cfg = TrainConfig(lr=0.5, steps=7, ckpt_every=3, watchdog_floor_s=9.0, tensorboard=False)
    opt = OptimizerSection.of(cfg)
    assert (opt.lr, opt.steps) == (0.5, 7)
    assert CheckpointSection.of(cfg).ckpt_every == 3
    assert SupervisionSection.of(cfg).watchdog_floor_s == 9.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.lr = 1.0  # type: ignore[misc]
    flat = dataclasses.asdict(cfg)
    for section in SECTIONS:
        assert section.from_flat(flat) == section.of(cfg)


def test_from_flat_fills_what_an_old_config_lacks_and_parses_strings() -> None:
    section = SupervisionSection.from_flat({"watchdog_floor_s": 7, "nan_skip": "2"})
    assert section.watchdog_floor_s == 7.0 and isinstance(section.watchdog_floor_s, float)
    assert section.nan_skip == 2
    assert section.watchdog_join_s == TrainConfig().watchdog_join_s
    assert TrackerSection.from_flat({"tensorboard": "false"}).tensorboard is False


# spec.json as written by hpcshard before the sections (406c434): flat `sets` of strings and
# the preflight's flat resolved config, here an older one that predates watchdog_join_s.
OLD_SPEC = {
    "job": "charlm", "sets": {"steps": "12", "lr": "0.01", "watchdog_floor_s": "8",
                              "ckpt_every": "4", "tp": "1"},
    "nodes": 2, "gpus": 2, "spares": 0, "min_nodes": 0, "backend": "local", "name": "old",
    "max_requeues": 10, "max_restarts": 3, "no_progress_restarts": 2,
    "requeue_policy": "requeue", "profile": "", "bad_nodes": "drain", "health_check": "",
    "run_group": "", "script": {}, "jobs": [], "slurm": {},
    "resolved": {"config": {"steps": 12, "lr": 0.01, "watchdog_factor": 3.0, "watchdog_floor_s": 8.0,
                            "watchdog_warmup_steps": 3, "watchdog_phase_s": 1800.0,
                            "ckpt_every": 4, "tp": 1},
                 "sharding": "hybrid", "micro_batch": 8, "accumulation": 1},
    "created": 1700000000.0,
}


def test_an_old_spec_json_still_loads_to_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(json.dumps(OLD_SPEC))
    spec = RunSpec.read(tmp_path)
    cfg = build_config(TrainConfig, spec.sets)
    assert (cfg.steps, cfg.lr, cfg.watchdog_floor_s, cfg.ckpt_every) == (12, 0.01, 8.0, 4)
    assert cfg == TrainConfig(steps=12, lr=0.01, watchdog_floor_s=8.0, ckpt_every=4)
    limits = Limits.from_config(spec.resolved.config)
    assert limits == Limits(floor_s=8.0, join_s=TrainConfig().watchdog_join_s)
    assert limits == Limits.of(SupervisionSection.of(cfg))
    assert Limits.from_config({}) == Limits()  # a script's run: nothing resolved


def test_the_launchers_watchdog_reads_its_own_keys_only() -> None:
    """A key of the supervision section the launcher does not use, odd in a hand-edited
    spec.json, never stops it; a number written as a bool is read as the number it is."""
    odd = {"nan_skip": None, "health_link_gbps": None, "straggler_margin": "1,4", "health_link_mb": [64]}
    assert Limits.from_config({**odd, "watchdog_floor_s": 7}) == Limits(floor_s=7.0)
    limits = Limits.from_config({"watchdog_factor": True})
    assert limits.factor == 1.0 and type(limits.factor) is float


@pytest.mark.parametrize("nodes,per_node,tp,sharding,rank,want", [
    # (world, dp_world, dp_per_node, mode, dp_rank(rank))
    (1, 1, 1, "auto", 0, (1, 1, 1, "full", 0)),
    (1, 4, 1, "auto", 3, (4, 4, 4, "full", 3)),
    (2, 4, 1, "auto", 5, (8, 8, 4, "hybrid", 5)),
    (2, 4, 2, "auto", 5, (8, 4, 2, "hybrid", 2)),
    (1, 4, 4, "full", 3, (4, 1, 1, "full", 0)),
    (4, 8, 2, "none", 17, (32, 16, 4, "none", 8)),
    (3, 2, 2, "grad-op", 5, (6, 3, 1, "grad-op", 2)),
])
def test_parallel_owns_the_degrees_and_what_follows(nodes: int, per_node: int, tp: int,
                                                     sharding: str, rank: int,
                                                     want: tuple[int, int, int, str, int]) -> None:
    p = Parallel(nodes=nodes, per_node=per_node, tp=tp, sharding=sharding)
    assert (p.world, p.dp_world, p.dp_per_node, p.mode, p.dp_rank(rank)) == want


@pytest.mark.parametrize("batch_size,micro_batch_size,want", [
    (32, 0, (4, 1)), (32, 2, (2, 2)), (32, 1, (1, 4)), (16, 0, (2, 1)),
])
def test_parallel_splits_the_batch_over_the_data_parallel_world(
        batch_size: int, micro_batch_size: int, want: tuple[int, int]) -> None:
    p = Parallel(nodes=2, per_node=8, tp=2)  # 16 ranks, 8 data-parallel
    cfg = TrainConfig(batch_size=batch_size, micro_batch_size=micro_batch_size, tp=2)
    assert p.accumulation(cfg) == want
    assert Parallel.of(cfg, 2, 8) == p


@pytest.mark.parametrize("per_node,tp,sharding,needle", [
    (4, 3, "auto", "tp=3 does not divide the 4 ranks of a node; use one of 1, 2, 4"),
    (4, 0, "auto", "tp=0"),
    (4, 1, "zero3", "sharding='zero3' is not valid"),
])
def test_parallel_refuses_degrees_that_do_not_fit(per_node: int, tp: int, sharding: str,
                                                   needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        Parallel(nodes=1, per_node=per_node, tp=tp, sharding=sharding)
    with pytest.raises(UserError, match="batch_size=30 does not divide over 4 ranks"):
        Parallel(nodes=1, per_node=8, tp=2).accumulation(TrainConfig(batch_size=30))


def test_a_run_resolved_before_a_changed_default_keeps_its_old_behaviour(tmp_path: Path) -> None:
    """The Feistel order replaced torch.randperm's: a run resolved before (its checkpoints'
    data positions mean randperm's order) keeps randperm when it is requeued or resumed, and
    a resume pins it into the run's sets; a new run, and a run that says, is its own."""
    from hpcshard.cli.request import again
    from hpcshard.config import kept_sets

    (tmp_path / "spec.json").write_text(json.dumps(OLD_SPEC))
    spec = RunSpec.read(tmp_path)
    assert build_config(TrainConfig, kept_sets(spec.sets, spec.resolved.config)).data_order == "randperm"
    assert kept_sets({"data_order": "feistel"}, spec.resolved.config) == {"data_order": "feistel"}
    assert kept_sets({}, {}) == {}  # (nothing resolved: a script's run)
    new = {**spec.resolved.config, "data_order": "feistel"}
    assert build_config(TrainConfig, kept_sets(spec.sets, new)).data_order == "feistel"
    (tmp_path / "checkpoints").mkdir()
    assert again(spec, tmp_path).spec.sets["data_order"] == "randperm"
