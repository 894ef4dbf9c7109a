from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from hpcshard.runtime.device import DistEnv
from hpcshard.runtime.metrics import Metrics


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def env(rank: int = 0) -> DistEnv:
    return DistEnv(rank=rank, world=2, local_rank=rank, per_node=2, device=torch.device("cpu"),
                   backend="gloo")


def test_progress_bar_on_a_terminal_shows_steps_and_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    metrics = Metrics(None, env(), total_steps=4)
    with metrics.progress(start=0) as bar:
        for step in range(1, 5):
            bar.show(2.5)
            bar.advance(step)
    out = term.getvalue()
    assert "training" in out and "4/4" in out and "loss 2.500" in out


def test_no_bar_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with Metrics(None, env(), total_steps=4).progress(start=0) as bar:
        bar.advance(4)
    assert pipe.getvalue() == ""


def test_records_go_to_jsonl_on_rank_0_only(tmp_path: Path) -> None:
    Metrics(tmp_path, env(0), total_steps=4).record(2, loss=1.5, mfu=None, bad=float("nan"))
    Metrics(tmp_path, env(1), total_steps=4).record(2, loss=9.0)
    (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec["step"] == 2 and rec["loss"] == 1.5 and rec["bad"] is None
    assert rec["peak_mem_gb"] > 0


def test_a_full_disk_loses_records_not_the_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics(tmp_path, env(0), total_steps=4)
    metrics.record(1, loss=2.0)
    metrics.path = Path("/dev/full")  # writes fail with ENOSPC, as on a full disk
    metrics.record(2, loss=1.9)
    metrics.record(3, loss=1.8)
    assert metrics.dropped == 2 and "training goes on" in caplog.text
    metrics.path = tmp_path / "metrics.jsonl"
    metrics.record(4, loss=1.7)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 4] and "2 record(s) lost" in caplog.text
