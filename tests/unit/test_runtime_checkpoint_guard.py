"""The Checkpointer when the run is no longer this job's (`rundir.lease`) or its storage
takes no save (full, over quota, read-only), in one process on a 1-rank gloo group with
real DCP saves: a job that was taken over commits nothing and cleans nothing; a save the
storage refused says what is full and how big the next checkpoint is."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from hpcshard.rundir import lease, store
from hpcshard.runtime.checkpoint import guard, manager
from hpcshard.runtime.checkpoint.guard import Disowned, storage_trouble
from tests.unit.test_runtime_checkpoint_recovery import checkpointer, names, saved

pytestmark = pytest.mark.unit


def owned_by(run: Path, job: str) -> lease.Owner:
    return lease.take(run, lease.Owner.of_job(job), lambda j: False)


def test_a_job_taken_over_commits_nothing_and_leaves_its_save_and_the_older_ones(
        world_of_one: None, tmp_path: Path) -> None:
    mine = owned_by(tmp_path, "100")
    ckpt = checkpointer(tmp_path, keep_last=1, owner=mine.token)
    saved(ckpt, 2)
    owned_by(tmp_path, "200")  # a guard (or a resume) took the run over: job 100 seemed over
    with pytest.raises(Disowned, match=rf"this job no longer owns {tmp_path} \(now: Slurm job 200\); "
                                       "it stops without committing"):
        ckpt.save(4, "periodic")
    # Not promoted, not removed (it may be the new owner's save of that step), and the
    # older checkpoint neither retired (keep_last=1) nor moved.
    assert names(ckpt) == [store.step_name(2), store.step_name(4) + store.TMP_SUFFIX]
    assert (ckpt.root / store.LATEST).read_text().strip() == store.step_name(2)
    assert ckpt.last_saved == 2


def test_a_start_under_another_owner_removes_nothing(world_of_one: None, tmp_path: Path) -> None:
    mine = owned_by(tmp_path, "100")
    saved(checkpointer(tmp_path, owner=mine.token), 2)
    theirs = tmp_path / store.CHECKPOINTS / (store.step_name(4) + store.TMP_SUFFIX)
    theirs.mkdir()  # the new owner's save in progress
    lease.path(tmp_path).write_text(lease.Owner(kind="job", job="200", epoch=9).to_json())
    with pytest.raises(Disowned, match=r"no longer owns .* \(now: job:200\); it stops without cleaning"):
        checkpointer(tmp_path, owner=mine.token).resume("auto")
    assert theirs.is_dir()
    with pytest.raises(Disowned):  # nor does resuming an older step move newer ones aside
        checkpointer(tmp_path, owner=mine.token).resume("2")


def test_the_owner_and_a_run_without_a_lease_go_on(world_of_one: None, tmp_path: Path) -> None:
    mine = owned_by(tmp_path, "100")
    saved(checkpointer(tmp_path, owner=mine.token), 2)
    stale = tmp_path / store.CHECKPOINTS / (store.step_name(4) + store.TMP_SUFFIX)
    stale.mkdir()
    loaded = checkpointer(tmp_path, owner=mine.token).resume("auto")
    assert loaded is not None and loaded.step == 2 and not stale.exists()
    saved(checkpointer(tmp_path), 6)  # no token: an older launcher, a test


def test_a_reader_beside_the_run_loads_a_step_and_changes_nothing(world_of_one: None, tmp_path: Path) -> None:
    """`--then eval` (`runtime.evaluate`) loads the step the run finished at while the run
    may have been resumed: its newer step and its save in progress stay where they are."""
    saved(checkpointer(tmp_path), 2, 4)
    theirs = tmp_path / store.CHECKPOINTS / (store.step_name(6) + store.TMP_SUFFIX)
    theirs.mkdir()  # the resumed run's save in progress
    loaded = checkpointer(tmp_path).resume("2", reader=True)
    assert loaded is not None and loaded.step == 2
    assert theirs.is_dir() and store.step_name(4) in names(checkpointer(tmp_path))
    assert not list((tmp_path / store.CHECKPOINTS).glob("superseded-*"))


def raising(err: BaseException) -> Any:
    def save(*args: Any, **kwargs: Any) -> Any:
        raise err
    return save


@pytest.mark.parametrize("code, said", [
    (errno.ENOSPC, "no space left on the device holding .*/checkpoints "),
    (errno.EDQUOT, ".*/checkpoints is over its disk quota "),
    (errno.EROFS, "the device holding .*/checkpoints is read-only "),
])
def test_a_save_the_storage_refused_says_what_is_full_and_how_big_the_next_one_is(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, code: int, said: str) -> None:
    ckpt = checkpointer(tmp_path, keep_last=1)
    saved(ckpt, 2)
    size = ckpt.last_bytes
    monkeypatch.setattr(manager.dcp, "save", raising(OSError(code, "refused")))
    with caplog.at_level(logging.DEBUG, logger="hpcshard"):
        assert not ckpt.save(4, "periodic")
    assert re.match(said, ckpt.full), ckpt.full
    assert f"the next checkpoint needs about {size / 1e6:.1f} MB" in ckpt.full
    assert f"checkpoint at step 4 FAILED: {ckpt.full} [OSError: [Errno {code}] refused]" in caplog.text
    assert names(ckpt) == [store.step_name(2)]  # the failed save removed, the older one kept


def test_a_full_disk_is_told_from_other_failures_and_a_commit_clears_it(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = checkpointer(tmp_path)
    real = manager.dcp.save
    monkeypatch.setattr(manager.dcp, "save", raising(OSError(errno.ENOSPC, "No space left on device")))
    assert not ckpt.save(2, "periodic") and ckpt.full
    monkeypatch.setattr(manager.dcp, "save", raising(RuntimeError("a peer went away")))
    assert not ckpt.save(2, "periodic") and not ckpt.full  # one save lost, nothing more
    monkeypatch.setattr(manager.dcp, "save", raising(OSError(errno.ENOSPC, "No space left on device")))
    assert not ckpt.save(2, "periodic") and ckpt.full
    monkeypatch.setattr(manager.dcp, "save", real)
    assert ckpt.save(2, "periodic") and not ckpt.full


def test_torch_saves_report_of_a_full_disk_is_judged_by_the_room_left(tmp_path: Path) -> None:
    """torch.save says "unexpected pos N vs M" for a write into a full file system."""
    cut = RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 64 vs 32")
    assert storage_trouble(cut, tmp_path / "checkpoints", need=1 << 60).startswith(
        f"no space left on the device holding {tmp_path / 'checkpoints'}")
    assert storage_trouble(cut, tmp_path / "checkpoints", need=1) == ""


class Quota:
    """A user or project quota on the run directory, as the kernel keeps one: a write that
    would take the files under `root` past `room` more bytes than they hold now writes what
    fits and returns that (a short write); the next one fails with EDQUOT. statvfs still
    shows the device's free space."""

    def __init__(self, root: Path, room: int) -> None:
        self.root = root
        self.limit = self.used() + room

    def used(self) -> int:
        total = 0
        for path in self.root.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size if path.is_file() else 0
        return total

    def room(self, size: int) -> int:
        """What a write of `size` bytes may write now; EDQUOT when nothing."""
        room = self.limit - self.used()
        if room <= 0:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return min(size, room)


def midway(ckpt_dir: Path) -> int:
    """Bytes into a save of the same state that fall a quarter into its largest tensor's
    data. A quota met there is met by torch.save's write of the tensor, and what the short
    write left (over 8 KiB: Python's buffer) fails with it: DCP then reports the save as
    "unexpected pos N vs M", with no errno, as it does on a full tmpfs (measured, torch
    2.13). Met in the last 8 KiB of a write, the rest would wait in the buffer and the
    file's close would raise EDQUOT itself: tensors of real size make that rare."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    largest = max(metadata.storage_data.values(), key=lambda info: info.length)
    assert largest.length > 4 * io.DEFAULT_BUFFER_SIZE
    return largest.offset + largest.length // 4


def dcp_writes_under(monkeypatch: pytest.MonkeyPatch, quota: Quota) -> None:
    """DCP's file writer opens its files as `Path.open("wb")` does (a BufferedWriter over a
    FileIO), whose raw writes meet `quota` as a write(2) meets the kernel's."""
    class QuotaFile(io.FileIO):
        def write(self, data: Any) -> int:
            view = memoryview(data)
            return super().write(view[:quota.room(len(view))])

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Any:
        if mode != "wb":
            with real(self, path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(QuotaFile(path, "w")) as stream:
            yield stream
    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def probe_writes_under(monkeypatch: pytest.MonkeyPatch, quota: Quota) -> None:
    """The write probe's write(2) meets `quota` too (a quota cannot be made here for real)."""
    def write(fd: int, data: bytes) -> None:
        real_write_all(fd, data[:quota.room(len(data))])
        quota.room(1)  # (the kernel's answer to the rest)
    real_write_all = guard._write_all
    monkeypatch.setattr(guard, "_write_all", write)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_refused_by_a_quota_without_an_errno_is_named_by_the_write_probe(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, async_save: bool) -> None:
    """Under a quota, DCP's writer reports the refused write as torch.save's "unexpected
    pos N vs M" (no errno) and statvfs shows the device's free room: the save was a plain
    failure, and every later one failed the same way without the storage rule ever
    stopping the run. The probe runs before the failed save is removed: with its bytes
    gone, the quota's room would take the probe."""
    ckpt = checkpointer(tmp_path, hidden=4096, async_save=async_save)
    saved(ckpt, 2)
    ckpt.wait()
    size = ckpt.last_bytes
    room = midway(tmp_path / store.CHECKPOINTS / store.step_name(2))
    monkeypatch.setattr(guard, "PROBE_BYTES", room // 2)  # (with the failed save removed, it fits)
    quota = Quota(tmp_path, room)
    dcp_writes_under(monkeypatch, quota)
    probe_writes_under(monkeypatch, quota)
    with caplog.at_level(logging.DEBUG, logger="hpcshard"):
        assert not (ckpt.save(4, "periodic") and ckpt.wait())  # (async: the failure comes at the wait)
    assert "unexpected pos" in caplog.text  # the real shape of the failure: no errno
    root = tmp_path / store.CHECKPOINTS
    assert ckpt.full.startswith(f"{root} is over its disk quota (a write probe in {root} got EDQUOT: "
                                "Disk quota exceeded; "), ckpt.full
    assert f"the next checkpoint needs about {size / 1e6:.1f} MB" in ckpt.full
    assert names(ckpt) == [store.step_name(2)]  # the failed save and the probe removed


def test_saves_that_fail_without_an_errno_stop_the_run_at_the_third_in_a_row(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """One full Lustre OST: the shards' writes are refused (no errno), the probe's file
    lands on another OST and is written. Each failure is a plain one, said with what the
    probe found; the third in a row is the storage's, as a full disk is (the trainer
    then stops the run with that line, or trains on with on_storage_full=train); a commit
    starts the count again."""
    ckpt = checkpointer(tmp_path, hidden=4096)
    saved(ckpt, 2)
    real = FileSystem.create_stream
    room = midway(tmp_path / store.CHECKPOINTS / store.step_name(2))
    dcp_writes_under(monkeypatch, Quota(tmp_path, room))
    root = tmp_path / store.CHECKPOINTS
    with caplog.at_level(logging.DEBUG, logger="hpcshard"):
        assert not ckpt.save(4, "periodic") and not ckpt.full
        assert not ckpt.save(4, "periodic") and not ckpt.full
        monkeypatch.setattr(FileSystem, "create_stream", real)  # the OST had room for a moment
        assert ckpt.save(4, "periodic")
        dcp_writes_under(monkeypatch, Quota(tmp_path, room))
        assert not ckpt.save(6, "periodic") and not ckpt.full
        assert not ckpt.save(6, "periodic") and not ckpt.full
        assert not ckpt.save(6, "periodic")
    assert re.fullmatch(rf"3 saves in a row failed, the last with RuntimeError: .*unexpected pos \d+ vs "
                        rf"\d+ \(a write probe in {re.escape(str(root))} succeeded\): "
                        rf"{re.escape(str(root))} takes no checkpoint", ckpt.full), ckpt.full
    assert re.search(r"checkpoint at step 6 FAILED: RuntimeError: .*unexpected pos .* \(a write probe in "
                     rf"{re.escape(str(root))} succeeded\); training state", caplog.text)
    assert names(ckpt) == [store.step_name(2), store.step_name(4)]


def test_a_probe_that_gets_another_error_names_it_and_the_save_is_one_failure(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """EIO (a soft NFS mount, an evicted Lustre client) passes: one save lost, said with
    the errno, counted toward the three."""
    ckpt = checkpointer(tmp_path)
    saved(ckpt, 2)
    monkeypatch.setattr(manager.dcp, "save", raising(RuntimeError("unexpected pos 64 vs 32")))

    def eio(fd: int, data: bytes) -> None:
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(guard, "_write_all", eio)
    with caplog.at_level(logging.ERROR, logger="hpcshard"):
        assert not ckpt.save(4, "periodic") and not ckpt.full
    root = tmp_path / store.CHECKPOINTS
    assert (f"checkpoint at step 4 FAILED: RuntimeError: unexpected pos 64 vs 32 (a write probe in {root} "
            "got EIO: Input/output error); training state and earlier checkpoints are intact") in caplog.text
    assert ckpt.failures == 1 and names(ckpt) == [store.step_name(2)]
