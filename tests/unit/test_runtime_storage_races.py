"""Races and misclassifications a second review of the runtime's storage stop and lease
checks found (issue 26), each reproduced before its mend: a file server's blip while the
run directory is probed, taken for a user error; rank 0 raising alone while it judged a
failed save or read a lease that does not parse; the local command's last look at such a
lease."""
from __future__ import annotations

import contextlib
import errno
import pathlib
from pathlib import Path

import pytest

from hpcshard.errors import UserError
from hpcshard.rundir import lease
from hpcshard.runtime import main as rmain
from hpcshard.runtime.checkpoint import manager
from hpcshard.runtime.checkpoint.guard import Disowned
from tests.unit.test_runtime_checkpoint_recovery import checkpointer, saved

pytestmark = pytest.mark.unit


def test_a_transient_error_of_the_write_probe_is_not_a_user_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_writable runs in every cycle of every rank. An ESTALE/EIO there (the file
    server's failover that may have caused the fault being recovered) must be a rank
    failure the launchers restart, not a UserError (exit 2, never restarted, the run over)."""
    def stale(self: Path, *a: object, **k: object) -> None:
        raise OSError(errno.ESTALE, "Stale file handle")
    monkeypatch.setattr(pathlib.Path, "write_text", stale)
    with pytest.raises(OSError) as got:
        rmain.check_writable(tmp_path)
    assert not isinstance(got.value, UserError)


def test_two_ranks_with_one_pid_probe_the_run_directory_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of two nodes whose containers give them one pid (pid namespaces of their own,
    started alike) probe the shared run directory at one moment: each its own probe file
    (one named by the pid: the second's unlink found none, FileNotFoundError, and its rank
    failed at its start)."""
    real, other = pathlib.Path.unlink, [True]

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if other:
            other.pop()
            rmain.check_writable(tmp_path)  # the other node's rank, start to end
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    rmain.check_writable(tmp_path)
    assert not other and not list(tmp_path.iterdir())


def test_an_unreadable_lease_at_a_commit_is_agreed_not_raised_by_rank_0_alone(
        world_of_one: None, tmp_path: Path) -> None:
    """_settle 'must never raise on rank 0 alone' (the others wait in the broadcast). A
    lease that does not parse makes owns() False, then disowned() re-reads it and raises
    lease.Unreadable (a ValueError, not the OSError _settle catches)."""
    mine = lease.take(tmp_path, lease.Owner.of_job("100"), lambda j: False)
    ckpt = checkpointer(tmp_path, owner=mine.token)
    saved(ckpt, 2)
    lease.path(tmp_path).write_text('{"kind": "job", "job": "100", "epoch": 1, "new_field": 1}\n')
    with contextlib.suppress(Disowned):  # returned (FAILED) or every rank's Disowned: both agreed
        ckpt.save(4, "periodic")


def test_a_stale_handle_while_judging_a_failed_save_is_not_raised_by_rank_0_alone(
        world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save fails with ESTALE on NFS; rank 0's _classify -> storage_trouble stats the
    checkpoint directory (Path.exists raises ESTALE on Python 3.11) outside any try:
    rank 0 raises alone while the other ranks wait in _agree's broadcast."""
    ckpt = checkpointer(tmp_path)
    saved(ckpt, 2)
    real_exists = pathlib.Path.exists

    def exists(self: Path) -> bool:
        if self == ckpt.root:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_exists(self)

    def save(*a: object, **k: object) -> None:
        raise OSError(errno.ESTALE, "Stale file handle")
    monkeypatch.setattr(manager.dcp, "save", save)
    monkeypatch.setattr(pathlib.Path, "exists", exists)
    assert ckpt.save(4, "periodic") is False  # FAILED, told to every rank


def test_the_local_command_reads_an_unparsable_lease_without_a_traceback(tmp_path: Path) -> None:
    """cli.request._run_here calls _taken_from in a `finally:` before lease.release: its
    lease.read may raise Unreadable (a ValueError) that suppress(OSError) lets through:
    a traceback, and the command's own claim is never released."""
    from hpcshard.cli.request import _taken_from

    claim = lease.take(tmp_path, lease.Owner.of_process("hpcshard submit"), lambda j: None)
    lease.path(tmp_path).write_text("{not json\n")
    assert _taken_from(tmp_path, claim) != ""
