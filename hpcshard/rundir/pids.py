"""The node launchers of a run on this machine (local backend): RUN_DIR/launch/node-N.pid,
written by each launcher while it runs. `preempt`, `cancel` and `resume` find them here."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def pid_file(run_dir: Path, node_rank: int) -> Path:
    return run_dir / "launch" / f"node-{node_rank}.pid"


def launchers(run_dir: Path) -> list[int]:
    """The pids of the launchers that are still alive (a pid file left behind by one
    killed with -9 does not count; another user's live process does)."""
    alive = []
    for path in sorted((run_dir / "launch").glob("node-*.pid")):
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
