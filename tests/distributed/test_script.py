"""Bring your own script, end to end on the local backend: a plain script runs as it is
(argv byte for byte, its variables), a failing one is retried once and reported as a bug,
a killed or hung one (with `progress`) is restarted in place, one that
ignores the notice is stopped and resumed from its own last save, and
`hpcshard.preemption` turns the notice into a flag every rank agrees on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from hpcshard.rundir.rankenv import BUG_EXIT
from hpcshard.rundir.spec import RunSpec
from tests.conftest import ROOT, hpcshard, hpcshard_bg, quiet_env, wait_for
from tests.distributed.test_runtime_checkpoint import rank_pids

ECHO = str(ROOT / "tests" / "scripts" / "echo_env.py")
COUNTER = str(ROOT / "tests" / "scripts" / "counter.py")
NASTY = ["a b", '"double" \'single\'', "$(touch pwned)", "`touch pwned`", "it's", "*", ";|&><",
         "--lr=3e-4", "", "tab\there", "ünïcødé", "\\back\\slash"]


def test_a_script_gets_its_args_byte_for_byte_and_its_variables(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "1", ECHO,
                    "--run-dir", str(run), "--", *NASTY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "pwned").exists()
    seen = [json.loads((run / f"echo-{r}.json").read_text()) for r in (0, 1)]
    ran = RunSpec.read(run).job  # the copy of the script taken at submit (`cli.snapshot`)
    assert ran.startswith(str(run.resolve() / "code")) and ran.endswith("/tests/scripts/echo_env.py")
    for rank, s in enumerate(seen):
        assert s["argv"] == [ran, *NASTY]
        assert s["name"] == "__main__" and s["cwd"] == str(tmp_path)
        assert s["path0"] == str(Path(ran).parent)  # as `python echo_env.py` sets it
        env = s["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["HPCSHARD_RUN_DIR"] == str(run.resolve())
        assert env["HPCSHARD_CHECKPOINT_DIR"] == str(run.resolve() / "checkpoints")
        assert env["HPCSHARD_ATTEMPT"] == "0" and env["HPCSHARD_RESTART_COUNT"] == "0"
        assert env["HPCSHARD_NOTICE_SIGNAL"] == "SIGTERM"
        assert "HPCSHARD_DEADLINE" not in env  # the local backend has no time limit
    ends = [r for r in ledger.read(run) if r["event"] == "end"]
    assert [e["reason"] for e in ends] == ["done"]


def test_a_module_runs_as_python_m_would(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = hpcshard("submit", "--backend", "local", "--gpus", "1", "-m", "tests.scripts.echo_env",
                    "--run-dir", str(run), "--", "--flag", "x y")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((run / "echo-0.json").read_text())
    code = RunSpec.read(run).code
    assert code is not None and code.source == "tests.scripts.echo_env"  # imported from its copy:
    assert seen["argv"] == [str(Path(code.path[0], "tests", "scripts", "echo_env.py")), "--flag", "x y"]
    assert seen["name"] == "__main__"


def test_a_script_failing_on_every_rank_stops_after_one_retry_as_a_bug(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "1", ECHO,
                    "--run-dir", str(run), env={"ECHO_FAIL": "1"})
    assert proc.returncode == BUG_EXIT
    out = proc.stdout + proc.stderr
    assert "RuntimeError: broken on purpose again at the same step: a bug" not in out
    bug = [line for line in out.splitlines() if "a bug, not a fault" in line]
    assert len(bug) == 1 and "RuntimeError: broken on purpose (traceback in " in bug[0], out
    assert "hpcshard: rank " in out and "failed first (exit 1)" in out, out
    assert "about to fail" in out
    assert "runpy" not in (run / "logs" / "rank-0.log").read_text()  # the script's frames only
    records = ledger.read(run)
    # One retry, no more. (Each cycle's first failure stops the other rank; under load
    # that can come before the other rank got as far as raising.)
    failed = {r["cycle"] for r in records if r["event"] == "rank_failed" and r["error"] == "RuntimeError"}
    assert failed == {0, 1}
    # The launchers' decision closes the attempt as a bug (a guard job never takes it over).
    assert [r["reason"] for r in records if r["event"] == "end"] == ["bug"]
    assert {r["attempt"] for r in records} == {0}  # never requeued


def _script_fault(tmp_path: Path, sig: signal.Signals) -> tuple[Path, int, float, str]:
    """counter.py on 2 nodes x 1 rank, reporting progress; `sig` to rank 1 after step 4."""
    run = tmp_path / "run"
    bg = hpcshard_bg("submit", "--backend", "local", "--nodes", "2", "--gpus", "1", COUNTER,
                     "--run-dir", str(run), "--", "--steps", "24", "--save-every", "4",
                     "--step-seconds", "0.3", "--progress")
    wait_for(lambda: "rank 1 step 5" in _log(run, 1), 120, "rank 1 past step 4")
    (victim,) = [p for p in rank_pids(run) if f"{p}" in _pids_of_rank(run, 1)]
    os.kill(victim, sig)
    at = time.time()
    out, _ = bg.communicate(timeout=180)
    assert bg.returncode == 0, out[-3000:]
    return run, victim, at, out


def _log(run: Path, rank: int) -> str:
    path = run / "logs" / f"rank-{rank}.log"
    return path.read_text() if path.exists() else ""


def _pids_of_rank(run: Path, rank: int) -> str:
    """The pid each start of `rank` printed."""
    return " ".join(line.split()[-1] for line in _log(run, rank).splitlines() if line.startswith("pid "))


def test_a_killed_script_rank_is_restarted_and_resumes_from_its_own_save(tmp_path: Path) -> None:
    run, victim, killed_at, out = _script_fault(tmp_path, signal.SIGKILL)
    (fault,) = [r for r in ledger.read(run) if r["event"] == "fault"]
    assert fault["restart"] and "died" in fault["cause"] and fault["culprit"]["pid"] == victim
    assert fault["declared"] - killed_at < 5
    assert fault["committed"] >= 4  # the script's own checkpoint-N.json
    restarted = _log(run, 1).split("starts after step")[-1]
    assert restarted.split(";")[0].strip() == str(fault["committed"])
    assert "rank 1 step 24" in restarted


def test_a_hung_script_rank_that_reports_progress_is_found_and_restarted(tmp_path: Path) -> None:
    run, victim, stopped_at, out = _script_fault(tmp_path, signal.SIGSTOP)
    (fault,) = [r for r in ledger.read(run) if r["event"] == "fault"]
    assert fault["restart"] and "made no progress in phase step" in fault["cause"]
    assert fault["culprit"]["pid"] == victim and fault["culprit"]["state"] == "stopped"
    assert fault["declared"] - stopped_at < 15  # the 5 s floor, not forever
    assert "most recent call first" in _log(run, 1)  # its stacks, before it was killed
    assert f"rank 1 starts after step {fault['committed']};" in _log(run, 1)


def test_a_script_that_does_nothing_is_stopped_and_resumes_from_its_own_save(tmp_path: Path) -> None:
    """The default: SIGTERM, which kills a script without a handler; the launcher sees
    the notice and restarts it once; it resumes from its own checkpoint-N.json."""
    run = tmp_path / "run"
    bg = hpcshard_bg("submit", "--backend", "local", "--nodes", "2", "--gpus", "1", COUNTER,
                     "--run-dir", str(run), "--", "--steps", "16", "--save-every", "4",
                     "--step-seconds", "0.3")
    log = run / "logs" / "rank-0.log"
    wait_for(lambda: log.exists() and "step 6\n" in log.read_text(), 60, "step 6")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = bg.communicate(timeout=120)
    assert bg.returncode == 0, out
    records = ledger.read(run)
    stop, done = [r for r in records if r["event"] == "end"]
    assert stop["reason"] == "stop" and stop["how"].startswith("exited") and stop["saved_step"] >= 4
    assert stop["saved"] == f"checkpoint-{stop['saved_step']}.json"
    assert done["reason"] == "done" and done["saved_step"] == 16
    text = log.read_text()
    assert f"rank 0 starts after step {stop['saved_step']}" in text  # its own resume
    assert [r["attempt"] for r in records if r["event"] == "start"] == [0, 1]
    status = hpcshard("status", str(run)).stdout
    assert "stop" in status and "done" in status


def test_a_script_that_saves_and_exits_cleanly_on_the_notice_is_still_requeued(tmp_path: Path
                                                                              ) -> None:
    """Hugging Face's JIT checkpoint saves on SIGTERM and returns from train() as if done:
    a clean exit after a notice is a stop, not the end of the run."""
    run = tmp_path / "run"
    bg = hpcshard_bg("submit", "--backend", "local", "--gpus", "1", COUNTER, "--run-dir", str(run),
                     "--", "--steps", "12", "--save-every", "100", "--step-seconds", "0.3",
                     "--save-on-term")
    log = run / "logs" / "rank-0.log"
    wait_for(lambda: log.exists() and "step 3\n" in log.read_text(), 60, "step 3")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = bg.communicate(timeout=120)
    assert bg.returncode == 0, out
    stop, done = [r for r in ledger.read(run) if r["event"] == "end"]
    assert stop["how"] == "exited 0 after the notice" and stop["saved_step"] >= 3
    text = log.read_text()
    assert f"starts after step {stop['saved_step']}" in text
    assert done["reason"] == "done" and "rank 0 step 12\n" in text


@pytest.mark.xdist_group("hf-trainer")  # one after the other: each is 2 ranks of Trainer
def test_the_hugging_face_trainer_example_is_preempted_and_resumes(tmp_path: Path) -> None:
    """The README's Hugging Face Trainer example, preempted: every rank agrees on the notice
    at the same step and saves there (its callback), the run is requeued and Trainer resumes
    from that checkpoint to the end.
    DDP over gloo here (accelerate turns FSDP on only for GPUs; README says why)."""
    run = tmp_path / "hf"
    bg = hpcshard_bg("submit", "--backend", "local", "--gpus", "2",
                     str(ROOT / "examples" / "hf_trainer" / "train_hf.py"), "--run-dir", str(run),
                     "--", "--max-steps", "24", "--save-steps", "100", "--step-seconds", "0.5",
                     "--logging-steps", "1")
    checkpoints = run / "checkpoints"
    wait_for(lambda: (run / "logs" / "rank-0.log").exists()
             and "'epoch'" in (run / "logs" / "rank-0.log").read_text(), 240, "Trainer's first step")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = bg.communicate(timeout=300)
    assert bg.returncode == 0, out[-3000:]
    stop, done = [r for r in ledger.read(run) if r["event"] == "end"]
    assert stop["reason"] == "stop" and 1 <= stop["saved_step"] < 24  # the notice's own save
    assert stop["saved"] == f"checkpoint-{stop['saved_step']}"
    assert done["reason"] == "done" and done["saved_step"] == 24
    text = (run / "logs" / "rank-0.log").read_text()
    assert f"resumed from {checkpoints / stop['saved']}; stopped at step 24/24" in text
    assert (checkpoints / "checkpoint-24" / "trainer_state.json").exists()


def test_preemption_flag_and_requeue_code(tmp_path: Path) -> None:
    """Importing hpcshard.preemption takes the notice signal: the rank is not killed, the
    flag is set, and without a process group `requested()` is the local view."""
    code = ("import os, signal, sys\n"
            "from hpcshard import preemption\n"
            "assert not preemption.requested()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "assert preemption.requested() and preemption.requested(sync=False)\n"
            "print(round(preemption.deadline(), 3))\n"  # (counted on the boot clock: float noise)
            "preemption.exit_for_requeue()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=quiet_env(HPCSHARD_NOTICE_SIGNAL="SIGUSR1", HPCSHARD_DEADLINE="123.5"))
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout.strip() == "123.5"


@pytest.mark.xdist_group("hf-trainer")  # one after the other: each is 2 ranks of Trainer
def test_the_hugging_face_example_reports_progress_and_a_hung_rank_is_restarted(tmp_path: Path) -> None:
    """Its `Hpcshard` callback puts Trainer's steps on the board: a rank stopped by
    SIGSTOP (the other waits in DDP's all-reduce) is found, and both restart from the
    newest complete checkpoint-N."""
    run = tmp_path / "hf"
    bg = hpcshard_bg("submit", "--backend", "local", "--gpus", "2",
                     str(ROOT / "examples" / "hf_trainer" / "train_hf.py"), "--run-dir", str(run),
                     "--", "--max-steps", "20", "--save-steps", "4", "--step-seconds", "0.3",
                     "--logging-steps", "1")
    wait_for(lambda: (run / "checkpoints" / "checkpoint-8" / "trainer_state.json").exists(), 300,
             "checkpoint-8")
    victim = rank_pids(run)[1]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    out, _ = bg.communicate(timeout=300)
    assert bg.returncode == 0, out[-3000:]
    (fault,) = [r for r in ledger.read(run) if r["event"] == "fault"]
    assert "made no progress in phase step" in fault["cause"], fault
    assert fault["culprit"]["pid"] == victim and fault["culprit"]["state"] == "stopped"
    assert fault["declared"] - stopped_at < 15 and fault["committed"] >= 8
    assert [r["reason"] for r in ledger.read(run) if r["event"] == "end"] == ["done"]
    assert (run / "checkpoints" / "checkpoint-20").is_dir()
