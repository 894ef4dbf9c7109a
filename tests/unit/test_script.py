"""Bring your own script, without processes: what is a script, what may run, what the
ledger learns from a script's files, and the README's diff of the own-loop example."""

from __future__ import annotations

import difflib
import os
import re
import time
from pathlib import Path

import pytest

from hpcshard import script
from hpcshard.rundir import events, ledger
from tests.conftest import ROOT
from tests.unit.test_cli_submit import assert_one_line_error, invoke

COUNTER = str(ROOT / "tests" / "scripts" / "counter.py")


def test_a_file_is_a_job_only_if_it_defines_job(tmp_path: Path) -> None:
    assert script.defines_job(ROOT / "jobs" / "charlm.py")
    assert not script.defines_job(ROOT / "examples" / "own_loop" / "train.py")
    annotated = tmp_path / "annotated.py"
    annotated.write_text("from x import Job\njob: Job = Job()\n")
    assert script.defines_job(annotated)
    nested = tmp_path / "nested.py"
    nested.write_text("def f():\n    job = 1\n")  # not at the top level
    assert not script.defines_job(nested)


def test_a_script_with_a_syntax_error_is_refused_before_anything_runs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\ndef broken(:\n")
    code, out = invoke("submit", str(bad), "--backend", "local", "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(code, out, "bad.py:2", "syntax error")
    assert not (tmp_path / "r").exists()


def test_modules_are_checked_without_running_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("raise SystemExit('imported!')\n")  # never executed
    (pkg / "broken.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert script.check_module("mypkg.train").endswith("train.py")
    with pytest.raises(ValueError, match="no module named 'mypkg.nope'"):
        script.check_module("mypkg.nope")
    with pytest.raises(ValueError, match="broken.py:1: syntax error"):
        script.check_module("mypkg.broken")
    with pytest.raises(ValueError, match="package without __main__"):
        script.check_module("mypkg")
    with pytest.raises(ValueError, match="ModuleNotFoundError"):
        script.check_module("nopkg_anywhere.train")


@pytest.mark.parametrize("args,needles", [
    (["-m", "no_such_module_here", "--", "--lr", "3"], ["no_such_module_here", "PYTHONPATH"]),
    ([COUNTER, "--set", "steps=3"], ["--set is for hpcshard jobs", "after --"]),
    ([str(ROOT / "jobs" / "charlm.py"), "--", "--lr", "3"], ["hpcshard job", "--set KEY=VALUE"]),
    ([COUNTER, "--resume", "7"], ["--resume 7", "HPCSHARD_CHECKPOINT_DIR"]),
    ([], ["nothing to run", "-m package.module"]),
])
def test_bad_script_input_is_one_line_and_creates_nothing(args: list[str], needles: list[str],
                                                          tmp_path: Path) -> None:
    code, out = invoke("submit", "--backend", "local", "--run-dir", str(tmp_path / "r"), *args)
    assert_one_line_error(code, out, *needles)
    assert not (tmp_path / "r").exists()


def test_grace_must_end_before_the_time_limit_does(tmp_path: Path) -> None:
    code, out = invoke("render", COUNTER, "--signal-lead", "30", "--grace", "30",
                       "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(code, out, "--grace 30", "30s", "--signal-lead")


def test_render_takes_a_script_and_creates_nothing(tmp_path: Path) -> None:
    code, out = invoke("render", COUNTER, "--nodes", "2", "--run-dir", str(tmp_path / "r"),
                       "--", "--steps", "3")
    assert code == 0, out
    assert "#SBATCH --nodes=2" in out
    assert not (tmp_path / "r").exists()


def test_last_save_reads_the_step_from_common_checkpoint_names(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    assert script.last_save(tmp_path) == {"saved_step": None, "saved": None}
    ckpts.mkdir()
    for name in ("checkpoint-500", "epoch=0-step=120.ckpt", "step-00000040", "step-00000900.tmp",
                 "latest", "superseded-20260101-000000"):
        (ckpts / name).mkdir()
    old = time.time() - 30
    os.utime(ckpts / "checkpoint-500", (old, old))
    found = script.last_save(tmp_path)
    assert found["saved_step"] == 500 and found["saved"] == "checkpoint-500"  # not the .tmp
    assert found["lost_seconds"] >= 29


def test_failures_name_the_first_failing_rank_and_its_last_lines(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-3.log").write_text("".join(f"line {i}\n" for i in range(30)))
    def failed(attempt: int, rank: int) -> events.RankFailed:
        return events.RankFailed(attempt=attempt, cycle=0, rank=rank, host="n1", code=1, step=None,
                                 error="exit 1", message="", log=f"logs/rank-{rank}.log")
    for rank in (3, 0, 1):
        ledger.append(tmp_path, failed(0, rank))
    ledger.append(tmp_path, failed(1, 2))
    out = script.failures(tmp_path, 0, lines=3)
    assert out[0].startswith("rank 3 failed first (exit 1)")
    assert out[1:4] == ["  line 27", "  line 28", "  line 29"]
    assert out[-1] == "also failed: rank 0, 1"
    assert script.failures(tmp_path, 5) == []


def _diff() -> list[str]:
    """The own-loop example's diff, code only (the module docstrings differ on purpose)."""
    def code(name: str) -> list[str]:
        text = (ROOT / "examples" / "own_loop" / name).read_text()
        return text[text.index('"""', 3) + 3:].lstrip("\n").splitlines()
    return list(difflib.unified_diff(code("plain.py"), code("train.py"), "plain.py", "train.py",
                                     lineterm="", n=1))


def test_the_docs_show_the_own_loop_diff_as_it_is() -> None:
    readme = (ROOT / "docs" / "user" / "scripts.md").read_text()
    block = re.search(r"```diff\n(.+?)\n```", readme, re.S)
    assert block, "docs/user/scripts.md has no diff block"
    assert block.group(1).splitlines() == _diff()
    added = [line for line in _diff() if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 12  # "a handful of lines"


def test_the_docs_document_every_variable_a_script_gets() -> None:
    readme = (ROOT / "docs" / "user" / "scripts.md").read_text()
    for name in script.ENV_DOC:
        assert f"`{name}`" in readme, name


def test_a_script_whose_copy_of_the_code_is_lost_stops_as_a_user_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Its copy not found (`RunSpec.code_lost`): one line and exit 2, and rank 0's end record
    tells the launchers it is the user's to fix (a restart would meet it again), as a job's
    rank does; not a FileNotFoundError on the copy's old path, restarted until it is a bug."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("HPCSHARD_ATTEMPT", "1")
    monkeypatch.setenv("HPCSHARD_CYCLE", "0")
    why = "the run's copy of its code is no longer at /old/code/x (its run directory moved?), and ..."
    assert script.refuse(tmp_path, why) == 2
    assert capsys.readouterr().err == f"error: {why}\n"
    assert events.parse(ledger.read(tmp_path)[-1]) == events.End(
        attempt=1, reason=events.EndReason.ERROR, cycle=0, user_error=True, error=why)
