"""What a launcher tells its ranks: one object for every HPCSHARD_* variable a rank reads."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

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
