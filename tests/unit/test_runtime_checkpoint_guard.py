"""The Checkpointer when the run is no longer this job's (`rundir.lease`) or its storage
takes no save (full, over quota, read-only), in one process on a 1-rank gloo group with
real DCP saves: a job that was taken over commits nothing and cleans nothing; a save the
storage refused says what is full and how big the next checkpoint is."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from hpcshard.rundir import events, lease, ledger, store
from hpcshard.rundir.events import EndReason
from hpcshard.runtime.checkpoint import guard, manager
from hpcshard.runtime.checkpoint.guard import Disowned, storage_trouble
from hpcshard.runtime.checkpoint.io import one_line
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
    assert re.fullmatch(rf"the saves failed 3 times in a row, the last with RuntimeError: .*unexpected pos "
                        rf"\d+ vs \d+; a write probe beside them wrote fine, so the checkpoint directory "
                        rf"{re.escape(str(root))} takes no checkpoint for a reason not known \(a quota on "
                        r"one OST, a failing server, or the job's state not saving\)", ckpt.full), ckpt.full
    assert ckpt.full.count(str(root)) == 1 and ckpt.fix == guard.FIND  # (not "free space")
    assert re.search(r"checkpoint at step 6 FAILED: RuntimeError: .*unexpected pos .* \(a write probe in "
                     rf"{re.escape(str(root))} succeeded\); training state and earlier checkpoints are "
                     r"intact; 2 in a row \(3 are the storage's\)", caplog.text)
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


# -- failed saves in a row, across restarts and requeues ---------------------------------

CUT = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 2048")
"""How DCP's writer reports a write one full OST refused: no errno (the probe writes fine)."""


def a_start(run: Path, attempt: int, cycle: int = 0) -> manager.Checkpointer:
    """A new process of the run, resumed from its newest checkpoint, as the runtime starts
    one: a restart (the next cycle) or a requeue (the next attempt)."""
    ckpt = checkpointer(run)
    ckpt.start = (attempt, cycle)
    assert ckpt.resume("auto") is not None
    return ckpt


def in_a_row(caplog: pytest.LogCaptureFixture) -> list[int]:
    """The count each plain failure's line gave, in order."""
    return [int(n) for n in re.findall(r"are intact; (\d+) in a row", caplog.text)]


def test_failed_saves_count_across_requeues_and_the_third_in_a_row_stops_the_run(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The loop of issue 42's defect 2: each requeue resumed from the last good checkpoint,
    failed its saves again and counted from zero (four attempts of two failed saves each,
    8 in a row, never stopped), its attempt's training lost up to max_requeues times. Each
    failed save is in the ledger now, and the row is those that followed the checkpoint
    the ranks resumed from: the requeue's first failure is the third."""
    saved(checkpointer(tmp_path), 2)
    monkeypatch.setattr(manager.dcp, "save", raising(CUT))
    root = tmp_path / store.CHECKPOINTS
    with caplog.at_level(logging.ERROR, logger="hpcshard"):
        first = a_start(tmp_path, 0)
        assert not first.save(4, "periodic") and not first.save(6, "periodic") and not first.full
        requeued = a_start(tmp_path, 1)
        assert not requeued.save(4, "periodic") and requeued.full
    assert requeued.full.startswith("the saves failed 3 times in a row, the last with RuntimeError: "), \
        requeued.full
    assert in_a_row(caplog) == [1, 2]
    assert f"wrote fine, so the checkpoint directory {root} takes no checkpoint" in requeued.full
    failed = [(r["attempt"], r["cycle"], r["step"], r["since"], r["probe"], r["error"])
              for r in ledger.read(tmp_path) if r["event"] == "save_failed"]
    assert failed == [(0, 0, 4, 2, "ok", one_line(CUT)), (0, 0, 6, 2, "ok", one_line(CUT)),
                      (1, 0, 4, 2, "ok", one_line(CUT))]


def test_a_commit_or_a_stop_for_the_storage_starts_the_row_again_and_a_restart_does_not(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A restart (the next cycle) counts on, as a requeue does. A commit ends the row: the
    saves after it follow a newer checkpoint, in this process and in the next. A run that
    stopped for its storage is resumed by its user once the cause is fixed: its saves get
    their three tries again."""
    saved(checkpointer(tmp_path), 2)
    real = manager.dcp.save
    monkeypatch.setattr(manager.dcp, "save", raising(CUT))
    with caplog.at_level(logging.ERROR, logger="hpcshard"):
        assert not a_start(tmp_path, 0, 0).save(4, "periodic")  # 1
        restarted = a_start(tmp_path, 0, 1)
        assert not restarted.save(4, "periodic")  # 2
        monkeypatch.setattr(manager.dcp, "save", real)
        assert restarted.save(4, "periodic")  # committed: a new row
        monkeypatch.setattr(manager.dcp, "save", raising(CUT))
        assert not restarted.save(6, "periodic")  # 1 (after step 4)
        requeued = a_start(tmp_path, 1)
        assert not requeued.save(6, "periodic") and not requeued.full  # 2
        assert not requeued.save(8, "periodic") and requeued.full  # 3: the run stops
        ledger.append(tmp_path, events.End(attempt=1, cycle=0, reason=EndReason.STORAGE, step=8, saved_step=4,
                                           storage=requeued.full))  # (as runtime.main writes it)
        resumed = a_start(tmp_path, 2)
        assert not resumed.save(6, "periodic") and not resumed.full
    assert in_a_row(caplog) == [1, 2, 1, 2, 1]


def test_a_ledger_that_refuses_the_record_fails_nothing_and_the_process_counts_its_own(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Storage that refuses the checkpoints may refuse the ledger's record too (or its lock
    may time out): said once per save, never raised on rank 0 alone (the others wait for
    its word), and this process's own failures still count to three."""
    ckpt = checkpointer(tmp_path)
    saved(ckpt, 2)
    monkeypatch.setattr(manager.dcp, "save", raising(CUT))
    monkeypatch.setattr(manager.ledger, "append", raising(OSError(errno.EIO, "Input/output error")))
    with caplog.at_level(logging.WARNING, logger="hpcshard"):
        assert not ckpt.save(4, "periodic") and not ckpt.save(6, "periodic") and not ckpt.full
        assert not ckpt.save(8, "periodic") and ckpt.full.startswith("the saves failed 3 times in a row")
    assert caplog.text.count("could not be recorded in the ledger (OSError: [Errno 5] Input/output error): "
                             "a restart or requeue will not count it") == 3


def test_the_write_probe_goes_where_the_next_start_removes_it_though_no_save_made_the_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that failed before it made `checkpoints/` left the probe in the run directory,
    where no start looks: one a killed rank left there stayed for good."""
    root = tmp_path / store.CHECKPOINTS
    written: list[Path] = []

    def write(fd: int, data: bytes) -> None:  # (where the probe is while it writes)
        written.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
    monkeypatch.setattr(guard, "_write_all", write)
    assert guard.probe(root, CUT) == guard.Probe(ran=True)
    (probe,) = written
    assert probe.parent == root and not probe.exists()
    assert oct(root.stat().st_mode & 0o777) == oct(0o750)  # (as a save makes it)
    probe.write_bytes(b"left by a rank killed while it wrote")
    store.clean_incomplete(root)
    assert list(root.iterdir()) == []


def test_a_write_probe_that_raises_fails_the_save_on_every_rank_alike(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 must never raise alone in a save's outcome (the others wait for its word):
    the probe is inside that guarantee, not beside it; the failed save is removed still."""
    ckpt = checkpointer(tmp_path)
    saved(ckpt, 2)

    def bug(root: Path, err: BaseException) -> guard.Probe:
        (root / (store.step_name(4) + store.TMP_SUFFIX)).mkdir()  # (what the failed save left)
        raise RuntimeError("a bug in the probe")
    monkeypatch.setattr(manager.dcp, "save", raising(CUT))
    monkeypatch.setattr(manager, "probe", bug)
    with caplog.at_level(logging.ERROR, logger="hpcshard"):
        assert not ckpt.save(4, "periodic") and not ckpt.full
    assert "(and judging why failed: a bug in the probe)" in caplog.text
    assert names(ckpt) == [store.step_name(2)]
