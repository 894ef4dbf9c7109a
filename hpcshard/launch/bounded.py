"""One call on the run directory, in a thread of its own, with a time limit, while the
launcher beats. A hard NFS mount whose server is gone blocks a write, a read or a stat until
the server is back (a Lustre OST that is gone blocks a stat of the files on it): a launcher
silent meanwhile is taken for lost, its node blamed for the storage, and one that waits for
good holds the fault path for good. The storage's probe (`launch.health`) and every write
and read of the run directory on the fault path (`Supervisor._try`, `Supervisor._readable`)
go through `bounded`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.2
"""How often `waiting` is called while the call runs."""


class Hung(TimeoutError):
    """The call gave no answer within its bound. Its thread is left behind, blocked (nothing
    stops a thread blocked in the kernel): a daemon thread, which ends with the launcher."""


def bounded(call: Callable[[], T], within: float, waiting: Callable[[], None], poll: float = POLL_S) -> T:
    """`call()`'s result, or its exception, run in a daemon thread; `waiting` is called every
    `poll` while it runs (the launcher beats; what `waiting` raises leaves at once). Hung
    after `within` seconds."""
    answer: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            answer.append(call())
        except BaseException as err:
            failed.append(err)

    thread = threading.Thread(target=run, name="hpcshard-io", daemon=True)
    thread.start()
    deadline = time.monotonic() + within
    while thread.is_alive():
        waiting()
        thread.join(poll)
        if thread.is_alive() and time.monotonic() > deadline:
            raise Hung(f"no answer within {within:.0f} s (hung?)")
    if failed:
        raise failed[0]
    return answer[0]
