"""status, ls, logs, plot, cancel on a run directory laid out as a preempted run leaves it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.rundir.spec import Resolved, RunSpec
from hpcshard.rundir.status import attempts


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Two attempts: stopped cleanly at step 6, then killed at step 9 after a save at 8,
    then a third that resumed from 8 and finished at 12."""
    run_dir = tmp_path / "runs" / "charlm-1"
    (run_dir / "logs").mkdir(parents=True)
    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=2, backend="local", name="charlm",
            resolved=Resolved(config={"steps": 12})).write(run_dir)
    t = 1000.0
    metrics = [{"step": s, "time": t + s, "loss": 5.0 - s * 0.2, "tokens_per_s": 1e4} for s in range(1, 13)]
    metrics.append({"step": 12, "time": t + 12.5, "eval_loss": 2.9})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    ledger = [
        {"event": "start", "attempt": 0, "time": t, "resumed_step": None},
        {"event": "end", "attempt": 0, "time": t + 6.5, "reason": "stop", "step": 6, "saved_step": 6},
        {"event": "start", "attempt": 1, "time": t + 6.6, "resumed_step": 6},
        {"event": "start", "attempt": 2, "time": t + 9.5, "resumed_step": 8},
        {"event": "end", "attempt": 2, "time": t + 13, "reason": "done", "step": 12, "saved_step": 12},
    ]
    (run_dir / "attempts.jsonl").write_text("\n".join(json.dumps(r) for r in ledger) + "\n")
    (run_dir / "logs" / "rank-0.log").write_text("hello from rank 0\n")
    return run_dir


def test_attempts_count_the_steps_each_lost(run: Path) -> None:
    rows = attempts(run)
    assert [(a.number, a.reason, a.loaded, a.reached, a.lost) for a in rows] == [
        (0, "stop", None, 6, 0), (1, "killed", 6, 9, 1), (2, "done", 8, 12, 0)]


def test_an_attempt_stopped_before_rank_0_was_up_is_a_row_too(run: Path) -> None:
    """A notice (or a kill) that came while the interpreter started: the launcher records the
    attempt's end, rank 0 never its start. Status shows it, with no start, and the attempt
    before it is bounded by its end."""
    path = run / "attempts.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(3, json.dumps({"event": "end", "attempt": 1, "time": 1009.2, "reason": "stop",
                                "how": "killed 5s after the notice (the grace period)", "saved_step": 8}))
    lines[2] = lines[2].replace('"attempt": 1', '"attempt": 3').replace("1006.6", "1006.6")
    path.write_text("\n".join(lines) + "\n")  # attempt 1 has an end only; 3 a start only
    rows = attempts(run)
    assert [(a.number, a.reason, a.start is None) for a in rows] == [
        (0, "stop", False), (1, "stop", True), (2, "done", False), (3, "running?", False)]
    out = CliRunner().invoke(main, ["status", str(run)])
    assert out.exit_code == 0 and out.output.count("stop ") == 2, out.output


def test_status_shows_progress_and_the_ledger(run: Path) -> None:
    out = CliRunner().invoke(main, ["status", str(run)])
    assert out.exit_code == 0, out.output
    assert "step 12/12" in out.output and "eval: loss 2.9000" in out.output
    assert "killed" in out.output and "checkpoint: none committed yet" in out.output


def test_ls_lists_runs(run: Path) -> None:
    out = CliRunner().invoke(main, ["ls", str(run.parent)])
    assert out.exit_code == 0 and "charlm-1" in out.output and "12/12" in out.output
    assert "done" in out.output


def test_logs_prints_a_rank_and_names_the_ones_there(run: Path) -> None:
    assert CliRunner().invoke(main, ["logs", str(run)]).output == "hello from rank 0\n"
    bad = CliRunner().invoke(main, ["logs", str(run), "--rank", "3"])
    assert bad.exit_code == 2 and "rank-0" in bad.output


def test_plot_writes_a_png(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = CliRunner().invoke(main, ["plot", str(run), "--out", str(tmp_path / "p.png")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_marks_faults_and_rollbacks_and_draws_replayed_steps_apart(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    with (run / "metrics.jsonl").open("a") as f:  # a restart that trains 9..12 again
        f.write(json.dumps({"event": "start", "time": 1020.0, "first_step": 9}) + "\n")
        for s in range(9, 13):
            f.write(json.dumps({"step": s, "time": 1020.0 + s, "loss": 3.0, "tokens_per_s": 1e4}) + "\n")
    with (run / "attempts.jsonl").open("a") as f:
        f.write(json.dumps({"event": "fault", "attempt": 2, "cycle": 0, "time": 1019.0, "reached": 12,
                            "culprit": {"rank": 3}}) + "\n")
        f.write(json.dumps({"event": "rollback", "attempt": 2, "cycle": 1, "time": 1030.0, "step": 11,
                            "to": 8, "skipped": [[0, 240]], "rollback": 1, "of": 3}) + "\n")
    marks: list[str] = []
    real = matplotlib.axes.Axes.annotate

    def annotate(self: matplotlib.axes.Axes, text: str, *args: Any, **kwargs: Any) -> Any:
        marks.append(text)
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", annotate)
    out = CliRunner().invoke(main, ["plot", str(run), "--out", str(tmp_path / "p.png")])
    assert out.exit_code == 0, out.output
    assert "fault (rank 3)" in marks and "nan: rolled back" in marks
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def timed_records(run: Path) -> None:
    """Records as the loop writes them since the step split: step_s, split_s, mfu."""
    with (run / "metrics.jsonl").open("a") as f:
        for s in (13, 14):
            split = {"data": 0.0004, "forward": 0.12, "backward": 0.22, "optimizer": 0.04, "checkpoint": 0.0,
                     "comm": 0.008, "other": 0.0116}
            f.write(json.dumps({"step": s, "time": 1030.0 + s, "loss": 2.0, "tokens_per_s": 1e4, "mfu": 0.412,
                                "step_s": 0.4, "split_s": split}) + "\n")


def test_status_shows_where_the_step_time_went_and_the_mfu(run: Path) -> None:
    before = CliRunner().invoke(main, ["status", str(run)]).output  # records without a split
    assert "step time" not in before and "MFU" not in before
    timed_records(run)
    out = CliRunner().invoke(main, ["status", str(run)])
    assert out.exit_code == 0, out.output
    assert "step 14/12, loss 2.0000, 10,000 tokens/s, MFU 41.2%" in out.output
    assert ("step time 0.4 s: data 0.1%, forward 30%, backward 55%, optimizer 10%, checkpoint 0%, "
            "comm 2%, other 2.9%") in out.output.splitlines()


def test_plot_draws_the_split_below_where_records_have_one(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    for timed in (False, True):
        if timed:
            timed_records(run)
        plt.close("all")
        out = CliRunner().invoke(main, ["plot", str(run), "--out", str(tmp_path / "p.png")])
        assert out.exit_code == 0, out.output
        axes = plt.gcf().axes
        assert len(axes) == (3 if timed else 2)
    assert axes[2].get_ylabel() == "seconds per step"
    legend = axes[2].get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == [
        "data", "forward", "backward", "optimizer", "checkpoint", "comm", "other"]
    plt.close("all")


def test_plot_without_matplotlib_says_how_to_get_it(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = CliRunner().invoke(main, ["plot", str(run)])
    assert out.exit_code == 2 and "pip install 'hpcshard[plot]'" in out.output


def test_cancel_without_a_running_launcher(run: Path) -> None:
    out = CliRunner().invoke(main, ["cancel", str(run)])
    assert out.exit_code == 2 and "nothing to cancel" in out.output


SACCT = """\
4242|PREEMPTED|0:0|00:00:41|n[1-2]|2026-11-24T10:00:41|2026-11-24T10:01:22
4242|COMPLETED|0:0|00:00:30|n[2-3]|2026-11-24T10:01:40|2026-11-24T10:02:10
4242|REQUEUED|0:0|00:00:12|n[1-2]|2026-11-24T10:00:20|2026-11-24T10:00:32
4243|PENDING|0:0|00:00:00|None assigned|Unknown|Unknown
"""


def test_accounting_runs_are_ordered_by_start_each_a_run_of_its_job() -> None:
    from hpcshard.slurm.cluster import parse_history

    runs = parse_history(SACCT + "9999|COMPLETED|0:0|1|n1|x|y\nnot a line\n", ["4242", "4243"])
    assert [(r.job, r.run, r.state) for r in runs] == [
        ("4242", 0, "REQUEUED"), ("4242", 1, "PREEMPTED"), ("4242", 2, "COMPLETED"), ("4243", 0, "PENDING")]
    assert runs[2].nodes == "n[2-3]" and runs[2].elapsed == "00:00:30"


def test_a_job_resized_while_it_ran_is_one_run() -> None:
    """A --no-kill job that lost a node (Slurm set it DOWN, or `launch.release` gave it up):
    accounting closes its record RESIZING and opens another; one run, not a requeue."""
    from hpcshard.slurm.cluster import parse_history

    runs = parse_history(SACCT.replace("4242|COMPLETED|0:0|00:00:30|n[2-3]|2026-11-24T10:01:40",
                                       "4242|COMPLETED|0:0|00:00:05|n[2-3]|2026-11-24T10:02:05")
                         + "4242|RESIZING|0:0|00:00:25|n[2-4]|2026-11-24T10:01:40|2026-11-24T10:02:05\n",
                         ["4242"])
    assert [(r.run, r.state) for r in runs] == [(0, "REQUEUED"), (1, "PREEMPTED"), (2, "COMPLETED")]
    assert (runs[2].nodes, runs[2].start, runs[2].end, runs[2].elapsed) == (
        "n[2-4]", "2026-11-24T10:01:40", "2026-11-24T10:02:10", "00:00:30")


def test_status_of_a_job_the_controller_forgot_reads_accounting(run: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm run whose job scontrol no longer knows (older than MinJobAge): its final
    state, restarts and every run of it from sacct, each attempt beside the run it was."""
    from hpcshard.slurm import client, cluster

    spec = RunSpec.read(run)
    spec.backend, spec.jobs = "slurm", ["4242"]
    spec.write(run)
    lines = (run / "attempts.jsonl").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if '"start"' in line]
    for run_no, i in enumerate(starts):
        lines[i] = json.dumps({**json.loads(lines[i]), "slurm_job": "4242", "slurm_run": run_no})
    (run / "attempts.jsonl").write_text("\n".join(lines) + "\n")
    asked: list[list[str]] = []

    def sacct(*args: Any, **kwargs: Any) -> Any:
        asked.append(list(args[0]))
        return type("P", (), {"returncode": 0, "stdout": SACCT, "stderr": ""})()

    monkeypatch.setattr(cluster, "show_job", lambda *a, **k: None)  # purged: scontrol fails
    monkeypatch.setattr(cluster.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(client.subprocess, "run", sacct)
    out = CliRunner().invoke(main, ["status", str(run)])
    assert out.exit_code == 0, out.output
    assert ("slurm job 4242: COMPLETED, restarts 2, nodes n[2-3], run time 00:00:30, exit 0:0 "
            "(from accounting: the controller has forgotten it)") in out.output
    assert "4242.1: PREEMPTED, n[1-2]" in out.output and "4242.2: COMPLETED, n[2-3]" in out.output
    assert "slurm runs (3, from accounting):" in out.output
    assert all("--duplicates" in a and "-S" in a for a in asked if a[0] == "sacct")  # since the run began
    listed = CliRunner().invoke(main, ["ls", str(run.parent)])
    assert listed.exit_code == 0 and "COMPLETED" in listed.output, listed.output


def test_status_without_accounting_says_what_scontrol_says(run: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    spec = RunSpec.read(run)
    spec.backend, spec.jobs = "slurm", ["4242"]
    spec.write(run)
    running = {"JobState": "RUNNING", "Restarts": "1"}
    monkeypatch.setattr(cluster, "show_job", lambda job, **k: cluster.JobInfo.of_scontrol(job, running))
    monkeypatch.setattr(cluster, "history", lambda *a, **k: None)  # sacct: accounting disabled
    monkeypatch.setattr("hpcshard.slurm.poll.queue_states",
                        lambda jobs, **k: {j: cluster.JobInfo.of_scontrol(j, running) for j in jobs})
    out = CliRunner().invoke(main, ["status", str(run)])
    assert out.exit_code == 0 and "slurm job 4242: RUNNING, restarts 1" in out.output
    assert "from accounting" not in out.output and "slurm runs" not in out.output
    listed = CliRunner().invoke(main, ["ls", str(run.parent)])
    assert "RUNNING" in listed.output


def test_status_names_each_kind_of_culprit() -> None:
    """A rank whose own code raised is recorded with its host and no node (`RankFailed`):
    `status` printed a traceback (KeyError 'node') on the first such run, on a GPU."""
    from hpcshard.rundir.status import _culprit

    assert _culprit({}) == "culprit unknown"
    raised = {"rank": 0, "host": "vm", "step": 60, "error": "RuntimeError", "message": "x", "log": "l"}
    assert _culprit(raised) == "rank 0 on vm: RuntimeError"
    assert _culprit({"rank": 3, "pid": 7, "step": 5, "node": 1, "host": "n2"}) == "rank 3 on n2 (node 1)"
    assert _culprit({"rank": 3, "node": 1}) == "rank 3 on node 1"
    assert _culprit({"node": 2, "state": "lost", "host": "n3"}) == "node 2 (n3) lost"
