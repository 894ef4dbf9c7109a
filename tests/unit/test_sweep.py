"""Sweeps without running one: the grid, the file of configurations, the array request,
and bad input (one line, exit 2, nothing made or submitted). The runs themselves: the dist
layer (local backend) and the slurm layer (a job array)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.rundir.sweep import expand, label, read_configs
from hpcshard.slurm.sbatch import SbatchRequest, render


def test_the_grid_is_every_combination_first_axis_slowest() -> None:
    assert expand(["lr=1e-3,3e-4", "dim=64,128"]) == [
        {"lr": "1e-3", "dim": "64"}, {"lr": "1e-3", "dim": "128"},
        {"lr": "3e-4", "dim": "64"}, {"lr": "3e-4", "dim": "128"}]
    # a file's configurations, each with every combination of the axes on top
    assert expand(["seed=1,2"], [{"lr": 0.001, "compile": True}, {"lr": "3e-4"}]) == [
        {"lr": "0.001", "compile": "true", "seed": "1"}, {"lr": "0.001", "compile": "true", "seed": "2"},
        {"lr": "3e-4", "seed": "1"}, {"lr": "3e-4", "seed": "2"}]
    assert label({"lr": "1e-3", "dim": "64"}) == "lr=1e-3,dim=64"


@pytest.mark.parametrize("grid,needle", [
    (["lr="], "--grid 'lr=' has an empty value"),
    (["lr=1e-3,,3e-4"], "has an empty value"),
    (["lr"], "--grid 'lr' is not KEY=V1,V2,..."),
    (["lr=1", "lr=2"], "--grid lr is given twice; put all its values in one: --grid lr=1,2"),
])
def test_bad_axes(grid: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        expand(grid)
    assert needle in str(err.value)


def test_a_file_of_configurations(tmp_path: Path) -> None:
    listed = tmp_path / "c.json"
    listed.write_text('[{"lr": 0.001}, {"lr": 0.0003, "dim": 64}]')
    assert read_configs(listed) == [{"lr": 0.001}, {"lr": 0.0003, "dim": 64}]
    lines = tmp_path / "c.jsonl"
    lines.write_text('{"lr": 0.001}\n\n{"lr": 0.0003}\n')
    assert read_configs(lines) == [{"lr": 0.001}, {"lr": 0.0003}]
    for text, needle in (("[]", "holds no configurations"), ('{"lr": 1}\nnope', "line 2: not JSON"),
                         ('[{"lr": [1, 2]}]', "configuration 0: lr is [1, 2]"),
                         ("[1, 2]", "no configurations")):
        listed.write_text(text)
        with pytest.raises(ValueError) as err:
            read_configs(listed)
        assert needle in str(err.value), err.value
    with pytest.raises(ValueError, match="give a readable JSON file"):
        read_configs(tmp_path / "missing.json")


def test_an_array_request_renders_one_task_per_configuration_with_its_own_logs(tmp_path: Path) -> None:
    req = SbatchRequest(job_name="charlm", nodes=2, gpus_per_node=8, run_dir=Path("/sweeps/s"), array="0-3%2")
    text = render(req, "python -m submitit.core._submit /sweeps/s/submitit", Path("/sweeps/s/submitit"))
    assert "#SBATCH --array=0-3%2" in text
    assert "#SBATCH --output=/sweeps/s/task-%a/logs/slurm-%A_%a.out" in text
    assert "--output /sweeps/s/submitit/%A_%a_%t_log.out" in text
    single = render(SbatchRequest(job_name="charlm", nodes=1, gpus_per_node=1, run_dir=Path("/r")), "x",
                    Path("/r/submitit"))
    assert "--array" not in single and "#SBATCH --output=/r/logs/slurm-%j.out" in single
    with pytest.raises(ValueError, match="is not 0-N or 0-N%M"):
        render(SbatchRequest(job_name="c", nodes=1, gpus_per_node=1, array="0-3; rm -rf /"), "x", tmp_path)


def sweep(tmp_path: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["sweep", "jobs/charlm.py", "--sweep-dir", str(tmp_path / "s"), *args])


@pytest.mark.parametrize("args,needle", [
    ([], "nothing to sweep: give --grid KEY=V1,V2 (repeatable) or --configs FILE"),
    (["--grid", "lr="], "--grid 'lr=' has an empty value"),
    (["--grid", "lr=1e-3", "--requeue-policy", "chain"], "--requeue-policy chain: a sweep's tasks"),
    (["--configs", "nowhere.json"], "--configs 'nowhere.json'"),
    (["--grid", "lr=1e-3", "--spares", "1"], "--spares/--min-nodes (1/0): a sweep's runs do not take spares"),
])
def test_bad_sweeps_are_one_line_and_nothing_is_made(tmp_path: Path, args: list[str], needle: str) -> None:
    out = sweep(tmp_path, "--backend", "local", *args)
    assert out.exit_code == 2, out.output
    assert needle in out.output and len(out.output.strip().splitlines()) == 1, out.output
    assert not (tmp_path / "s").exists()


def test_more_tasks_than_the_clusters_arrays_take_is_refused_before_submitting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    monkeypatch.setattr(cluster, "check_request", lambda req: "low")
    monkeypatch.setattr(cluster, "max_array_size", lambda: 5)  # indices 0..4
    submitted: list[Any] = []
    monkeypatch.setattr("hpcshard.slurm.submit.submit_array", lambda *a: submitted.append(a))
    out = sweep(tmp_path, "--backend", "slurm", "--grid", "lr=1,2,3", "--grid", "dim=32,64")
    assert out.exit_code == 2 and not submitted and not (tmp_path / "s").exists()
    assert ("6 configurations is more than this cluster's job arrays take (MaxArraySize=5: indices 0 to 4); "
            "split the grid into sweeps of at most 5") in out.output


def made_sweep(root: Path, backend: str) -> None:
    """A sweep's directory as `sweep` leaves it: two runs, the first trained to step 4."""
    from hpcshard.rundir.spec import Resolved, RunSpec
    from hpcshard.rundir.sweep import Sweep

    configs = [{"lr": "1e-3"}, {"lr": "3e-3"}]
    root.mkdir()
    Sweep(job="jobs/charlm.py", name="charlm", backend=backend, configs=configs,
          array="900" if backend == "slurm" else "").write(root)
    for i, config in enumerate(configs):
        task = root / f"task-{i}"
        task.mkdir()
        RunSpec(job="jobs/charlm.py", sets=config, nodes=1, gpus=1, backend=backend, name=f"charlm-{i}",
                jobs=[f"900_{i}"] if backend == "slurm" else [],
                resolved=Resolved(config={"steps": 8})).write(task)
    (root / "task-0" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "time": 1.0 + s, "loss": 3.0, "eval_loss": 2.5 if s == 4 else None})
                  for s in range(1, 5)) + "\n")


def test_ls_lists_a_sweep_as_one_line_and_run_commands_name_its_runs(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    made_sweep(tmp_path / "s", "slurm")
    monkeypatch.setattr(cluster, "history", lambda jobs, **k: [
        cluster.SlurmRun(job=j, run=0, state="RUNNING", exit_code="0:0", elapsed="1", nodes="n1",
                         start="2026-01-01T00:00:00", end="Unknown") for j in jobs])
    out = CliRunner().invoke(main, ["ls", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "sweep s: 2 run(s): 2 RUNNING; best eval 2.5000 (lr=1e-3)" in out.output
    table = CliRunner().invoke(main, ["status", str(tmp_path / "s")]).output
    assert "task-0  lr=1e-3        RUNNING  4/8   2.5000" in table and "job array 900" in table
    out = CliRunner().invoke(main, ["logs", str(tmp_path / "s")])
    assert out.exit_code == 2 and "is a sweep: give one of its runs" in out.output


def test_cancel_of_a_sweep_cancels_every_task_in_one_scancel(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    made_sweep(tmp_path / "s", "slurm")
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(cluster, "scancel", lambda *args: asked.append(args))
    out = CliRunner().invoke(main, ["cancel", str(tmp_path / "s")])
    assert out.exit_code == 0 and asked == [("900_0", "900_1")], out.output
    assert (tmp_path / "s" / "cancelled").exists()  # the local runner would start no more


def test_an_array_of_one_task_is_still_an_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep of one configuration: the script says --array=0-0, so the task is ARRAY_0 and
    its pickle must be named so (submitit's own path for one job would name it ARRAY)."""
    from hpcshard.slurm.submit import submit_array

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f"#!/bin/sh\nfor a; do script=$a; done\ncp \"$script\" {tmp_path}/submitted.sh\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    req = SbatchRequest(job_name="c", nodes=1, gpus_per_node=1, run_dir=tmp_path / "s", array="0-0")
    for tasks, ids in (([("a",)], ["4242_0"]), ([("a",), ("b",)], ["4242_0", "4242_1"])):
        assert submit_array(replace(req, array=f"0-{len(tasks) - 1}"), tmp_path / "s", print, tasks) == ids
        for job in ids:
            assert (tmp_path / "s" / "submitit" / f"{job}_submitted.pkl").is_file()
        assert f"#SBATCH --array=0-{len(tasks) - 1}" in (tmp_path / "submitted.sh").read_text()


def test_task_states_come_from_accounting_and_pending_tasks_from_scontrol(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """sacct lists an array's pending tasks as one row (900_[1-2%1]): those come from scontrol;
    only jobs since the run was made are asked for (an id may have been another job's)."""
    from hpcshard.cli.common import job_states
    from hpcshard.slurm import cluster

    asked: list[Any] = []

    def history(jobs: list[str], since: float | None = None, **_: Any) -> list[Any]:
        asked.append(since)
        return [cluster.SlurmRun(job="900_0", run=0, state="RUNNING", exit_code="0:0", elapsed="5",
                                 nodes="n1", start="2026-01-01T00:00:00", end="Unknown")]

    monkeypatch.setattr(cluster, "history", history)
    monkeypatch.setattr(cluster, "job_state",
                        lambda job, **k: cluster.JobInfo.of_scontrol(job, {"JobState": "PENDING"})
                        if job == "900_1" else None)
    assert job_states(["900_0", "900_1", "900_2"], since=1000.0) == {
        "900_0": "RUNNING", "900_1": "PENDING", "900_2": "unknown"}
    assert asked == [1000.0]
