"""Preemption for your own training loop: has the job been told to stop, and how to say
"requeue me".

    from hpcshard import preemption
    from hpcshard.runtime import load_checkpoint, save_checkpoint

    resumed = load_checkpoint(ckpt_dir, model, optimizer)           # None: fresh start
    for step in range(start, steps + 1):
        ...train one step...
        if preemption.requested():                                  # every rank agrees
            save_checkpoint(ckpt_dir, step, model, optimizer, extra={...})
            sys.exit(preemption.REQUEUE)                            # requeued, resumes here

Importing this module installs a handler for the notice (`$HPCSHARD_NOTICE_SIGNAL`, the
profile's `script_signal`; SIGTERM outside hpcshard), so the notice sets a flag instead
of killing the rank. `requested()` all-reduces the flag: a notice that reached one rank
stops every rank at the same step, which is what makes the resume exact.

Hang detection for your own loop: call `progress(step)` at the start of every step, and
`progress(step, "save")` / `progress(step, "eval")` before a save or an evaluation. The
node's launcher then knows what each rank does, and a rank that overruns a step (a
multiple of the steps it has seen, 5 s at least) or any other phase (`watchdog_phase_s`)
is declared hung: its stacks go to its log and every rank restarts from your newest
checkpoint. Without `progress`, a crashed rank is still restarted; a hung one is not seen.

Stdlib at import; torch is used only by `requested()` once a process group exists.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType
from typing import NoReturn

from hpcshard.rundir import progress as _board
from hpcshard.rundir.proc import clock
from hpcshard.rundir.rankenv import REQUEUE_EXIT, deadline_in, noticed_end

REQUEUE = REQUEUE_EXIT
"""Exit with this code (every rank) after saving: the run is requeued and resumes.
EX_TEMPFAIL from sysexits.h; the same code hpcshard's own launcher uses."""

_received: list[float] = []
"""When this process's handler took the notice, on the host's boot clock (`time_left`)."""


def _handle(_signum: int, _frame: FrameType | None) -> None:
    if not _received:
        _received.append(clock())


def notice_signals() -> list[signal.Signals]:
    """The signals this process treats as a stop notice."""
    name = os.environ.get("HPCSHARD_NOTICE_SIGNAL", "SIGTERM" if "HPCSHARD_RUN_DIR" not in os.environ else "")
    return [signal.Signals[name]] if name else []


def install() -> None:
    """Take the notice signal (done on import; call again if something replaced it)."""
    for sig in notice_signals():
        signal.signal(sig, _handle)


def _noticed() -> bool:
    """This rank's view: its own handler fired, or hpcshard's entry point took the notice
    (before the script ran, or with `script_signal = none`)."""
    script = sys.modules.get("hpcshard.script")
    return bool(_received) or bool(getattr(script, "RECEIVED", None))


def requested(sync: bool = True) -> bool:
    """Has the job been told to stop? With `sync` (the default) and a process group, every
    rank gets the same answer (one tiny all-reduce): call it at the same point of every
    step on every rank. `sync=False` is this rank's own view, free."""
    local = _noticed()
    if not sync:
        return local
    if "torch" not in sys.modules:  # no torch, no process group
        return local
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    from hpcshard.runtime.device import collective_device

    flag = torch.tensor([1.0 if local else 0.0], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def time_left() -> float | None:
    """Seconds until the job's time limit ends, now; None: no limit known. A duration on
    this host's boot clock, from what Slurm told the node's launcher (scontrol's time left,
    which a node's wall clock that is off carries), and, once the time limit's notice came,
    no later than the notice plus its lead (HPCSHARD_NOTICE_LEAD: the controller sends it
    on its own clock), as hpcshard's own training loop plans its stop: a wall clock that is
    off or steps moves neither. Plan a stop of your own with this, not with the time of day."""
    at = deadline_in(os.environ)
    lead = os.environ.get("HPCSHARD_NOTICE_LEAD")
    return None if at is None else noticed_end(at, _noticed_at(), int(lead) if lead else None) - clock()


def _noticed_at() -> float | None:
    """When the notice first came to this process (boot clock): its handler, hpcshard's
    script wrapper, or the entry point before either ran."""
    script, entry = sys.modules.get("hpcshard.script"), sys.modules.get("hpcshard.entry")
    return min([*_received, *getattr(script, "RECEIVED", ()), *getattr(entry, "EARLY_AT", ())], default=None)


def deadline() -> float | None:
    """Unix time at which the job's time limit ends, on this host's wall clock (now plus
    `time_left`), or None (no limit known)."""
    left = time_left()
    return None if left is None else time.time() + left


PHASES = ("step", "save", "eval", "load")
"""What `progress` takes: a step of training, a save, an evaluation, a load."""


def progress(step: int, phase: str = "step") -> None:
    """Tell this node's launcher that this rank begins `phase` of `step` (cheap: a write
    to shared memory, no collective, nothing on disk; nothing at all outside hpcshard).
    Steps are judged by the time steps have taken, other phases by `watchdog_phase_s`."""
    if phase not in PHASES:
        raise ValueError(f"progress(phase={phase!r}): use one of {', '.join(PHASES)}")
    _board.report(phase, int(step))


def exit_for_requeue() -> NoReturn:
    """`sys.exit(REQUEUE)`: call on every rank once the checkpoint is saved."""
    sys.exit(REQUEUE)


install()
