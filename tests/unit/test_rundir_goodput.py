"""Where a run's wall time went, on a timeline written by hand: a start, training with a
save and an evaluation in it, a fault, the restart that recomputes what it lost, a stop
and a requeue. Every second lands in exactly one category."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard.rundir.goodput import CATEGORIES, account

pytestmark = pytest.mark.unit


def write(run: Path, metrics: list[dict], ledger: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))


def start(t_entry: float, t_loaded: float, first: int) -> dict:
    return {"event": "start", "time": t_loaded, "first_step": first,
            "startup": {"entry": t_entry, "loaded": t_loaded}}


def step(t: float, n: int, **paused: float) -> dict:
    return {"step": n, "time": t, "loss": 1.0, **paused}


def test_every_second_from_submission_is_accounted_for_once(tmp_path: Path) -> None:
    write(tmp_path, [
        start(110, 114, 1),                       # queue+launch 10, start-up 4
        step(124, 10), step(136, 20, save_s=2),   # 10 + 10 training, 2 checkpoint
        step(141, 25),                            # 5 training; then a fault at 143
        start(146, 149, 21),                      # recovery 3, start-up 3 (resumed step 20)
        step(159, 30, eval_s=1),                  # 5 of 10 recomputed (21-25), 4.5 new, 1 eval
        start(175, 177, 31),                      # after the stop (end at 161): queue 14
        step(187, 40),                            # 10 training; end at 190: final save 3
    ], [
        {"event": "fault", "time": 144, "declared": 143, "attempt": 0, "cycle": 0},
        {"event": "end", "time": 161, "attempt": 0, "cycle": 1, "reason": "stop"},
        {"event": "end", "time": 190, "attempt": 1, "cycle": 0, "reason": "done"},
    ])
    got = account(tmp_path, created=100)
    s = got.seconds
    assert got.wall == 90 and got.faults == 1 and got.starts == 3
    assert sum(s.values()) == pytest.approx(got.wall)
    assert s["queue+launch"] == pytest.approx(10 + 14)
    assert s["start-up"] == pytest.approx(4 + 3 + 2)
    assert s["training"] == pytest.approx(10 + 10 + 5 + 4.5 + 10)
    assert s["recomputed"] == pytest.approx(4.5)
    assert s["checkpoint"] == pytest.approx(2 + 2 + 3)  # periodic, the stop's, the final
    assert s["evaluation"] == pytest.approx(1)
    assert (s["detection"], s["recovery"]) == (pytest.approx(2), pytest.approx(3))
    assert got.effective == pytest.approx(39.5 / 90)
    text = "\n".join(got.lines())
    assert "effective training time 43.9%" in text and all(c in text for c in CATEGORIES)
