"""The Checkpointer's commit and resume when the files misbehave, in one process on a
1-rank gloo group, with real DCP saves and loads: a shard removed between the write and
the commit (a second job's start cleans every step-N.tmp), a transient ESTALE or CUDA OOM
while loading, an EIO that persists, a damaged shard. Only damage may cost a checkpoint."""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.fsdp import fully_shard

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.rundir import store
from hpcshard.runtime.checkpoint import Checkpointer, TrainParts, load_checkpoint, manager, save_checkpoint
from hpcshard.runtime.checkpoint.failures import (
    CONTENT,
    FAULT,
    TRANSIENT,
    LoadFault,
    classify,
    gravest,
)
from hpcshard.runtime.device import DistEnv
from tests.unit.test_rundir_manifest import WRONG

pytestmark = pytest.mark.unit


class Position:
    """The data position a checkpoint carries (GlobalBatches' two integers, here one)."""

    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def checkpointer(run: Path, hidden: int = 8, owner: str = "", **cfg: Any) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Linear(hidden, 2))
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    return Checkpointer(TrainParts(model=model, optimizer=optim, scheduler=sched, batches=Position()),
                        env, TrainConfig(**cfg), run, owner=owner)


def saved(ckpt: Checkpointer, *steps: int) -> None:
    for step in steps:
        ckpt.parts.batches.at = step
        assert ckpt.save(step, "periodic")


def names(ckpt: Checkpointer) -> list[str]:
    return sorted(p.name for p in ckpt.root.iterdir() if p.name != store.LATEST)


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager, "LOAD_RETRY_DELAYS_S", (0.01, 0.01, 0.01, 0.01))


def failing(times: int, err: Callable[[], BaseException], real: Callable[..., Any]) -> Callable[..., Any]:
    """`real`, raising `err()` on its first `times` calls."""
    calls = [0]

    def method(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] <= times:
            raise err()
        return real(*args, **kwargs)
    return method


# -- commit: only what DCP wrote --------------------------------------------------------

def test_a_shard_removed_before_the_commit_is_not_committed_and_the_older_one_stays(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """keep_last=1: had the torn save committed, retention would have deleted the only
    loadable checkpoint."""
    ckpt = checkpointer(tmp_path, keep_last=1)
    saved(ckpt, 2)
    real = manager.dcp.save

    def save_then_lose_a_shard(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        for shard in (ckpt.root / "step-00000004.tmp").glob("*.distcp"):
            shard.unlink()  # what a second job's clean_incomplete does
        return out
    monkeypatch.setattr(manager.dcp, "save", save_then_lose_a_shard)
    with caplog.at_level(logging.ERROR, logger="hpcshard"):
        assert not ckpt.save(4, "periodic")
    assert "checkpoint at step 4 NOT committed (__0_0.distcp is missing" in caplog.text
    assert names(ckpt) == [store.step_name(2)] and ckpt.last_saved == 2
    assert (ckpt.root / store.LATEST).read_text().strip() == store.step_name(2)
    monkeypatch.setattr(manager.dcp, "save", real)
    loaded = checkpointer(tmp_path).resume("auto")
    assert loaded is not None and loaded.step == 2


def test_an_async_save_is_checked_at_its_commit_too(world_of_one: None, tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, keep_last=1, async_save=True)
    saved(ckpt, 2)
    assert ckpt.wait()
    assert ckpt.save(4, "periodic")  # started: the write goes on beside training
    assert ckpt.pending is not None
    ckpt.pending[0].result()  # every rank's write is done; the commit comes with wait()
    (ckpt.root / "step-00000004.tmp" / store.METADATA).unlink()
    assert not ckpt.wait()
    assert names(ckpt) == [store.step_name(2)]


def test_the_manifest_lists_what_dcp_wrote_with_sizes(world_of_one: None, tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    saved(ckpt, 2)
    path = ckpt.root / store.step_name(2)
    files = store.inspect(path).manifest["files"]
    metadata = FileSystemReader(str(path)).read_metadata()
    written = {info.relative_path for info in metadata.storage_data.values()}
    assert set(files) == {*written, store.METADATA}
    assert all(files[name] == (path / name).stat().st_size for name in files)


# -- load: transient is not damage ------------------------------------------------------

@pytest.mark.parametrize("where", ["read_data", "read_metadata"])
def test_a_transient_estale_is_tried_again_and_nothing_is_quarantined(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_retries: None,
        where: str) -> None:
    saved(checkpointer(tmp_path), 2, 4)
    real = getattr(FileSystemReader, where)
    stale = failing(2, lambda: OSError(errno.ESTALE, "Stale file handle"), real)
    monkeypatch.setattr(FileSystemReader, where, stale)
    ckpt = checkpointer(tmp_path)
    loaded = ckpt.resume("auto")
    assert loaded is not None and loaded.step == 4 and ckpt.parts.batches.at == 4
    assert loaded.skipped == [] and names(ckpt) == [store.step_name(2), store.step_name(4)]


def test_a_cuda_oom_on_resume_is_tried_again(world_of_one: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, fast_retries: None) -> None:
    """The killed cycle's memory may still be held when the restarted ranks load."""
    saved(checkpointer(tmp_path), 2, 4)
    oom = failing(1, lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  Checkpointer._apply)
    monkeypatch.setattr(Checkpointer, "_apply", oom)
    loaded = checkpointer(tmp_path).resume("auto")
    assert loaded is not None and loaded.step == 4 and not loaded.skipped


def test_an_eio_that_persists_fails_the_rank_and_leaves_every_checkpoint(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_retries: None) -> None:
    """Not a user error (a ValueError would stop the run for good, exit 2), not damage."""
    saved(checkpointer(tmp_path), 2, 4)
    before = names(checkpointer(tmp_path))
    eio = failing(99, lambda: OSError(errno.EIO, "Input/output error"), FileSystemReader.read_data)
    monkeypatch.setattr(FileSystemReader, "read_data", eio)
    with pytest.raises(LoadFault, match=r"step-00000004 could not be read \(transient: OSError: \[Errno 5\]"):
        checkpointer(tmp_path).resume("auto")
    assert not issubclass(LoadFault, ValueError)
    assert names(checkpointer(tmp_path)) == before


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_shard_is_quarantined_and_the_older_one_loads(
        world_of_one: None, tmp_path: Path, damage: str) -> None:
    saved(checkpointer(tmp_path), 2, 4)
    shard = next((tmp_path / store.CHECKPOINTS / store.step_name(4)).glob("*.distcp"))
    data = shard.read_bytes()
    # truncated: the manifest's sizes catch it; zeroed (same size): the load does
    shard.write_bytes(data[:100] if damage == "truncated" else b"\0" * len(data))
    ckpt = checkpointer(tmp_path)
    loaded = ckpt.resume("auto")
    assert loaded is not None and loaded.step == 2 and ckpt.parts.batches.at == 2
    assert names(ckpt) == [store.step_name(2), store.step_name(4) + store.CORRUPT]


@pytest.mark.parametrize("shape", WRONG.values(), ids=WRONG.keys())
def test_a_manifest_of_the_wrong_shape_is_skipped_by_the_trainer_and_your_own_loop(
        world_of_one: None, tmp_path: Path, shape: Any) -> None:
    """Rank 0 picks alone while every other rank waits for its word: a manifest that made
    it raise (`manifest.get` on a list) left them waiting in the broadcast."""
    saved(checkpointer(tmp_path), 2, 4)
    newest = tmp_path / store.CHECKPOINTS / store.step_name(4) / store.MANIFEST
    newest.write_text(json.dumps(shape(json.loads(newest.read_text()))))
    ckpt = checkpointer(tmp_path)
    loaded = ckpt.resume("auto")
    assert loaded is not None and loaded.step == 2 and ckpt.parts.batches.at == 2
    assert loaded.skipped[0][0] == store.step_name(4) and "corrupt manifest (" in loaded.skipped[0][1]
    own = tmp_path / "own"
    for step in (2, 4):
        save_checkpoint(own, step, ckpt.parts.model, ckpt.parts.optimizer, extra={"at": step})
    newest = own / store.step_name(4) / store.MANIFEST
    newest.write_text(json.dumps(shape(json.loads(newest.read_text()))))
    found = load_checkpoint(own, ckpt.parts.model, ckpt.parts.optimizer)
    assert found is not None and found["step"] == 2 and found["extra"] == {"at": 2}


def test_rank_0_failing_to_choose_fails_every_rank_with_it(world_of_one: None, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever makes rank 0's choice raise (a bug) reaches every rank as its answer, a
    `LoadFault`, instead of rank 0 alone leaving while the others wait for the answer."""
    saved(checkpointer(tmp_path), 2)
    monkeypatch.setattr(manager.store, "select", failing(1, lambda: TypeError("a bug"), store.select))
    with pytest.raises(LoadFault, match="choosing the checkpoint in .* failed: TypeError: a bug"):
        checkpointer(tmp_path).resume("auto")


def test_a_checkpoint_that_does_not_fit_the_model_is_a_user_error(world_of_one: None, tmp_path: Path) -> None:
    saved(checkpointer(tmp_path), 2)
    ckpt = checkpointer(tmp_path, hidden=4)
    with pytest.raises(UserError, match="no checkpoint in .* could be loaded.*Size mismatch"):
        ckpt.resume("auto")
    assert names(ckpt) == [store.step_name(2)]  # nothing renamed


def test_an_unreadable_directory_is_a_fault_not_a_skip(world_of_one: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       fast_retries: None) -> None:
    saved(checkpointer(tmp_path), 2, 4)
    real = Path.read_text

    def stale(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == store.MANIFEST and self.parent.name == store.step_name(4):
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", stale)
    with pytest.raises(LoadFault, match="could not be read.*Stale file handle"):
        checkpointer(tmp_path).resume("auto")
    monkeypatch.setattr(Path, "read_text", real)
    assert names(checkpointer(tmp_path)) == [store.step_name(2), store.step_name(4)]


# -- the classification itself ----------------------------------------------------------

class Gathered(BaseException):
    """DCP's CheckpointException in shape: every failing rank's (exception, trace)."""

    def __init__(self, *errors: BaseException) -> None:
        super().__init__("gathered")
        self.failures = {rank: (e, None) for rank, e in enumerate(errors)}


@pytest.mark.parametrize("err, kind", [
    (OSError(errno.ESTALE, "Stale file handle"), TRANSIENT),
    (OSError(errno.EIO, "Input/output error"), TRANSIENT),
    (torch.OutOfMemoryError("CUDA out of memory"), TRANSIENT),
    (RuntimeError("CUDA error: out of memory"), TRANSIENT),
    (OSError(errno.EACCES, "Permission denied"), FAULT),
    (torch.distributed.DistBackendError("peer gone"), FAULT),
    (FileNotFoundError(errno.ENOENT, "No such file"), CONTENT),
    (EOFError(), CONTENT),
    (RuntimeError("PytorchStreamReader failed reading zip archive"), CONTENT),
    (AssertionError("metadata is None"), CONTENT),
    (ValueError("Size mismatch between saved torch.Size([64]) and current"), CONTENT),
    (Gathered(AssertionError("metadata is None"), OSError(errno.ESTALE, "x")), TRANSIENT),
    (Gathered(EOFError(), FileNotFoundError(errno.ENOENT, "x")), CONTENT),
])
def test_what_a_failed_load_means(err: BaseException, kind: str) -> None:
    assert classify(err)[0] == kind


def test_the_real_error_behind_damaged_looking_metadata_decides() -> None:
    """DCP reports any failed `.metadata` read as an AssertionError's text."""
    assert classify(AssertionError("metadata is None; global metadata read failed: [Errno 116]"),
                    OSError(errno.ESTALE, "Stale file handle"))[0] == TRANSIENT


def test_the_ranks_take_the_gravest_outcome() -> None:
    assert gravest([("", ""), (CONTENT, "a"), (TRANSIENT, "b"), (CONTENT, "c")]) == (TRANSIENT, "b")
    assert gravest([("", ""), (CONTENT, "a"), (CONTENT, "c")]) == (CONTENT, "a")
    assert gravest([(FAULT, "f"), (TRANSIENT, "b")]) == (FAULT, "f")
    assert gravest([("", ""), ("", "")]) == ("", "")

