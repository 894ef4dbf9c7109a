"""Batches prepared ahead, in a background thread, while the step before them computes.

The thread only computes: what a global batch holds is a pure function of where it
starts, (epoch, offset), so the batches it prepares are the ones the loop would have read
itself. The position stays the loop's (`GlobalBatches`): a checkpoint saves the next step
to train, never a prefetched one; after a restore or a rollback the prepared batches whose
start no longer comes next are dropped, and the loop reads its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

Key = tuple[int, int]
T = TypeVar("T")


class Ahead(Generic[T]):
    """Runs `fetch(epoch, offset)` for the starts `plan` names, one at a time, in one
    thread; `take` returns a planned result, or fetches in the caller when none was.

    The thread is a daemon: a read blocked on a hung file system cannot keep the rank's
    process from exiting (what it was preparing is dropped anyway)."""

    def __init__(self, fetch: Callable[[int, int], T]) -> None:
        self.fetch = fetch
        self.queued: dict[Key, Future[T]] = {}
        self.todo: queue.SimpleQueue[tuple[Key, Future[T]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name="hpcshard-data", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (job := self.todo.get()) is not None:
            key, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.fetch(*key))
            except BaseException as err:  # handed to `take`, which raises it in the loop
                future.set_exception(err)

    def take(self, key: Key) -> T:
        future = self.queued.pop(key, None)
        return future.result() if future is not None else self.fetch(*key)

    def plan(self, keys: list[Key]) -> None:
        """Prepare these starts next (in this order); drop what was planned for others."""
        for stale in [k for k in self.queued if k not in keys]:
            self.queued.pop(stale).cancel()
        for key in keys:
            if key not in self.queued:
                future: Future[T] = Future()
                self.queued[key] = future
                self.todo.put((key, future))

    def close(self) -> None:
        for future in self.queued.values():
            future.cancel()
        self.queued.clear()
        self.todo.put(None)  # the thread ends after what it is running; never waited for
