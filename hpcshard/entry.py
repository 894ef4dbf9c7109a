"""The first code every rank runs, stdlib only: `main` under plain torchrun (`torchrun ...
-m hpcshard.entry RUN_DIR`), `rank` in a rank forked by `hpcshard.launch.warm`.

Importing torch takes seconds. A preemption notice that arrives in that window would kill
the rank (SIGUSR2's default action is to terminate), so the handler goes in first and
the notice is kept until the runtime's own stop handling takes over.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

from hpcshard.rundir import console
from hpcshard.rundir.proc import clock
from hpcshard.rundir.rankenv import RankEnv

START = time.time()
"""When this rank's interpreter reached hpcshard (start-up timings in the start event)."""

EARLY: list[int] = []
"""Signals received before the runtime installed its handlers."""
EARLY_AT: list[float] = []
"""When each came, on the host's boot clock: a time-limit stop is planned from when the
notice came, not from when the runtime took it over (the imports, the rendezvous and the
job's build later). Both lists go to the runtime as they are, read once it has its handlers."""


def _early(signum: int, _frame: FrameType | None) -> None:
    EARLY.append(signum)
    EARLY_AT.append(clock())


def notice() -> signal.Signals:
    """The launcher's stop signal (the site profile's preemption notice), USR2 by default."""
    return RankEnv.from_environ().notice_signal


def main() -> int:
    signal.signal(notice(), _early)
    console.harden()  # (under Slurm the rank's console is a file in the run directory)
    from pathlib import Path

    from hpcshard.rundir.spec import RunSpec

    run_dir = Path(sys.argv[1])
    spec = RunSpec.read(run_dir)
    if spec.script:  # bring your own script: it keeps its own interpreter exit
        from hpcshard import script

        if spec.code_lost:
            return script.refuse(run_dir, spec.code_lost)
        spec.use_code()  # the copy of the code submitted (`cli.snapshot`)
        return script.run(run_dir, spec.script, EARLY)
    from hpcshard.runtime.main import main as run

    code = run(sys.argv[1:], early=EARLY, start=START, early_at=EARLY_AT)
    # Skip interpreter finalization: the process groups are destroyed, but the mesh and
    # the FSDP modules still hold gloo/NCCL objects whose C++ destructors can race their
    # own threads there (a rare SIGABRT, "terminate called without an active exception",
    # after the work was done and recorded). Everything worth keeping is flushed first.
    _flush()
    os._exit(code)


def rank(run_dir: str) -> None:
    """A rank forked by `hpcshard.launch.warm`: torch and the runtime are already loaded.

    It must leave the way torch's forked workers do, by returning (or raising SystemExit
    with its exit code): the agent collects every rank's return before any may exit, and
    the fork then ends with `os._exit`, so no interpreter finalization runs here either.
    """
    global START
    START = time.time()
    EARLY.clear()
    EARLY_AT.clear()
    # The agent's handlers (SIGTERM/INT/HUP/QUIT raise in torchelastic) came with the fork;
    # a rank behaves as a fresh interpreter would.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(notice(), _early)
    console.harden()
    sys.argv = [__file__, run_dir]
    from hpcshard.runtime.main import main as run

    code = run([run_dir], early=EARLY, start=START, early_at=EARLY_AT)
    _flush()
    if code:
        raise SystemExit(code)


def _flush() -> None:
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
