"""A process's console that never fails it (stdlib).

Under Slurm a launcher's and its ranks' stdout and stderr are files in the run directory
(submitit's `%j_%t_log.out/err`): on a full, over-quota or read-only file system a `print`
raises OSError. Measured in the chaos soak: a launcher died of its own message that its
heartbeat could not be written ("No space left on device" from `print`), before it could
say it was done, and its peers waited for it. A line that cannot be written is lost;
the process goes on.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO


class Unfailing:
    """A text stream whose writes and flushes never raise OSError (what they could not
    write is dropped); everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def harden() -> None:
    """This process's stdout and stderr never fail it (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Unfailing):
            setattr(sys, name, Unfailing(stream))
