"""A rank's log file on storage that refuses writes: one line on the console, no
"--- Logging error ---" traceback per record, and the file again once it takes writes.
/dev/full fails every write with ENOSPC, as a full disk does."""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcshard.runtime import logfile
from hpcshard.runtime.main import setup_logging

pytestmark = pytest.mark.unit


@pytest.fixture
def hpcshard_log() -> Iterator[logging.Logger]:
    log = logging.getLogger("hpcshard")
    handlers, level, propagate = log.handlers[:], log.level, log.propagate
    yield log
    for handler in log.handlers:
        handler.close()
    log.handlers[:], log.level, log.propagate = handlers, level, propagate


def full_log(run: Path) -> None:
    """RUN/logs/rank-0.log on a full disk."""
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank-0.log").symlink_to("/dev/full")


def test_a_full_disk_is_said_once_and_the_records_go_to_the_console(
        tmp_path: Path, hpcshard_log: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    full_log(tmp_path)
    setup_logging(tmp_path, 0)
    for step in range(5):
        hpcshard_log.warning("step %d", step)
    out, err = capsys.readouterr()
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("cannot be written") == 1, err
    path = tmp_path / "logs" / "rank-0.log"
    assert f"the log file {path} cannot be written (No space left on device)" in err
    assert all(f"step {n}" in out for n in range(5))  # rank 0's console has them all


def test_the_file_is_tried_again_and_gets_what_was_held(
        tmp_path: Path, hpcshard_log: logging.Logger, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    full_log(tmp_path)
    setup_logging(tmp_path, 0)
    hpcshard_log.handlers[0].held = collections.deque(maxlen=3)  # type: ignore[attr-defined]
    for n in range(5):
        hpcshard_log.info("held %d", n)  # (after the first, within RETRY_S: not even tried)
    (tmp_path / "logs" / "rank-0.log").unlink()  # room again
    clock = logfile.time.monotonic() + logfile.RETRY_S
    monkeypatch.setattr(logfile.time, "monotonic", lambda: clock)
    hpcshard_log.info("written")
    text = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "(3 log record(s) lost while the storage refused writes)" in text
    assert [line.split()[-1] for line in text.splitlines()[1:]] == ["3", "4", "written"]
    assert "takes writes again" in capsys.readouterr().err


def test_other_ranks_do_not_say_it(tmp_path: Path, hpcshard_log: logging.Logger,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.log").symlink_to("/dev/full")
    setup_logging(tmp_path, 1)
    hpcshard_log.warning("a warning")
    out, err = capsys.readouterr()
    assert "cannot be written" not in err and "Logging error" not in err and "a warning" in out
