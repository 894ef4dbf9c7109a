"""The Checkpointer when the run is no longer this job's (`rundir.lease`) or its storage
takes no save (full, over quota, read-only), in one process on a 1-rank gloo group with
real DCP saves: a job that was taken over commits nothing and cleans nothing; a save the
storage refused says what is full and how big the next checkpoint is."""

from __future__ import annotations

import errno
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from hpcshard.rundir import lease, store
from hpcshard.runtime.checkpoint import manager
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
