"""Metrics: JSONL records in the run directory, a log line, a progress bar on rank 0, and
TensorBoard and W&B when asked (runtime.trackers)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from hpcshard.rundir.files import append_line
from hpcshard.rundir.paths import RunPaths
from hpcshard.runtime.device import DistEnv, peak_memory_bytes
from hpcshard.runtime.trackers import Trackers

log = logging.getLogger("hpcshard")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than produce a file no parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _short(value: Any) -> str:
    """A value as the log line shows it: floats to 4 digits, a dict (split_s) as k:v,..."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{_short(v)}" for k, v in value.items())
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
    """A one-line progress bar on rank 0's terminal (stderr), or nothing when it is not a
    terminal: `training [#####-----] 120/300 40% loss 2.345 eta 1:23`. Redrawn at most
    every `every` seconds (a step can take milliseconds); the CLI's click stays out of
    the ranks."""

    WIDTH = 30

    def __init__(self, total: int, start: int, stream: TextIO | None, every: float = 0.2) -> None:
        self.total, self.pos, self.first = max(1, total), start, start
        self.stream, self.every = stream, every
        self.loss = float("nan")
        self.t0 = self.drawn = time.monotonic()

    def advance(self, step: int) -> None:
        self.pos = step
        now = time.monotonic()
        if self.stream is not None and (now - self.drawn >= self.every or step >= self.total):
            self.drawn = now
            self.stream.write("\r" + self.line(now - self.t0))
            self.stream.flush()

    def show(self, loss: float) -> None:
        self.loss = loss

    def line(self, elapsed: float) -> str:
        done = min(self.pos, self.total) / self.total
        bar = "#" * int(done * self.WIDTH)
        text = f"training [{bar:-<{self.WIDTH}}] {self.pos}/{self.total} {done:4.0%}"
        if not math.isnan(self.loss):
            text += f" loss {self.loss:.3f}"
        steps = self.pos - self.first
        if steps > 0 and self.pos < self.total:
            eta = int(elapsed / steps * (self.total - self.pos))
            text += f" eta {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}"
        return text

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


class Metrics:
    """Rank 0 appends one JSON object per line to RUN_DIR/metrics.jsonl."""

    def __init__(self, run_dir: Path | None, env: DistEnv, *, total_steps: int,
                 trackers: Trackers | None = None) -> None:
        self.env, self.total = env, total_steps
        self.trackers = trackers or Trackers.none()
        """TensorBoard and W&B (runtime.trackers), sent every step record."""
        self.path = RunPaths(run_dir).metrics if run_dir and env.is_main else None
        self.t0 = time.time()
        self.interactive = env.is_main and sys.stderr.isatty()
        self.dropped = 0
        """Records lost since the last write that worked (a full disk)."""

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        try:
            append_line(self.path, line)
        except OSError as err:  # a full disk loses records, never the training
            if not self.dropped:
                log.warning("metrics not written (%s); training goes on, records are lost "
                            "until the disk has room again", err)
            self.dropped += 1
            return
        if self.dropped:
            log.warning("metrics written again; %d record(s) lost", self.dropped)
            self.dropped = 0

    def event(self, name: str, **fields: Any) -> None:
        self._write({"event": name, "time": time.time(), **fields})
        if self.env.is_main:
            log.info("%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))

    def record(self, step: int, **values: Any) -> None:
        values["peak_mem_gb"] = peak_memory_bytes(self.env.device) / 2**30
        self._write({"step": step, "time": time.time(), "elapsed": time.time() - self.t0, **values})
        self.trackers.log(step, values)
        if self.env.is_main:
            text = " ".join(f"{k}={_short(v)}" for k, v in values.items() if v is not None)
            # With a live bar the line goes to the log file only; the bar shows the loss.
            (log.debug if self.interactive else log.info)("step %d/%d %s", step, self.total, text)

    def rewound(self, step: int) -> None:
        """Training went back to `step` (a rollback)."""
        self.trackers.rewound(step)

    def close(self) -> None:
        self.trackers.close()

    @contextlib.contextmanager
    def progress(self, start: int) -> Iterator[Progress]:
        bar = Progress(self.total, start, sys.stderr if self.interactive else None)
        try:
            yield bar
        finally:
            bar.close()
