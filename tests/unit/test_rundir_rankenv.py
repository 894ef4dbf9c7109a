"""What a launcher tells its ranks: one object for every HPCSHARD_* variable a rank reads."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcshard.rundir import rankenv
from hpcshard.rundir.rankenv import ENV_DOC, RankEnv, script_environ, short_name, signal_name


def test_a_rank_reads_back_what_its_launcher_wrote() -> None:
    sent = RankEnv(attempt=3, resume="120", restart_count=2, notice="usr1", deadline=1.8e9)
    got = RankEnv.from_environ(sent.to_environ())
    assert got == sent and got.notice == "SIGUSR1" and got.notice_signal == signal.SIGUSR1
    assert RankEnv.from_environ({}) == RankEnv()  # plain torchrun: the defaults


@pytest.mark.parametrize("text", ["USR2", "usr2", "SIGUSR2", " sigusr2 "])
def test_every_spelling_of_a_signal_is_one_name(text: str) -> None:
    assert signal_name(text) == "SIGUSR2" and short_name(text) == "USR2"
    assert RankEnv(notice=text).notice_signal == signal.SIGUSR2


def test_a_signal_that_does_not_exist_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'USR9' is not a signal name"):
        RankEnv(notice="USR9")


def test_a_script_gets_the_variables_the_readme_documents(tmp_path: Path) -> None:
    env = {**RankEnv(restart_count=1, deadline=5).to_environ(), **script_environ(tmp_path, 4, "TERM")}
    assert set(ENV_DOC) <= set(env)
    assert env["HPCSHARD_NOTICE_SIGNAL"] == "SIGTERM" and env["HPCSHARD_ATTEMPT"] == "4"
    assert script_environ(tmp_path, 0, "none")["HPCSHARD_NOTICE_SIGNAL"] == ""


class Clocks:
    """A stand-in for a host's two clocks: its boot clock (`rundir.proc.clock`, what
    durations are counted on) and its wall clock (what scripts compare HPCSHARD_DEADLINE
    with), which may step."""

    def __init__(self, boot: float, wall: float) -> None:
        self.boot, self.wall = boot, wall

    def at(self, boot: float, wall: float) -> Clocks:
        self.boot, self.wall = boot, wall
        return self


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    c = Clocks(0.0, 0.0)
    monkeypatch.setattr(rankenv, "clock", lambda: c.boot)
    monkeypatch.setattr(rankenv, "time", SimpleNamespace(time=lambda: c.wall))
    return c


@pytest.mark.parametrize("start_boot, start_wall, wall_var, left", [
    (1000.0, 5000.0, "5600", 600.0),  # the launcher's own ranks, as it asked
    (1300.0, 5300.0, "5600", 300.0),  # a restart 300 s later in the same allocation
    (1300.0, 5260.0, "5560", 300.0),  # ...after the wall clock stepped back 40 s: left is the same
])
def test_ranks_started_later_get_what_is_left_from_the_launchers_one_answer(
        clocks: Clocks, start_boot: float, start_wall: float, wall_var: str, left: float) -> None:
    """The launcher asked Slurm at boot-clock 1000 (wall 5000) and heard 600 s left: the
    deadline is boot-clock 1600 on this host. Ranks started at any time later, in any
    restart, are processes of the same host and boot: they count what is left from that
    answer on the same clock. The wall-clock deadline scripts read is made as each start's
    variables are, from this host's wall clock then."""
    launcher = RankEnv(deadline=clocks.at(1000.0, 5000.0).boot + 600)
    own = RankEnv.from_environ(launcher.to_environ())  # (run_node reads its environment back)
    clocks.at(start_boot, start_wall)
    sent = replace(own, cycle=1).to_environ()  # (each start's variables: `Supervisor.cycle`)
    assert sent["HPCSHARD_DEADLINE"] == wall_var
    rank = RankEnv.from_environ(sent)
    assert rank.deadline == 1600.0 and rank.time_left() == left
    clocks.at(start_boot + 10, start_wall + 10)
    assert RankEnv.from_environ(sent).time_left() == left - 10


def test_a_deadline_made_on_another_host_or_boot_means_nothing_here(clocks: Clocks) -> None:
    """A moment on one host's boot clock is no moment on another's: a variable that crossed
    hosts (srun's environment, from the command's host) or a reboot is not believed, and its
    wall-clock twin (that host's wall clock) neither."""
    env = {"HPCSHARD_DEADLINE_BOOT": "1600.000 another-boot", "HPCSHARD_DEADLINE": "5600"}
    assert RankEnv.from_environ(env).deadline is None


def test_a_unix_deadline_alone_is_read_on_this_hosts_wall_clock(clocks: Clocks) -> None:
    """HPCSHARD_DEADLINE alone (a launcher of the user's own, a test): a Unix time, taken as
    this host's wall clock says it now, and counted on the boot clock from then on."""
    clocks.at(1000.0, 5000.0)
    assert RankEnv.from_environ({"HPCSHARD_DEADLINE": "5600"}).deadline == 1600.0
