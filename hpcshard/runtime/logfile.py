"""A rank's log file on the run's storage, which may refuse writes (full, over quota,
read-only) while the run goes on, or stops cleanly.

logging's own FileHandler reports every record it cannot write with a "--- Logging
error ---" traceback on stderr: measured with the run directory on a full 40 MB tmpfs,
every log call of every rank printed one, burying the line that says what is wrong. This
one says once that the file cannot be written, leaves the records to the console, keeps
the last HELD of them, and tries the file again every RETRY_S; once it takes writes again,
the held records go in first (and how many more were lost).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time
from pathlib import Path

RETRY_S = 10.0
"""How long a log file that refused a write is left alone before it is tried again."""
HELD = 1000
"""Records kept, while the file refuses writes, for when it takes them again."""


class LogFile(logging.FileHandler):
    """`logging.FileHandler` that survives a file system refusing its writes (see the module).
    `say`: this rank says so on the console (rank 0: one line for the whole run)."""

    def __init__(self, path: Path, say: bool) -> None:
        super().__init__(path, encoding="utf-8")
        self.say = say
        self.refused_at: float | None = None
        """When the last write failed (the monotonic clock); None while writes land."""
        self.held: collections.deque[str] = collections.deque(maxlen=HELD)
        """The records not written since then (the newest HELD)."""
        self.lost = 0
        """Records not written and no longer held."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + self.terminator
        except Exception:  # a bad format string: logging's own report, as before
            self.handleError(record)
            return
        if self.refused_at is not None:
            self.lost += len(self.held) == self.held.maxlen
            self.held.append(text)
            if time.monotonic() - self.refused_at < RETRY_S:
                return
        try:
            if self.stream is None:  # (closed after a refused write: open it again)
                self.stream = self._open()
            if self.lost:
                self.stream.write(f"({self.lost} log record(s) lost while the storage refused "
                                  "writes)\n")
            self.stream.write("".join(self.held) if self.refused_at is not None else text)
            self.stream.flush()
        except OSError as err:
            self._refused(err, text)
            return
        if self.refused_at is not None and self.say:
            print(f"hpcshard: the log file {self.baseFilename} takes writes again", file=sys.stderr,
                  flush=True)
        self.refused_at, self.lost = None, 0
        self.held.clear()

    def _refused(self, err: OSError, text: str) -> None:
        """A write failed: hold the record, drop the stream's buffer (it would fail the next
        flush again, or land twice), and say so once, not for every record."""
        if self.refused_at is None:
            self.held.append(text)
            if self.say:
                print(f"hpcshard: the log file {self.baseFilename} cannot be written "
                      f"({err.strerror or err}); logging to the console only, trying the file "
                      f"again every {RETRY_S:.0f} s", file=sys.stderr, flush=True)
        self.refused_at = time.monotonic()
        stream, self.stream = self.stream, None  # type: ignore[assignment]
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.close()  # (its flush fails again; the descriptor is closed anyway)
