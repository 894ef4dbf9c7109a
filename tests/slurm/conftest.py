"""One real local Slurm cluster (2 nodes x 2 fake GPUs, partitions low and high) for the
whole session, started through the project's own script. It fails loudly, never skips:
CI installs Slurm and must run these tests."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "local-slurm"
CONF = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm")) / "etc" / "slurm.conf"


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, str]]:
    up = subprocess.run([str(SCRIPT), "up", "2"], capture_output=True, text=True, timeout=600)
    if up.returncode:
        pytest.fail(f"the local Slurm cluster did not start:\n{up.stdout}\n{up.stderr}")
    yield {"SLURM_CONF": str(CONF)}
    subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=120)


def slurm(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True,
                          env={**os.environ, "SLURM_CONF": str(CONF)}).stdout


def state(job: str) -> str:
    out = slurm("scontrol", "show", "job", "-o", job)
    return next(t.split("=", 1)[1] for t in out.split() if t.startswith("JobState="))


def restarts(job: str) -> int:
    out = slurm("scontrol", "show", "job", "-o", job)
    return int(next(t.split("=", 1)[1] for t in out.split() if t.startswith("Restarts=")))


def wait_state(job: str, states: set[str], timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while (now := state(job)) not in states:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} still {now} after {timeout}s (wanted {states})")
        time.sleep(1)
    return now
