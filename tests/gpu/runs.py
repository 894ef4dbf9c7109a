"""What the GPU layer's tests share: the demo (or another job) submitted on one GPU through
the real CLI, its rank log, its step records."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import hpcshard, step_records

RUN_TIMEOUT = 240
"""Seconds one run may take (a run is 15-60 s on an H100 with the suite's 4 workers)."""


def attempt(run: Path, *settings: str, job: str = "jobs/charlm.py", env: dict[str, str] | None = None,
            timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    """`hpcshard submit --backend local` on 1 node x 1 GPU: its exit status, and the CLI's
    output with the rank log's end."""
    sets = [arg for s in settings for arg in ("--set", s)]
    out = hpcshard("submit", "--backend", "local", "--nodes", "1", "--gpus", "1", job,
                   "--run-dir", str(run), "--max-restarts", "0", *sets, timeout=timeout, env=env)
    return out.returncode, out.stdout[-3000:] + out.stderr[-3000:] + rank_log(run)[-4000:]


def submit(run: Path, *settings: str, job: str = "jobs/charlm.py", env: dict[str, str] | None = None,
           timeout: float = RUN_TIMEOUT) -> None:
    """`attempt`, failing the test with what was said unless the run exits 0."""
    code, text = attempt(run, *settings, job=job, env=env, timeout=timeout)
    assert code == 0, text


def rank_log(run: Path, rank: int = 0) -> str:
    log = run / "logs" / f"rank-{rank}.log"
    return log.read_text(errors="replace") if log.exists() else "(no rank log)"


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in step_records(run)]
