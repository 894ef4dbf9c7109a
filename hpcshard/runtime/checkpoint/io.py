"""How DCP writes for hpcshard: a private step-N.tmp made inside DCP's own first step,
a stager that starts its copy only once `async_save` has returned, fast torch.save, what
DCP's `.metadata` says was written (what a commit checks), and one line for a failure
that DCP reports for every rank."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils.serialization import config as serialization

from hpcshard.rundir import store


def one_line(err: BaseException) -> str:
    """The first line of the first rank's error (DCP wraps all ranks' tracebacks)."""
    failures = getattr(err, "failures", None)
    first = next(iter(failures.values())) if failures else err
    if isinstance(first, tuple):
        first = first[0]
    text = str(first).strip().splitlines()
    return f"{type(first).__name__}: {text[0] if text else ''}"


def written_by_dcp(path: Path) -> dict[str, int]:
    """What DCP's `.metadata` in `path` says was written: each file it names, with the
    fewest bytes that file must hold (the end of its last item), for `store.commit` to
    check. {} when there is no `.metadata` (the commit then refuses, naming it)."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        return {}
    except OSError:
        raise  # the file system's trouble: the save fails as any write would
    except Exception as err:  # a pickle cut short or damaged
        raise store.Incomplete(f"{store.METADATA} cannot be read ({one_line(err)}) in {path}") from None
    least: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        least[info.relative_path] = max(least.get(info.relative_path, 0), info.offset + info.length)
    return least


def fast_writes() -> None:
    """DCP writes each tensor with torch.save, which by default also computes a zip CRC32
    over every byte: half of a CPU rank's serialisation time, for a checksum nothing reads
    (torch.load does not verify it; the manifest's sizes catch truncated files). Off for
    this process, a rank: DCP's writes may run in a background thread (async saves)."""
    serialization.save.compute_crc32 = False


class HandOffStager(DefaultStager):
    """DCP's async stager (copies the state in a background thread), except that the
    copy starts when `start()` is called, once `async_save` has returned, instead of
    inside it: a copy thread started earlier competes with the training thread for the
    interpreter and the cores while training is still waiting on the call."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False))
        self.held: tuple[Future[Any], Any, dict[str, Any]] | None = None

    def stage(self, state_dict: Any, **kwargs: Any) -> Future[Any]:
        done: Future[Any] = Future()
        self.held = (done, state_dict, kwargs)
        self._staging_future = done
        return done

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        # DefaultStager._stage as in torch 2.13 for these options (a blocking copy). Torch
        # 2.11 and 2.12 end it with `self._state_dict_stager.close()`, which empties the
        # copier's dispatch table: every later save's copy fails with KeyError(<class
        # 'type'>) (pytorch#183413). This stager lives as long as the run: nothing to close.
        return self._state_dict_stager.stage(state_dict, non_blocking=False)

    def start(self) -> None:
        if self.held is None:
            return
        (done, state_dict, kwargs), self.held = self.held, None
        assert self._staging_executor is not None
        try:
            copy = self._staging_executor.submit(self._stage, state_dict, **kwargs)
        except BaseException as err:  # never leave DCP's upload thread waiting on `done`
            done.set_exception(err)
            raise

        def forward(f: Future[Any]) -> None:
            if f.exception() is not None:
                done.set_exception(f.exception())
            else:
                done.set_result(f.result())
        copy.add_done_callback(forward)

    def drop(self, err: BaseException) -> None:
        """async_save failed after staging was asked for: fail the held copy instead."""
        if self.held is not None:
            (done, _, _), self.held = self.held, None
            done.set_exception(err)


def private_dir(path: Path) -> None:
    """0750 whatever the umask: the loader refuses group-writable checkpoints."""
    path.mkdir(exist_ok=True, mode=0o750)
    path.chmod(0o750)


class PrivateWriter(FileSystemWriter):
    """DCP's file writer, except that rank 0 makes `step-N.tmp` private (0750) in DCP's
    first step: before its plan exchange, and so before any rank writes, with no collective
    of hpcshard's own (the broadcast that used to order it was training's longest wait in
    an async save). In an async save this runs in DCP's background thread; a failure (a
    quota, a read-only remount) reaches every rank as DCP's error for the save.

    It never clears an existing `step-N.tmp`: every rank creates the directory in this same
    step (DCP's own mkdir), so a removal here races their `makedirs` (seen under load: a
    rank's makedirs failed with FileExistsError and the final save with it). Stale ones
    never get here: a failed save removes its own, and a start removes the rest."""

    def __init__(self, tmp: Path, root: Path, main: bool) -> None:
        super().__init__(str(tmp))
        self.tmp, self.root, self.main = tmp, root, main

    def prepare_local_plan(self, plan: Any) -> Any:
        if self.main:
            private_dir(self.root)
            private_dir(self.tmp)
        return super().prepare_local_plan(plan)
