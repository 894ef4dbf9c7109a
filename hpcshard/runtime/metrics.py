"""Metrics: JSONL records in the run directory, a log line, and a progress bar on rank 0."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from hpcshard.runtime.device import DistEnv, peak_memory_bytes

log = logging.getLogger("hpcshard")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than produce a file no parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Progress:
    """click's progress bar when rank 0's stderr is a terminal; otherwise nothing."""

    def __init__(self, bar: Any, start: int) -> None:
        self.bar, self.pos, self.loss = bar, start, float("nan")

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.pos, current_item=self.loss)
        self.pos = step

    def show(self, loss: float) -> None:
        self.loss = loss


class Metrics:
    """Rank 0 appends one JSON object per line to RUN_DIR/metrics.jsonl."""

    def __init__(self, run_dir: Path | None, env: DistEnv, *, total_steps: int) -> None:
        self.env, self.total = env, total_steps
        self.path = run_dir / "metrics.jsonl" if run_dir and env.is_main else None
        self.t0 = time.time()
        self.interactive = env.is_main and sys.stderr.isatty()

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def event(self, name: str, **fields: Any) -> None:
        self._write({"event": name, "time": time.time(), **fields})
        if self.env.is_main:
            log.info("%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))

    def record(self, step: int, **values: Any) -> None:
        values["peak_mem_gb"] = peak_memory_bytes(self.env.device) / 2**30
        self._write({"step": step, "time": time.time(), "elapsed": time.time() - self.t0, **values})
        if self.env.is_main:
            text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in values.items() if v is not None)
            # With a live bar the line goes to the log file only; the bar shows the loss.
            (log.debug if self.interactive else log.info)("step %d/%d %s", step, self.total, text)

    @contextlib.contextmanager
    def progress(self, start: int) -> Iterator[Progress]:
        if not self.interactive:
            yield Progress(None, start)
            return
        def show(loss: float | None) -> str | None:
            return None if loss is None or math.isnan(loss) else f"loss {loss:.3f}"

        bar: Any
        with click.progressbar(length=self.total, label="training", file=sys.stderr,
                               show_pos=True, show_eta=True, item_show_func=show) as bar:
            bar.update(start)
            yield Progress(bar, start)
