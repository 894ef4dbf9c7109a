"""Readers of RUN_DIR/metrics.jsonl, which rank 0 writes (`runtime.metrics`): one JSON
record per logged step, evaluation or event. Stdlib: the CLI and status read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcshard.rundir import paths
from hpcshard.rundir.files import read_lines

METRICS = paths.METRICS


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
