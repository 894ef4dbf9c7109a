"""RUN_DIR/launch/: what the launchers leave for each other and for the CLI.

    node-N.pid       a node launcher's pid while it runs (local backend: `preempt`,
                     `cancel` and `resume` find the live ones here)
    job-J.attempt    the attempt number a continuation job J starts with (chain policy)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

LAUNCH = "launch"


def pid_file(run_dir: Path, node_rank: int) -> Path:
    return run_dir / LAUNCH / f"node-{node_rank}.pid"


def attempt_file(run_dir: Path, job_id: str) -> Path:
    """Where a continuation job finds its attempt number (absent: not a continuation)."""
    return run_dir / LAUNCH / f"job-{job_id}.attempt"


def launchers(run_dir: Path) -> list[int]:
    """The pids of the launchers that are still alive (a pid file left behind by one
    killed with -9 does not count; another user's live process does)."""
    alive = []
    for path in sorted((run_dir / LAUNCH).glob("node-*.pid")):
        try:
            pid = int(path.read_text())
            os.kill(pid, 0)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            continue
        except PermissionError:
            pass
        alive.append(pid)
    return alive


def signal_launchers(run_dir: Path, sig: int) -> int:
    """Send `sig` to every live launcher of the run; returns how many got it."""
    sent = 0
    for pid in launchers(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            sent += 1
    return sent
