"""Readers of RUN_DIR/metrics.jsonl, which rank 0 writes (`runtime.metrics`): one JSON
record per logged step, evaluation or event. Stdlib: the CLI and status read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcshard.rundir import paths
from hpcshard.rundir.files import read_lines

METRICS = paths.METRICS


SPLIT = ("data", "forward", "backward", "optimizer", "checkpoint", "comm", "other")
"""The parts of a step record's `split_s` (mean seconds per step; `runtime.timing`):
"other" is `step_s` less the rest."""


def split_text(record: dict[str, Any]) -> str:
    """`step time 0.412 s: data 0.1%, forward 31%, ...` from a step record's `step_s` and
    `split_s` ("": a record written before they were)."""
    step, split = record.get("step_s"), record.get("split_s")
    if not step or not isinstance(split, dict):
        return ""
    parts = ", ".join(f"{k} {_percent(float(split.get(k) or 0.0) / step)}" for k in SPLIT)
    return f"step time {step:.3g} s: {parts}"


def _percent(share: float) -> str:
    """Two significant digits below 10%, whole percents above: 0.1%, 2.4%, 31%."""
    return f"{100 * share:.2g}%" if abs(share) < 0.1 else f"{100 * share:.0f}%"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of RUN_DIR/metrics.jsonl, oldest first (none yet: empty)."""
    return read_lines(run_dir / METRICS)


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step training records (not evaluations, not start/end events)."""
    return [r for r in records if "loss" in r and "event" not in r]


def last_record(run_dir: Path, key: str) -> dict[str, Any] | None:
    """The newest step record that has `key` (e.g. "loss" or "eval_loss")."""
    found = [r for r in read_metrics(run_dir) if r.get(key) is not None and "event" not in r]
    return found[-1] if found else None
