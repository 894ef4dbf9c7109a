"""runtime.trackers' pieces that need no tracker running: what a record sends, the W&B run
id, and the config's one line when a tracker's package is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hpcshard.config import TrainConfig
from hpcshard.rundir.spec import wandb_id
from hpcshard.runtime.trackers import scalars

pytestmark = pytest.mark.unit


def test_a_record_sends_its_numbers_under_train_and_eval() -> None:
    assert scalars({"loss": 2.5, "lr": 1e-3, "grad_norm": 1, "mfu": None, "eval_loss": 3.0,
                    "nan": float("nan"), "flag": True, "note": "x"}) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 1.0, "eval/loss": 3.0}
    assert scalars({"step_s": 0.5, "split_s": {"forward": 0.2, "other": 0.01}}) == {
        "train/step_s": 0.5, "train/split_s/forward": 0.2, "train/split_s/other": 0.01}


def test_the_wandb_id_is_the_run_directorys_at_every_start(tmp_path: Path) -> None:
    run = tmp_path / "my run: lr=3e-4"
    first = wandb_id(run, 1700000000.5)
    assert first == wandb_id(run, 1700000000.5) and first.startswith("my-run-lr-3e-4-")
    assert wandb_id(run, 1700000001.5) != first  # another run of the same name
    assert wandb_id(tmp_path / "other" / run.name, 1700000000.5) != first
    assert all(c.isalnum() or c in "-_" for c in first) and len(first) <= 64


@pytest.mark.parametrize("sets,needle", [
    ({"tensorboard": True}, "tensorboard=true needs the tensorboard package, which is not installed: "
                            "pip install 'hpcshard[tensorboard]'"),
    ({"wandb_project": "sweeps"}, "wandb_project=sweeps needs the wandb package, which is not installed: "
                                  "pip install 'hpcshard[wandb]'"),
])
def test_a_tracker_without_its_package_is_one_line(monkeypatch: pytest.MonkeyPatch, sets: dict,
                                                   needle: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    with pytest.raises(ValueError, match="needs the") as err:
        TrainConfig(**sets)
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)


def test_a_bad_wandb_mode_is_one_line() -> None:
    with pytest.raises(ValueError, match="wandb_mode='cloud' is not valid; choose one of: online, offline"):
        TrainConfig(wandb_mode="cloud")

