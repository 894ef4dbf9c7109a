"""The first code every rank runs (`torchrun ... -m hpcshard.entry RUN_DIR`), stdlib only.

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

START = time.time()
"""When this rank's interpreter reached hpcshard (start-up timings in the start event)."""

EARLY: list[int] = []
"""Signals received before the runtime installed its handlers."""


def _early(signum: int, _frame: FrameType | None) -> None:
    EARLY.append(signum)


def notice() -> signal.Signals:
    """The launcher's stop signal (the site profile's preemption notice), USR2 by default."""
    return signal.Signals[os.environ.get("HPCSHARD_STOP_SIGNAL", "SIGUSR2")]


def main() -> int:
    signal.signal(notice(), _early)
    import json
    from pathlib import Path

    run_dir = Path(sys.argv[1])
    spec = json.loads((run_dir / "spec.json").read_text())
    if spec.get("script"):  # bring your own script: it keeps its own interpreter exit
        from hpcshard import script

        return script.run(run_dir, spec, EARLY)
    from hpcshard.runtime.main import main as run

    code = run()
    # Skip interpreter finalization: the process groups are destroyed, but the mesh and
    # the FSDP modules still hold gloo/NCCL objects whose C++ destructors can race their
    # own threads there (a rare SIGABRT, "terminate called without an active exception",
    # after the work was done and recorded). Everything worth keeping is flushed first.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # `-m hpcshard.entry` runs this file as __main__: later imports of hpcshard.entry (the
    # runtime reads EARLY and START) must find this module, not execute a second copy
    # with an empty EARLY, or a notice that came while torch loaded would be lost.
    sys.modules.setdefault("hpcshard.entry", sys.modules[__name__])
    sys.exit(main())
