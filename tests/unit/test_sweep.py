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


class FakeArrays:
    """sbatch through `slurm.submit.submit_array`, as each array of a sweep would be: what
    was asked (the array, where its logs go, what it waits for, its tasks' run
    directories); array ids from 700, or a refusal at the array `refuse` names."""

    def __init__(self, refuse: int | None = None) -> None:
        self.asked: list[tuple[str, Path, str, list[str]]] = []
        self.refuse = refuse

    def __call__(self, req: SbatchRequest, run_dir: Path, fn: Any, tasks: list[tuple[Any, ...]],
                 after: str = "") -> list[str]:
        if len(self.asked) == self.refuse:
            raise ValueError("sbatch refused the job: QOSMaxSubmitJobPerUserLimit")
        self.asked.append((req.array, req.run_dir, after, [Path(t[0]).name for t in tasks]))
        return [f"{699 + len(self.asked)}_{i}" for i in range(len(tasks))]


def test_more_tasks_than_the_clusters_arrays_take_are_several_arrays_throttled_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five configurations where arrays take two: three arrays, each within the limit, the
    sweep's --max-parallel held across them (each after the one before it); each task's
    job is ARRAY_INDEX of its own array, its batch logs in its own directory (through the
    array's links), and the sweep one record that maps each job back to its task."""
    from hpcshard.rundir.sweep import Sweep
    from hpcshard.slurm import cluster

    monkeypatch.setattr(cluster, "check_request", lambda req: "low")
    monkeypatch.setattr(cluster, "max_array_size", lambda: 2)
    fake = FakeArrays()
    monkeypatch.setattr("hpcshard.slurm.submit.submit_array", fake)
    out = sweep(tmp_path, "--backend", "slurm", "--grid", "lr=1,2,3,4,5", "--max-parallel", "1")
    assert out.exit_code == 0, out.output
    root = (tmp_path / "s").resolve()
    assert fake.asked == [
        ("0-1%1", root, "", ["task-0", "task-1"]),
        ("0-1%1", root / ".array-1", "afterany:700", ["task-2", "task-3"]),
        ("0-0%1", root / ".array-2", "afterany:701", ["task-4"])]
    assert {p.name: os.readlink(p) for p in sorted((root / ".array-1").iterdir())} == {
        "task-0": "../task-2", "task-1": "../task-3"}
    assert (root / ".array-2" / "task-0" / "spec.json").samefile(root / "task-4" / "spec.json")
    jobs = [json.loads((root / f"task-{i}" / "spec.json").read_text())["jobs"] for i in range(5)]
    assert jobs == [["700_0"], ["700_1"], ["701_0"], ["701_1"], ["702_0"]]
    record = Sweep.read(root)
    assert (record.array, record.arrays, record.array_size) == ("700", ["700", "701", "702"], 2)
    assert [record.task_of(job) for job in ("700_1", "701_0", "702_0", "702_1", "703_0", "701")] == \
        [1, 2, 4, None, None, None]
    assert "submitted 3 job arrays (this cluster's take 2 tasks each), one sweep, at most 1 task(s) at " \
        "once across them" in out.output
    assert "  701 (0-1%1): tasks 2 to 3, after 700" in out.output and "  702_0  lr=5  -> " in out.output


def test_an_array_refused_past_the_first_cancels_those_before_it_and_makes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    monkeypatch.setattr(cluster, "check_request", lambda req: "low")
    monkeypatch.setattr(cluster, "max_array_size", lambda: 2)
    monkeypatch.setattr("hpcshard.slurm.submit.submit_array", FakeArrays(refuse=2))
    cancelled: list[tuple[str, ...]] = []
    monkeypatch.setattr(cluster, "scancel", lambda *jobs: cancelled.append(jobs))
    out = sweep(tmp_path, "--backend", "slurm", "--grid", "lr=1,2,3,4,5")
    said = out.output.strip().splitlines()  # (after the sweep's own line, shown before sbatch)
    assert out.exit_code == 2 and len(said) == 2 and said[0].startswith("sweep charlm:"), out.output
    assert ("array 3 of 3 (tasks 4 to 4): sbatch refused the job: QOSMaxSubmitJobPerUserLimit; the 2 "
            "array(s) submitted before it are cancelled") in out.output
    assert cancelled == [("700",), ("701",)] and not (tmp_path / "s").exists()


@pytest.mark.parametrize("fault", ["links", "interrupt"])
def test_a_sweep_stopped_part_way_leaves_no_array_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        fault: str) -> None:
    """Between the arrays' submissions: a storage that takes no symbolic links (the later
    arrays' log links) is one line before any array is queued; Ctrl-C once the first was
    queued cancels it (its tasks would otherwise wait on a sweep with no record of them)."""
    from hpcshard.slurm import cluster

    monkeypatch.setattr(cluster, "check_request", lambda req: "low")
    monkeypatch.setattr(cluster, "max_array_size", lambda: 2)
    fake = FakeArrays()
    if fault == "links":
        def no_links(*args: Any) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "symlink", no_links)
    else:
        def interrupted(*args: Any) -> list[str]:
            if fake.asked:
                raise KeyboardInterrupt
            return fake(*args)

        monkeypatch.setattr("hpcshard.slurm.submit.submit_array", interrupted)
    if fault == "links":
        monkeypatch.setattr("hpcshard.slurm.submit.submit_array", fake)
    cancelled: list[tuple[str, ...]] = []
    monkeypatch.setattr(cluster, "scancel", lambda *jobs: cancelled.append(jobs))
    out = sweep(tmp_path, "--backend", "slurm", "--grid", "lr=1,2,3,4,5")
    assert not (tmp_path / "s").exists(), out.output
    if fault == "links":
        assert out.exit_code == 2 and not fake.asked and not cancelled, out.output
        assert "Operation not permitted" in out.output and "Traceback" not in out.output
    else:
        assert out.exit_code != 0 and cancelled == [("700",)], out.output


def test_a_job_of_a_later_array_names_its_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`status JOB`: scontrol's log path of a later array's task is the array's link (the
    task's own directory is named), and once the controller forgot the job, accounting's
    sweep directory and the record's map say which task it was; a record written before
    sweeps were split (one `array`) reads as one array."""
    from hpcshard.cli.common import run_dir_of
    from hpcshard.rundir.sweep import Sweep
    from hpcshard.slurm import cluster

    root = tmp_path / "s"
    made_sweep(root, "slurm")
    assert Sweep.read(root).array_jobs == ["900"] and Sweep.read(root).task_of("900_1") == 1
    record = Sweep.read(root)
    record.arrays, record.array_size = ["900", "901"], 1
    record.write(root)
    link = Sweep.link_tasks(root, 1, 1, 1) / "task-0"
    monkeypatch.setattr(cluster, "job_state", lambda job: cluster.JobInfo.of_scontrol(
        job, {"JobState": "RUNNING", "StdOut": str(link / "logs" / f"slurm-{job}.out")}))
    assert run_dir_of("901_0") == root / "task-1"
    monkeypatch.setattr(cluster, "job_state", lambda job: None)
    monkeypatch.setattr(cluster, "submitted_from", lambda job: root)
    assert run_dir_of("901_0") == root / "task-1" and run_dir_of("900_0") == root / "task-0"


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


def test_a_later_array_waits_on_sbatchs_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dependency is sbatch's option, not the script's: the rendered script stays the
    template's (the same for every array of the sweep)."""
    from hpcshard.slurm.submit import submit_array

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho 4243\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    req = SbatchRequest(job_name="c", nodes=1, gpus_per_node=1, run_dir=tmp_path / "s", array="0-1%1")
    assert submit_array(req, tmp_path / "s", print, [("a",), ("b",)], "afterany:4242") == ["4243_0", "4243_1"]
    args = (tmp_path / "args").read_text().split()
    assert args[:2] == ["--parsable", "--dependency=afterany:4242"] and args[-1].endswith(".sh")
    assert "dependency" not in Path(args[-1]).read_text()
    submit_array(req, tmp_path / "s", print, [("a",)])
    assert "--dependency" not in (tmp_path / "args").read_text()


def test_task_states_come_from_accounting_and_the_rest_from_one_squeue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Accounting answers for what it has (only jobs since the run was made are asked for:
    an id may have been another job's); the tasks it lacks come from one squeue for all
    of them, never scontrol job by job."""
    from hpcshard.cli.common import job_states
    from hpcshard.slurm import cluster, poll

    asked: list[Any] = []

    def history(jobs: list[str], since: float | None = None, **_: Any) -> list[Any]:
        asked.append(since)
        return [cluster.SlurmRun(job="900_0", run=0, state="RUNNING", exit_code="0:0", elapsed="5",
                                 nodes="n1", start="2026-01-01T00:00:00", end="Unknown")]

    queued: list[list[str]] = []

    def queue_states(jobs: list[str], **_: Any) -> dict[str, Any]:
        queued.append(jobs)
        return {"900_1": cluster.JobInfo.of_scontrol("900_1", {"JobState": "PENDING"})}

    monkeypatch.setattr(cluster, "history", history)
    monkeypatch.setattr(poll, "queue_states", queue_states)
    monkeypatch.setattr(cluster, "job_state", lambda *a, **k: pytest.fail("scontrol asked job by job"))
    assert job_states(["900_0", "900_1", "900_2"], since=1000.0) == {
        "900_0": "RUNNING", "900_1": "PENDING", "900_2": "unknown"}
    assert asked == [1000.0] and queued == [["900_1", "900_2"]]
