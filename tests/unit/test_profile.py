"""Profiles: the asks a command leaves, the windows every rank queues alike, a trace written
by a 1-rank trainer's profiler, and the command's refusals (the live run on 2x2:
tests/distributed/test_profile.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.config import profile_ranks
from hpcshard.errors import UserError
from hpcshard.rundir import profiles
from hpcshard.rundir.spec import Resolved, RunSpec, Script
from hpcshard.rundir.status import profile_lines
from hpcshard.runtime.device import DistEnv
from hpcshard.runtime.profile import NO_CUDA, Profiler, Window, scheduled
from hpcshard.sections import ProfileSection

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "ranks"), [
    ("0", (0,)), ("0,7", (0, 7)), (" 3 , 1,3", (1, 3)), ("all", None),
])
def test_profile_ranks_parse(text: str, ranks: tuple[int, ...] | None) -> None:
    assert profile_ranks(text) == ranks


@pytest.mark.parametrize("text", ["", "x", "0,,1", "-1", "0;1", "1.5"])
def test_bad_profile_ranks_are_one_line(text: str) -> None:
    with pytest.raises(UserError, match="comma"):
        profile_ranks(text)


@pytest.mark.parametrize(("every", "step", "first"), [
    (0, 10, None), (5, 0, None), (5, 4, None), (5, 5, 6), (5, 10, 11), (1, 3, 4),
])
def test_the_schedule_starts_a_window_after_every_nth_step(every: int, step: int, first: int | None) -> None:
    section = ProfileSection(profile_every=every, profile_steps=3, profile_ranks="0,2", profile_memory=True)
    window = scheduled(section, step)
    assert (window.first if window else None) == first
    if window:
        assert first is not None and (window.last, window.ranks, window.memory) == (first + 2, (0, 2), True)


def test_asks_are_numbered_exclusively_and_taken_once(tmp_path: Path) -> None:
    got: list[profiles.Ask] = []
    threads = [threading.Thread(target=lambda: got.append(profiles.put(tmp_path, 2, (0,), False)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.id for a in got) == list(range(1, 9))  # eight commands at once: eight numbers
    first = profiles.pending(tmp_path)
    assert first is not None and first.id == 1
    profiles.take(tmp_path, first.id, 5, [0], [], "0.0")
    assert profiles.taken(tmp_path, 1) == {"step": 5, "ranks": [0], "dropped": [], "start": "0.0", "tries": 1}
    nxt = profiles.pending(tmp_path, start="0.0")
    assert nxt is not None and nxt.id == 2  # the start that took ask 1 does not take it again
    assert profiles.pending(tmp_path, skip=set(range(2, 9)), start="0.0") is None
    profiles.ask_path(tmp_path, 9).write_text("{not json")  # a torn or foreign file: passed over
    profiles.ask_path(tmp_path, 10).write_text(profiles.Ask(10, 1, None, True).text())
    ask = profiles.pending(tmp_path, skip=set(range(2, 9)), start="0.0")
    assert ask == profiles.Ask(10, 1, None, True) and ask.records(123)


def test_an_ask_taken_by_a_start_that_ended_before_its_traces_is_taken_once_more(tmp_path: Path) -> None:
    ask = profiles.put(tmp_path, 2, (0,), False)
    profiles.take(tmp_path, ask.id, 7, [0], [], "0.0")  # attempt 0 took it, then was requeued
    assert profiles.pending(tmp_path, start="0.0") is None
    assert profiles.pending(tmp_path, start="1.0") == ask  # the next start records it
    profiles.take(tmp_path, ask.id, 3, [0], [], "1.0")
    assert profiles.taken(tmp_path, ask.id)["tries"] == 2  # type: ignore[index]
    assert profiles.pending(tmp_path, start="2.0") is None  # twice is enough
    other = profiles.put(tmp_path, 1, (0,), False)
    profiles.take(tmp_path, other.id, 9, [0], [], "0.0")
    window = profiles.window_dir(tmp_path, 9)
    window.mkdir(parents=True)
    profiles.done_path(window, 0).write_text("{}")
    assert profiles.pending(tmp_path, start="1.0") is None  # whole: never again


def test_an_older_ask_seen_after_a_newer_one_is_still_taken(tmp_path: Path) -> None:
    """NFS: rank 0's host may list ask 2 before ask 1 (or fail to read ask 1 once)."""
    one, two = profiles.put(tmp_path, 1, (0,), False), profiles.put(tmp_path, 1, (0,), False)
    assert profiles.pending(tmp_path, skip={two.id}) == one


def _env() -> DistEnv:
    return DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")


class _Events:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def event(self, name: str, **fields: Any) -> None:
        self.events.append({"event": name, **fields})


def _steps(prof: Profiler, events: _Events, first: int, last: int, asked: int = 0) -> None:
    """The trainer's calls around steps first..last (a small matmul each), then the boundary."""
    for step in range(first, last + 1):
        prof.before(step)
        torch.randn(32, 32) @ torch.randn(32, 32)
        prof.after(step, events)
        prof.agree(asked if step == first else 0, step, ending=False)


def test_an_ask_is_taken_at_a_boundary_and_recorded_from_the_next_step(tmp_path: Path,
                                                                       world_of_one: None) -> None:
    section = ProfileSection(profile_every=0, profile_steps=2, profile_ranks="0", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path), _Events()
    ask = profiles.put(tmp_path, 2, (0,), True)
    prof.looked = float("-inf")
    assert prof.asked() == ask.id
    _steps(prof, events, 1, 6, asked=ask.id)
    assert profiles.taken(tmp_path, ask.id) == {"step": 2, "ranks": [0], "dropped": [], "start": "",
                                                 "tries": 1}
    window = profiles.window_dir(tmp_path, 2)
    done = profiles.done(window, 0)
    assert done is not None and done["steps"] == 2 and done["memory"] == NO_CUDA and not done["partial"]
    trace = json.loads(Path(done["trace"]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names
    assert [e["event"] for e in events.events] == ["profile"]
    assert prof.asked() == 0  # taken: not asked again by this process...
    again = Profiler(section, _env(), tmp_path)
    assert again.asked() == 0  # ...nor by a later start: its traces are whole
    assert any("profiles (1)" in line for line in profile_lines(tmp_path))


def test_windows_queue_behind_each_other_and_one_cut_short_is_written(tmp_path: Path,
                                                                      world_of_one: None) -> None:
    section = ProfileSection(profile_every=2, profile_steps=3, profile_ranks="all", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path), _Events()
    _steps(prof, events, 1, 6)
    # windows after steps 2 (3-5) and 4 (queued: 6-8); the one after 6 waits behind it
    assert profiles.done(profiles.window_dir(tmp_path, 3), 0) is not None
    assert prof.active == Window(first=6, steps=3, ranks=None, memory=False)
    prof.close(events)
    cut = profiles.done(profiles.window_dir(tmp_path, 6), 0)
    assert cut is not None and cut["partial"]


def test_a_rank_a_window_does_not_name_records_nothing(tmp_path: Path, world_of_one: None) -> None:
    section = ProfileSection(profile_every=1, profile_steps=1, profile_ranks="3", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path), _Events()
    _steps(prof, events, 1, 4)
    assert profiles.windows(tmp_path) == [] and events.events == []


@pytest.fixture
def running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=2, backend="local", name="charlm",
            resolved=Resolved(config={"steps": 12})).write(run_dir)
    monkeypatch.setattr("hpcshard.launch.backends.Backend.over", lambda self, spec, run_dir: False)
    return run_dir


@pytest.mark.parametrize(("args", "message"), [
    (["--ranks", "4"], "rank 4 is not a rank of"),
    (["--ranks", "0,x"], "comma"),
    (["--steps", "0"], "--steps"),
])
def test_bad_asks_are_one_line_and_leave_nothing(running: Path, args: list[str], message: str) -> None:
    out = CliRunner().invoke(main, ["profile", str(running), *args])
    assert out.exit_code == 2 and message in out.output, out.output
    assert not (running / "profiles").exists()


def test_memory_on_a_cpu_run_is_refused(running: Path) -> None:
    (running / "metrics.jsonl").write_text(json.dumps({"event": "start", "device": "cpu"}) + "\n")
    out = CliRunner().invoke(main, ["profile", str(running), "--memory"])
    assert out.exit_code == 2 and "train on CPU" in out.output and len(out.output.splitlines()) == 1
    assert not (running / "profiles").exists()


def test_a_run_that_is_not_running_or_a_script_is_refused(tmp_path: Path) -> None:
    run_dir, script = tmp_path / "ended", tmp_path / "script"
    run_dir.mkdir()
    script.mkdir()
    RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=2, backend="local", name="charlm",
            resolved=Resolved(config={"steps": 12})).write(run_dir)
    out = CliRunner().invoke(main, ["profile", str(run_dir)])
    assert out.exit_code == 2 and "is not running" in out.output
    RunSpec(job="train.py", sets={}, nodes=1, gpus=2, backend="local", name="s",
            script=Script(kind="file", target="/tmp/train.py")).write(script)
    out = CliRunner().invoke(main, ["profile", str(script)])
    assert out.exit_code == 2 and "runs a script" in out.output
    assert not (run_dir / "profiles").exists() and not (script / "profiles").exists()


def test_no_wait_leaves_the_ask_and_says_where_to_look(running: Path) -> None:
    out = CliRunner().invoke(main, ["profile", str(running), "--ranks", "all", "--steps", "3", "--no-wait"])
    assert out.exit_code == 0, out.output
    assert "3 step(s) on every rank (ask 1)" in out.output
    assert profiles.pending(running) == profiles.Ask(1, 3, None, False)


def test_a_rollback_inside_a_window_ends_it_cut_short_and_drops_the_schedules_queue(
        tmp_path: Path, world_of_one: None) -> None:
    section = ProfileSection(profile_every=3, profile_steps=4, profile_ranks="0", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path), _Events()
    _steps(prof, events, 1, 6)  # a window from step 4, to 7; another queued after step 6
    assert prof.active is not None and prof.active.first == 4 and len(prof.queue) == 1
    prof.rewound(events)  # a non-finite step 6 went back to a checkpoint
    cut = profiles.done(profiles.window_dir(tmp_path, 4), 0)
    assert cut is not None and cut["partial"] and prof.active is None and not prof.queue
    assert prof.wrote


def test_a_queued_ask_the_run_never_reached_is_left_for_its_next_start(tmp_path: Path,
                                                                        world_of_one: None) -> None:
    section = ProfileSection(profile_every=0, profile_steps=2, profile_ranks="0", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path, start="0.0"), _Events()
    long, queued = profiles.put(tmp_path, 5, (0,), False), profiles.put(tmp_path, 2, (0,), False)
    prof.agree(long.id, 1, ending=False)
    prof.agree(queued.id, 2, ending=False)  # behind the first: steps 7-8
    _steps(prof, events, 2, 3)
    prof.close(events)  # the run stopped at step 3
    assert profiles.taken(tmp_path, queued.id) is None  # never marked: its window never began
    later = Profiler(section, _env(), tmp_path, start="1.0")
    later.looked = float("-inf")
    assert later.asked() == queued.id  # (the first was written, cut short: answered)


def test_ranks_the_run_no_longer_has_are_named_and_an_ask_of_none_of_them_fails(
        tmp_path: Path, world_of_one: None) -> None:
    section = ProfileSection(profile_every=0, profile_steps=1, profile_ranks="0", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path), _Events()
    some, none = profiles.put(tmp_path, 1, (0, 3), False), profiles.put(tmp_path, 1, (3,), False)
    prof.agree(some.id, 1, ending=False)
    _steps(prof, events, 2, 2)
    assert profiles.taken(tmp_path, some.id)["dropped"] == [3]  # type: ignore[index]
    prof.agree(none.id, 2, ending=False)
    _steps(prof, events, 3, 3)
    assert profiles.taken(tmp_path, none.id)["ranks"] == []  # type: ignore[index]


def test_a_trace_the_profiler_could_not_write_says_so(tmp_path: Path, world_of_one: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's export writes nothing and says nothing on a full disk."""
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)
    section = ProfileSection(profile_every=1, profile_steps=1, profile_ranks="0", profile_memory=False)
    prof, events = Profiler(section, _env(), tmp_path), _Events()
    _steps(prof, events, 1, 2)
    done = profiles.done(profiles.window_dir(tmp_path, 2), 0)
    assert done is not None and "disk full" in done["error"] and "trace" not in done
    assert not list(profiles.window_dir(tmp_path, 2).glob("*.tmp"))


def test_the_watchdog_judges_a_profile_phase_as_it_does_a_save() -> None:
    from hpcshard.rundir.progress import PHASES

    assert "profile" in PHASES and PHASES[:8] == ("idle", "setup", "load", "step", "eval", "save", "done",
                                                  "join")  # (appended: older boards still read)


def test_ranks_are_checked_against_the_newest_starts_world(running: Path) -> None:
    """A 2x2 run that lost a node trains on 2 ranks: rank 3 is not there now."""
    (running / "metrics.jsonl").write_text(json.dumps({"event": "start", "device": "cpu", "world": 2}) + "\n")
    out = CliRunner().invoke(main, ["profile", str(running), "--ranks", "3"])
    assert out.exit_code == 2 and "it has ranks 0-1 now" in out.output, out.output
    assert not (running / "profiles").exists()
