from __future__ import annotations

from dataclasses import dataclass

import pytest

from hpcshard.config import TrainConfig, build_config, parse_sets


@dataclass(kw_only=True)
class JobConfig(TrainConfig):
    width: int = 8
    name: str = "x"
    ratio: float = 0.5
    flag: bool = False
    maybe: int | None = None


def test_values_take_the_declared_types() -> None:
    cfg = build_config(JobConfig, parse_sets(["width=16", "ratio=0.25", "flag=yes", "maybe=3",
                                              "name=a=b", "steps=7"]))
    assert (cfg.width, cfg.ratio, cfg.flag, cfg.maybe, cfg.name, cfg.steps) == (
        16, 0.25, True, 3, "a=b", 7)
    assert build_config(JobConfig, {"maybe": "none"}).maybe is None


@pytest.mark.parametrize("sets,needles", [
    ({"widht": "3"}, ["'widht'", "valid keys", "width"]),
    ({"width": "wide"}, ["width='wide'", "expected int"]),
    ({"flag": "maybe"}, ["flag='maybe'", "boolean"]),
    ({"sharding": "zero3"}, ["sharding='zero3'", "hybrid", "grad-op"]),
    ({"precision": "fp64"}, ["precision='fp64'", "bf16", "fp16", "fp32"]),
    ({"precision": "fp8"}, ["precision='fp8'", "--set float8=true", "--set precision=bf16"]),
    ({"ac": "sometimes"}, ["ac='sometimes'", "full", "K"]),
    ({"on_storage_full": "wait"}, ["on_storage_full='wait'", "choose one of: stop, train"]),
    ({"steps": "0"}, ["steps=0", "> 0"]),
    ({"lr": "-1"}, ["lr=-1.0", "> 0"]),
    ({"lr": "nan"}, ["lr='nan'", "finite"]),
    ({"grad_clip": "inf"}, ["grad_clip='inf'", "finite"]),
    ({"ratio": "-inf"}, ["ratio='-inf'", "finite"]),  # a job's own float field too
])
def test_bad_values_name_the_value_and_the_choices(sets: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        build_config(JobConfig, sets)
    for needle in needles:
        assert needle in str(err.value)


def test_accumulation_from_global_batch() -> None:
    assert TrainConfig(batch_size=32).accumulation(4) == (8, 1)
    assert TrainConfig(batch_size=32, micro_batch_size=2).accumulation(4) == (2, 4)
    with pytest.raises(ValueError, match="batch_size=30 does not divide over 4 ranks"):
        TrainConfig(batch_size=30).accumulation(4)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        TrainConfig(batch_size=32, micro_batch_size=3).accumulation(4)


def test_ac_every() -> None:
    assert [TrainConfig(ac=a).ac_every() for a in ("none", "full", "3")] == [0, 1, 3]


def test_set_needs_key_and_value() -> None:
    with pytest.raises(ValueError, match="key=value"):
        parse_sets(["=3"])


@pytest.mark.parametrize("name", ["lr", "weight_decay", "min_lr_ratio", "ckpt_minutes", "peak_tflops"])
def test_a_config_built_in_code_rejects_non_finite_numbers(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=nan is not valid; it must be a finite number"):
        TrainConfig(**{name: float("nan")})  # type: ignore[arg-type]
