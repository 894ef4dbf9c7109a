"""How launchers tell each other about a fault (one declaration per cycle, whoever is first),
and how the CLI finds them (a pid file names a process, not a pid)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.rundir import launchers, proc
from hpcshard.rundir.spec import RunSpec
from tests.conftest import pending


def test_the_first_declaration_wins_and_every_launcher_reads_it(tmp_path: Path) -> None:
    assert launchers.fault(tmp_path, 0, 0) is None
    assert launchers.declare_fault(tmp_path, 0, 0, {"cause": "rank 3 died", "node": 1})
    assert not launchers.declare_fault(tmp_path, 0, 0, {"cause": "exit 1", "node": 0})
    found = launchers.fault(tmp_path, 0, 0)
    assert found is not None and found["cause"] == "rank 3 died" and found["time"] > 0
    assert launchers.fault(tmp_path, 0, 1) is None and launchers.fault(tmp_path, 1, 0) is None


def test_nodes_report_down_and_node_0_decides(tmp_path: Path) -> None:
    launchers.mark_down(tmp_path, 2, 1, 1, {"dead": [{"rank": 3}], "reached": 7})
    assert launchers.nodes_down(tmp_path, 2, 1, 2) == [1]
    launchers.mark_down(tmp_path, 2, 1, 0, {"dead": [], "reached": 7})
    assert launchers.nodes_down(tmp_path, 2, 1, 2) == [0, 1]
    assert launchers.downs(tmp_path, 2, 1, 2)[1]["dead"] == [{"rank": 3}]
    assert launchers.decision(tmp_path, 2, 1) is None
    launchers.decide(tmp_path, 2, 1, {"restart": True, "port": 29500})
    assert launchers.decision(tmp_path, 2, 1) == {"restart": True, "port": 29500}


# -- pid files: a process, not a pid -------------------------------------------------------

@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this user that is no launcher of any run (what a reused pid names)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def local_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    RunSpec(job="x.py", sets={}, nodes=1, gpus=1, backend="local", name="x").write(run)
    (run / launchers.LAUNCH).mkdir()
    return run


@pytest.mark.parametrize("left", ["bare pid", "identity"])
def test_a_pid_file_whose_pid_now_names_another_process_is_no_launcher(
        tmp_path: Path, stranger: subprocess.Popen[bytes], left: str) -> None:
    """A launcher died (-9) and left its pid file; its pid now belongs to an unrelated
    process of the user (here: a `sleep`). Nothing signals it, and `resume` is not refused:
    neither a bare pid (what earlier versions wrote, which cannot be checked) nor an
    identity whose start time is not the process's own."""
    run = local_run(tmp_path)
    record = proc.identity(stranger.pid)
    assert record is not None
    text = (f"{stranger.pid}\n" if left == "bare pid" else
            json.dumps({**record, "start": record["start"] - 1}) + "\n")  # started before it
    launchers.pid_file(run, 0).write_text(text)
    assert launchers.launchers(run) == []
    for command in ("cancel", "preempt"):
        out = CliRunner().invoke(main, [command, str(run)])
        assert out.exit_code == 2 and "no running launcher" in out.output, out.output
    assert "still running" not in CliRunner().invoke(main, ["resume", str(run)]).output
    # never signalled: a signal sent is pending until the process takes it, then it is gone
    # (not looked at after a delay, by which a loaded machine may not have run it yet)
    assert pending(stranger.pid) == 0 and stranger.poll() is None


def test_a_live_launchers_pid_file_names_it_and_cancel_reaches_it(
        tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    run = local_run(tmp_path)
    launchers.pid_file(run, 0).write_text(json.dumps(proc.identity(stranger.pid)) + "\n")
    assert launchers.launchers(run) == [stranger.pid]
    out = CliRunner().invoke(main, ["cancel", str(run)])
    assert out.exit_code == 0 and "cancelled 1 node launcher" in out.output
    assert stranger.wait(30) == -signal.SIGTERM  # (its own end, at 60 s, would be 0)


def test_a_pid_file_of_another_host_boot_or_pid_namespace_is_not_checked_by_pid(
        tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    """Its pid means nothing here: launchers() leaves it out, and signals nobody."""
    run = local_run(tmp_path)
    record = proc.identity(stranger.pid)
    assert record is not None
    for other in ({"boot": "another-boot"}, {"pidns": "pid:[1]"}):
        launchers.pid_file(run, 0).write_text(json.dumps({**record, **other}) + "\n")
        assert launchers.launchers(run) == [] and launchers.signal_launchers(run, signal.SIGTERM) == 0
    assert stranger.poll() is None
    launchers.write_pid_file(run, 0)  # as a launcher writes it: this process
    assert launchers.launchers(run) == [os.getpid()]
    assert json.loads(launchers.pid_file(run, 0).read_text())["host"] == socket.gethostname()


# -- exclusive creation --------------------------------------------------------------------

def test_fifty_launchers_with_one_pid_declare_at_once_and_exactly_one_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers in containers of their own pid namespace share pids: their side files
    must not be one file (30 of 50 simultaneous declarations crashed)."""
    monkeypatch.setattr(os, "getpid", lambda: 7)
    start = threading.Barrier(50)
    results: list[bool] = []
    errors: list[BaseException] = []

    def declare(node: int) -> None:
        start.wait()
        try:
            results.append(launchers.declare_fault(tmp_path, 0, 0, {"node": node}))
        except BaseException as err:  # noqa: BLE001 - a crash is what this test looks for
            errors.append(err)

    threads = [threading.Thread(target=declare, args=(n,)) for n in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(results) == [False] * 49 + [True]
    assert os.listdir(tmp_path / launchers.LAUNCH) == ["fault-0-0.json"]  # no side file left


@pytest.mark.parametrize("error", [FileExistsError(errno.EEXIST, "File exists"),
                                   OSError(errno.EIO, "Input/output error")])
def test_a_link_reported_failed_after_it_was_made_is_won(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """NFS: a LINK whose reply was lost is sent again, and the retransmission fails
    although the first one linked: the side file's link count (2) says it was ours."""
    real = os.link

    def retransmitted(src: Any, dst: Any) -> None:
        real(src, dst)
        raise error

    monkeypatch.setattr(os, "link", retransmitted)
    assert launchers.claim(tmp_path, "continue-0")
    monkeypatch.setattr(os, "link", real)
    assert not launchers.claim(tmp_path, "continue-0")  # the one that exists: lost


def test_a_link_that_failed_is_an_error_not_a_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "link", broken)
    with pytest.raises(OSError, match="Input/output"):
        launchers.claim(tmp_path, "continue-0")
    assert os.listdir(tmp_path / launchers.LAUNCH) == []
