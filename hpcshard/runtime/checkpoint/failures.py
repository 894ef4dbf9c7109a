"""What a failed checkpoint load means, from the exceptions DCP and torch raise: try again,
a fault of the process or the file system, or a checkpoint whose content does not load;
and how the ranks agree on it (`load_agreed`).

Only the last is the checkpoint's: it is skipped for the previous one (and renamed
`.corrupt` once that one loads). The others never touch it: a transient error (ESTALE or
EIO on NFS and Lustre, a CUDA OOM while the killed cycle's memory is still held) is tried
again a few times; a fault, or a transient error that persists, fails the rank, and the
launchers restart the ranks, which read the same checkpoint again.

Content errors come in many types, because DCP reports damaged bytes as whatever the
reading code raised (torch 2.13, one rank, measured): a missing shard FileNotFoundError;
a shard cut short EOFError or RuntimeError ("PytorchStreamReader failed reading zip
archive"); a shard of zeros UnpicklingError; a missing or damaged `.metadata`
AssertionError ("metadata is None; global metadata read failed: ..."); a model that no
longer fits ValueError ("Size mismatch") or RuntimeError ("Missing key"). The file system
and the processes fail through few: OSError's errno, out of memory, torch.distributed's
DistError. So those are named, and everything else is content. A wrong "content" costs a
rename of a checkpoint that stays on disk, and happens only when an older one did load.
"""

from __future__ import annotations

import errno
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from hpcshard.runtime.checkpoint.io import one_line
from hpcshard.runtime.device import DistEnv

log = logging.getLogger("hpcshard")

CONTENT, TRANSIENT, FAULT = "content", "transient", "fault"
GRAVITY = {"": 0, CONTENT: 1, TRANSIENT: 2, FAULT: 3}
"""How ranks' outcomes combine: the gravest wins. Content only when no rank saw anything
else: quarantine is the one decision that acts on the checkpoint."""

TRANSIENT_ERRNOS = frozenset({
    errno.ESTALE,     # NFS: a file handle the server no longer knows; a new open looks it up again
    errno.EIO, errno.EREMOTEIO,  # a server or an OST that failed over
    errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ENOLCK, errno.ENOMEM,
    errno.ECONNRESET, errno.ECONNABORTED, errno.ENETDOWN, errno.ENETUNREACH,
    errno.EHOSTDOWN, errno.EHOSTUNREACH,
})
MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
"""OSErrors that say a file the checkpoint needs is not there: its content."""

LOAD_RETRY_DELAYS_S = (2.0, 4.0, 8.0, 16.0)
"""Waits between the tries of a load that failed for a transient reason, all ranks
together: ESTALE and EIO usually clear on the next open, and a CUDA OOM right after a
fault lasts until the killed cycle's processes are reaped and their memory freed
(seconds). 30 s in all; then the load is a fault, and the rank fails with it."""


class LoadFault(RuntimeError):
    """A checkpoint could not be read for a reason that is not its content (the file
    system, memory, a peer): the rank fails, the launchers restart the ranks, and the
    checkpoint is left as it is. Not a `UserError`: a restart may well succeed."""


class MetadataReader(FileSystemReader):
    """DCP's file reader, except that it keeps the real error of a failed `.metadata`
    read: DCP turns it into an AssertionError's text (so an ESTALE there would look like
    damage). Takes no `rank`: DCP then skips its fallback to per-rank metadata files, which
    hpcshard never writes (and whose own failure would be reported instead)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.metadata_error: BaseException | None = None

    def read_metadata(self, *args: Any) -> Metadata:  # noqa: D102 (DCP's)
        try:
            return super().read_metadata(*args)
        except Exception as err:
            self.metadata_error = err
            raise


def causes(err: BaseException) -> list[BaseException]:
    """The exceptions behind `err`: every failing rank's, when DCP gathered them into a
    CheckpointException (a BaseException with `.failures`: rank -> (exception, trace))."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [err]


def kind_of(err: BaseException) -> str:
    """CONTENT, TRANSIENT or FAULT for one exception (see the module's docstring)."""
    if isinstance(err, MISSING):
        return CONTENT
    if isinstance(err, OSError):  # TimeoutError and ConnectionError too
        return TRANSIENT if err.errno in TRANSIENT_ERRNOS else FAULT
    if isinstance(err, MemoryError | torch.OutOfMemoryError) or (
            isinstance(err, RuntimeError) and "out of memory" in str(err).lower()):
        return TRANSIENT
    if isinstance(err, dist.DistError):  # a peer gone, a store that timed out
        return FAULT
    return CONTENT


def classify(err: BaseException, also: BaseException | None = None) -> tuple[str, BaseException]:
    """The kind of a failed load, and the exception that says it best: the gravest of
    every rank's exceptions in `err` and `also` (the real error behind a failed
    `.metadata` read)."""
    found = [*causes(err), *([also] if also is not None else [])]
    worst = max(found, key=lambda e: GRAVITY[kind_of(e)])
    return kind_of(worst), worst


def gravest(outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    """Every rank's (kind, why) of one load, combined: the gravest, the lowest rank's
    among equals. Every rank computes it from the same gathered list, so every rank takes
    the same next step (try again, skip to an older checkpoint, or fail)."""
    return max(outcomes, key=lambda o: GRAVITY[o[0]])


def load_agreed(path: Path, load: Callable[[MetadataReader], None], env: DistEnv) -> str:
    """Run `load` (every rank's load of the checkpoint at `path`, through the reader it is
    given) on every rank; "" once every rank loaded it, else why its content does not
    load. Every rank's outcome is gathered and the gravest taken, so all take the same
    next step. A transient failure (on any rank) is tried again, all ranks together, after
    each of LOAD_RETRY_DELAYS_S; one that persists, and a fault, raise `LoadFault`."""
    tries = len(LOAD_RETRY_DELAYS_S) + 1
    for attempt in range(tries):
        outcomes: list[Any] = [None] * env.world
        dist.all_gather_object(outcomes, _try(path, load, env.device))
        kind, why = gravest([tuple(o) for o in outcomes])
        if kind in ("", CONTENT):
            if attempt and not kind and env.is_main:
                log.info("loaded %s at try %d of %d", path.name, attempt + 1, tries)
            return why
        if kind != TRANSIENT or attempt == tries - 1:
            break
        delay = LOAD_RETRY_DELAYS_S[attempt]
        if env.is_main:
            log.warning("loading %s failed (%s); a transient error: trying again in %.0f s "
                        "(try %d of %d)", path.name, why, delay, attempt + 2, tries)
        time.sleep(delay)
    raise LoadFault(f"checkpoint {path} could not be read ({kind}: {why}); it is left as it "
                    "is, for the restarted ranks to read again")


def _try(path: Path, load: Callable[[MetadataReader], None], device: torch.device) -> tuple[str, str]:
    """This rank's load: ("", "") when it loaded, else (kind, one line)."""
    reader = MetadataReader(str(path))
    try:
        load(reader)
        return "", ""
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt | SystemExit):
            raise
        log.debug("load failure", exc_info=err)
        kind, cause = classify(err, reader.metadata_error)
        outcome = (kind, one_line(cause))
        del cause  # (and `err`, at the end of this block: their frames hold the try's tensors)
    if outcome[0] == TRANSIENT:
        _free_memory(device)
    return outcome


def _free_memory(device: torch.device) -> None:
    """Give back what a failed load allocated, before the next try: a CUDA OOM on resume
    is often the killed cycle's memory, still held, plus this try's own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
