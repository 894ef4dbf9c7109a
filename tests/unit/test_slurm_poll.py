"""Light on the controller: a command that follows jobs asks Slurm once per poll for all
of them (a job array's tasks included), and less often while nothing changes. Slurm is a
fake in this process (`client.subprocess.run` answers as squeue/sacct would; nothing is
started), and `client.calls` counts what a command would have run."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.slurm import client, cluster, poll


class FakeSlurm:
    """Answers Slurm's commands from `states` (job -> squeue's %T; missing: forgotten),
    records each call, and lets a test move the jobs on between polls (`then`)."""

    def __init__(self, states: dict[str, str], accounting: bool = False) -> None:
        self.states = states
        self.accounting = accounting
        self.asked: list[list[str]] = []
        self.then: Callable[[FakeSlurm], None] = lambda fake: None
        self.hang = False

    def __call__(self, args: list[str], **_: Any) -> Any:
        self.asked.append(list(args))
        if self.hang:
            raise subprocess.TimeoutExpired(args, 0.1)
        out, err, code = self.answer(args)
        self.then(self)
        return type("P", (), {"returncode": code, "stdout": out, "stderr": err})()

    def answer(self, args: list[str]) -> tuple[str, str, int]:
        if args[0] == "sacct" and not self.accounting:
            return "", "sacct: error: Slurm accounting storage is disabled", 1
        if args[0] == "sacct":
            asked = args[args.index("-j") + 1].split(",")
            return "".join(f"{j}|{self.states[j]}|0:0|00:00:01|n1|Unknown|Unknown\n"
                           for j in asked if j in self.states), "", 0
        assert args[0] == "squeue", f"{args[0]} asked: only squeue (or sacct) may be"
        names = next(a for a in args if a.startswith("--jobs=")).removeprefix("--jobs=").split(",")
        listed = [j for j in self.states if j in names or j.partition("_")[0] in names]
        if not listed:
            return "", "slurm_load_jobs error: Invalid job id specified", 1
        return "".join(f"{j}|{self.states[j]}|None|n1|0:01\n" for j in listed), "", 0


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeSlurm]]:
    def make(states: dict[str, str], accounting: bool = False) -> FakeSlurm:
        slurm = FakeSlurm(states, accounting)
        monkeypatch.setattr(client.subprocess, "run", slurm)
        monkeypatch.setattr(cluster.shutil, "which", lambda name: f"/usr/bin/{name}")
        return slurm

    yield make


ARRAY = [f"900_{i}" for i in range(100)]


def test_a_hundred_array_tasks_and_two_jobs_are_one_squeue(fake: Callable[..., FakeSlurm]) -> None:
    slurm = fake({**{job: "RUNNING" for job in ARRAY}, "77": "PENDING", "78": "COMPLETED"})
    before = client.calls
    found = poll.queue_states([*ARRAY, "77", "78"])
    assert client.calls - before == 1 and len(slurm.asked) == 1
    assert "--jobs=900,77,78" in slurm.asked[0]  # the array by its own id: a short line
    assert found is not None and len(found) == 102 and found["78"].state.over


def test_a_collapsed_row_of_pending_tasks_is_each_task() -> None:
    assert cluster.expand_array("12_[3-5,9%4]") == ["12_3", "12_4", "12_5", "12_9"]
    assert cluster.expand_array("12_7") == ["12_7"] and cluster.expand_array("12") == ["12"]
    found = poll.parse_queue("12_[1-3]|PENDING|Priority|(null)|0:00\n12_0|RUNNING|None|n1|0:05\n")
    assert sorted(found) == ["12_0", "12_1", "12_2", "12_3"] and found["12_2"].reason == "Priority"
    runs = cluster.parse_history("12_[1-2%1]|PENDING|0:0|00:00:00|None|Unknown|Unknown\n", ["12_1", "12_2"])
    assert [(r.job, r.state) for r in runs] == [("12_1", "PENDING"), ("12_2", "PENDING")]


def test_a_watch_asks_once_a_poll_and_never_again_for_a_job_that_is_over(
        fake: Callable[..., FakeSlurm]) -> None:
    slurm = fake({job: "PENDING" for job in ARRAY})
    watch = poll.Watch(list(ARRAY))

    def finish_ten(fake: FakeSlurm) -> None:  # after each answer, ten more tasks end
        done = sum(1 for s in fake.states.values() if s == "COMPLETED")
        for job in ARRAY[done:done + 10]:
            fake.states[job] = "COMPLETED"

    slurm.then = finish_ten
    polls = 0
    while not watch.done:
        before = client.calls
        watch.poll()
        polls += 1
        assert client.calls - before == 1
    assert polls == 11 and len(slurm.asked) == 11
    # each poll named only the tasks still going (the array by its id while two or more are)
    assert all(watch.seen[job].state_text == "COMPLETED" for job in ARRAY)
    assert watch.poll() == [] and len(slurm.asked) == 11  # nothing left to ask


def test_a_job_the_controller_forgot_is_over_and_no_answer_is_not(fake: Callable[..., FakeSlurm]) -> None:
    slurm = fake({"77": "RUNNING"})
    watch = poll.Watch(["77", "78"])
    assert watch.poll() == ["77", "78"] and watch.over == {"78"} and watch.seen["78"].state_text == "ended"
    slurm.hang = True
    assert watch.poll() == [] and not watch.answered and watch.over == {"78"}
    slurm.hang = False
    slurm.states.clear()  # 77 forgotten too (MinJobAge): "Invalid job id specified"
    assert watch.poll() == ["77"] and watch.done and watch.seen["77"].state_text == "ended"


def test_backoff_doubles_while_nothing_changes_up_to_its_cap() -> None:
    backoff = poll.Backoff(5, 60)
    assert [backoff.next(False) for _ in range(6)] == [10, 20, 40, 60, 60, 60]
    assert backoff.next(True) == 5 and backoff.next(False) == 10
    assert poll.Backoff(90, 60).next(True) == 60  # a first interval above the cap is the cap


def test_states_for_ls_are_one_sacct_or_one_sacct_and_one_squeue(fake: Callable[..., FakeSlurm]) -> None:
    from hpcshard.cli.common import job_states

    jobs = {f"{n}": "RUNNING" for n in range(50)}
    slurm = fake(jobs, accounting=True)
    assert set(job_states(list(jobs)).values()) == {"RUNNING"} and [a[0] for a in slurm.asked] == ["sacct"]
    slurm = fake(jobs, accounting=False)  # no accounting: one squeue for all fifty, no scontrol
    assert set(job_states(list(jobs)).values()) == {"RUNNING"}
    assert [a[0] for a in slurm.asked] == ["sacct", "squeue"]


def made_sweep(root: Path, tasks: int, array: str = "900") -> None:
    from hpcshard.rundir.spec import Resolved, RunSpec
    from hpcshard.rundir.sweep import Sweep

    configs = [{"lr": str(i)} for i in range(tasks)]
    root.mkdir()
    Sweep(job="jobs/charlm.py", name="s", backend="slurm", configs=configs, array=array).write(root)
    for i, config in enumerate(configs):
        (root / f"task-{i}").mkdir()
        RunSpec(job="jobs/charlm.py", sets=config, nodes=1, gpus=1, backend="slurm", name=f"s-{i}",
                jobs=[f"{array}_{i}"], resolved=Resolved(config={"steps": 8})).write(root / f"task-{i}")


def test_a_followed_sweep_asks_once_a_poll_and_backs_off(tmp_path: Path, fake: Callable[..., FakeSlurm],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """20 tasks pending for 4 polls, then running for 3, then done: one squeue a poll, the
    waits doubling from poll_s while nothing changes and back at a change."""
    site = tmp_path / "site.toml"
    site.write_text("[defaults]\npoll_s = 2\npoll_max_s = 8\n")
    monkeypatch.setenv("HPCSHARD_SITE", str(site))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    made_sweep(tmp_path / "s", 20)
    slurm = fake({f"900_{i}": "PENDING" for i in range(20)})
    script = iter(["PENDING"] * 3 + ["RUNNING"] * 3 + ["COMPLETED"])

    def move_on(fake: FakeSlurm) -> None:
        if fake.asked[-1][0] == "squeue":
            state = next(script, "COMPLETED")
            fake.states.update({job: state for job in fake.states})

    slurm.then = move_on
    waits: list[float] = []
    monkeypatch.setattr("hpcshard.cli.sweep.time.sleep", waits.append)
    out = CliRunner().invoke(main, ["status", str(tmp_path / "s"), "--follow"])
    assert out.exit_code == 0, out.output
    squeues = [a for a in slurm.asked if a[0] == "squeue"]
    followed = len(waits) + 1  # (the last poll saw every task over: no wait after it)
    assert followed == 8 and len(squeues) >= followed  # (+ the final table's: sacct, then squeue)
    assert len(slurm.asked) <= followed + 2
    assert waits == [2, 4, 8, 8, 2, 4, 8]
    assert out.output.count(": PENDING") == 20 and out.output.count(": RUNNING") == 20
    assert "task-19  lr=19" in out.output  # the table at the end


def follow_log_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    says: Callable[[float], tuple[bool, str]], ended_at: float | None = None,
                    **kw: Any) -> list[float]:
    """When `common.follow_log` asked Slurm, on a stand-in clock (its sleeps advance it); `says`:
    Slurm's answer at a time; `ended_at`: when the run ended (never: None)."""
    from hpcshard.cli import common

    clock = [0.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(common.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    asked: list[float] = []

    def ask() -> tuple[bool, str]:
        asked.append(clock[0])
        return says(clock[0])

    log = tmp_path / "rank-0.log"
    log.write_text("step 1\n")
    if ended_at is not None:
        kw["ended"] = lambda: clock[0] >= ended_at
    common.follow_log(log, ask, poll.Backoff(5, 40), **kw)
    return asked


def test_follow_log_asks_slurm_once_a_backoff_and_reads_the_log_every_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = follow_log_asks(tmp_path, monkeypatch, lambda now: (now >= 100, "RUNNING"))
    assert asked == [0, 5, 15, 35, 75, 115]  # 60 s: 5 calls, where every second was 60


def test_follow_asks_slurm_every_second_once_the_run_ended_then_stops_after_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (held by a lost node: the job never says over; the run ended at 20 s)
    asked = follow_log_asks(tmp_path, monkeypatch, lambda now: (False, "RUNNING"), ended_at=20, grace=3)
    assert asked == [0, 5, 15, 20, 21, 22, 23]  # backed off, then at once and every second


def test_poll_settings_are_site_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.cli.common import poll_backoff
    from hpcshard.site import SETTINGS

    assert SETTINGS["poll_s"].default == poll.POLL_S and SETTINGS["poll_max_s"].default == poll.POLL_MAX_S
    site = tmp_path / "site.toml"
    site.write_text("[defaults]\npoll_s = 10\n[profiles.busy]\npoll_s = 30\npoll_max_s = 300\n")
    monkeypatch.setenv("HPCSHARD_SITE", str(site))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert (poll_backoff().first, poll_backoff().cap) == (10, 60)
    assert (poll_backoff("busy").first, poll_backoff("busy").cap) == (30, 300)
    assert poll_backoff("gone").first == 10  # a run's profile removed since: the defaults
    site.write_text("[defaults]\npoll_s = 0\n")
    with pytest.raises(ValueError, match="poll_s"):
        poll_backoff()


def test_the_calls_log_gets_a_line_per_slurm_command(tmp_path: Path, fake: Callable[..., FakeSlurm],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake({"77": "RUNNING"})
    log = tmp_path / "calls.log"
    monkeypatch.setenv(client.CALLS_LOG, str(log))
    poll.queue_states(["77"])
    poll.queue_states(["77", "78"])
    assert [line.split(" ", 1)[1] for line in log.read_text().splitlines()] == ["squeue", "squeue"]


@pytest.mark.parametrize("accounting", [True, False])
def test_ls_of_sweeps_and_runs_asks_once_for_all_their_jobs(tmp_path: Path, fake: Callable[..., FakeSlurm],
                                                            accounting: bool) -> None:
    from hpcshard.rundir.spec import RunSpec

    made_sweep(tmp_path / "a", 30, "900")
    made_sweep(tmp_path / "b", 30, "901")
    (tmp_path / "run").mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, backend="slurm", name="r",
            jobs=["77"]).write(tmp_path / "run")
    slurm = fake({**{f"{a}_{i}": "RUNNING" for a in (900, 901) for i in range(30)}, "77": "PENDING"},
                 accounting=accounting)
    out = CliRunner().invoke(main, ["ls", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert out.output.count("30 run(s): 30 RUNNING") == 2 and "PENDING" in out.output
    assert [a[0] for a in slurm.asked] == (["sacct"] if accounting else ["sacct", "squeue"])


def test_a_followed_job_forgotten_between_backed_off_polls_ends_as_accounting_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A poll backed off past the controller's MinJobAge finds the job forgotten: how it
    ended is asked of accounting once, at the end (it said "no longer known", exit 1)."""
    from hpcshard.cli import request
    from hpcshard.slurm.states import JobState

    monkeypatch.setattr(cluster, "query_job",
                        lambda job, timeout=None: cluster.JobQuery(job, cluster.Said.NO_SUCH_JOB))
    monkeypatch.setattr(cluster, "job_state",
                        lambda job, since=None: cluster.JobInfo(job, JobState.COMPLETED, "COMPLETED"))
    monkeypatch.setattr("hpcshard.cli.common.follow_log", lambda log, ask, backoff=None, **_: ask())
    assert request._follow(tmp_path, "77") == 0
    assert "job 77: COMPLETED" in capsys.readouterr().out
