"""Test layers: tests/unit (fast, no processes), tests/dist (multi-rank torchrun on
CPU/gloo, and the CLI end to end), tests/slurm (the real local cluster). Each directory's
tests carry its marker, so `pytest -m unit` runs one layer alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("unit", "dist", "slurm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        layer = Path(str(item.fspath)).relative_to(ROOT / "tests").parts[0]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))


def quiet_env(**extra: str) -> dict[str, str]:
    """Two cores shared by up to four ranks: one thread each, and no warning about it."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def hpcshard(*args: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "hpcshard", *args], cwd=cwd, env=quiet_env(),
                          capture_output=True, text=True, timeout=timeout)
