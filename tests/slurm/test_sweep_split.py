"""A sweep larger than the cluster's job arrays take, on the local cluster (MaxArraySize
lowered to 6 for the session: conftest.MAX_ARRAY_SIZE): 7 configurations run as two arrays
(6 tasks, then 1), 3 at a time across both, and are one sweep to the user. Followed with
`status --follow`: one squeue a poll for the tasks of both arrays."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tests.conftest import hpcshard, sets
from tests.slurm.conftest import MAX_ARRAY_SIZE, follow_sweep, slurm

TASKS, PARALLEL = MAX_ARRAY_SIZE + 1, 3


def most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    """The most intervals [start, end) that overlap at any moment."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])  # ends first
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_sweep_past_max_array_size_runs_whole_as_one_sweep(cluster: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    lrs = ",".join(f"{(i + 1) * 1e-3:g}" for i in range(TASKS))
    proc = hpcshard("sweep", "--backend", "slurm", "jobs/charlm.py", "--grid", f"lr={lrs}",
                    "--nodes", "1", "--gpus", "1", "--partition", "low", "--time", "10:00",
                    "--max-parallel", str(PARALLEL), "--sweep-dir", str(root), *sets(steps=2), env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((root / "sweep.json").read_text())
    first, second = record["arrays"]
    assert record["array"] == first and record["array_size"] == MAX_ARRAY_SIZE
    assert f"submitted 2 job arrays (this cluster's take {MAX_ARRAY_SIZE} tasks each)" in proc.stdout
    assert f"  {second} (0-0%{PARALLEL}): tasks 6 to 6, after {first}" in proc.stdout
    jobs = [json.loads((root / f"task-{i}" / "spec.json").read_text())["jobs"][-1] for i in range(TASKS)]
    assert jobs == [f"{first}_{i}" for i in range(MAX_ARRAY_SIZE)] + [f"{second}_0"]

    out, _ = follow_sweep(cluster, root, tmp_path, timeout=540)
    # One sweep: every task of both arrays followed, then in one table, all finished.
    assert f"following {TASKS} Slurm job(s)" in out and f"job arrays {first}, {second}" in out
    table = [line for line in out.splitlines() if line.startswith("task-") and "  " in line]
    assert len(table) == TASKS and all(" COMPLETED " in row and " 2/2 " in row for row in table), out
    # (follow_sweep: one squeue a poll for the tasks of both arrays, never job by job)

    # The throttle held across the arrays (Slurm's own times), and the second array
    # started only once every task of the first was over.
    spans = {}
    for line in slurm("sacct", "-j", ",".join(jobs), "-X", "-n", "-P", "-o", "JobID,Start,End").splitlines():
        job, begun, ended = line.split("|")
        spans[job] = (datetime.fromisoformat(begun), datetime.fromisoformat(ended))
    assert sorted(spans) == sorted(jobs), spans
    assert most_at_once(list(spans.values())) <= PARALLEL, spans
    assert spans[jobs[-1]][0] >= max(end for job, (_, end) in spans.items() if job != jobs[-1]), spans

    # The later array's task: its batch log in its own directory, found by its job id.
    assert (root / "task-6" / "logs" / f"slurm-{jobs[-1]}.out").is_file()
    by_id = hpcshard("status", jobs[-1], env=cluster)
    assert by_id.returncode == 0 and str(root / "task-6") in by_id.stdout, by_id.stdout + by_id.stderr
    listed = hpcshard("ls", str(tmp_path), env=cluster)
    assert f"sweep sweep: {TASKS} run(s): {TASKS} COMPLETED" in listed.stdout, listed.stdout


def test_cancel_of_a_split_sweep_stops_the_arrays_still_waiting(cluster: dict[str, str],
                                                                tmp_path: Path) -> None:
    """`cancel SWEEP` while the later array waits on the first (--max-parallel 1): every
    task's job ends CANCELLED, and the later array's task never starts (the first array's
    end is what its dependency waits for); `status JOB` of the waiting task names it."""
    from tests.conftest import wait_for

    root = tmp_path / "sweep"
    lrs = ",".join(f"{(i + 1) * 1e-3:g}" for i in range(TASKS))
    proc = hpcshard("sweep", "--backend", "slurm", "jobs/charlm.py", "--grid", f"lr={lrs}",
                    "--nodes", "1", "--gpus", "1", "--partition", "low", "--time", "10:00",
                    "--max-parallel", "1", "--sweep-dir", str(root), *sets(steps=100000), env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [json.loads((root / f"task-{i}" / "spec.json").read_text())["jobs"][-1] for i in range(TASKS)]
    wait_for(lambda: "RUNNING" in slurm("squeue", "-h", "-j", jobs[0], "-o", "%T"), 120, "task 0 running")
    waiting = slurm("squeue", "-h", "-r", "-j", jobs[-1].split("_")[0], "-o", "%T %r")
    assert waiting.split() == ["PENDING", "Dependency"], waiting
    for pending in (jobs[-1], jobs[1]):  # a waiting task of either array, named by its job id
        by_id = hpcshard("status", pending, env=cluster)
        task = root / f"task-{jobs.index(pending)}"
        assert by_id.returncode == 0 and str(task) in by_id.stdout, by_id.stdout + by_id.stderr
    cancelled = hpcshard("cancel", str(root), env=cluster)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    arrays = ",".join(sorted({job.split("_")[0] for job in jobs}))
    wait_for(lambda: not slurm("squeue", "-h", "-j", arrays, "-o", "%i").strip(), 60, "the arrays gone")
    later = jobs[-1].split("_")[0]

    def rows() -> list[list[str]]:  # (a task cancelled while pending: its array's row, 12 or 12_[3%1])
        return [line.split("|") for line in slurm("sacct", "-j", arrays, "-X", "-n", "-P", "-o",
                                                  "JobID,State,NodeList").splitlines()]

    wait_for(lambda: any(r[0].split("_")[0] == later for r in rows()), 60, "the later array in accounting")
    assert all(state.startswith("CANCELLED") for _, state, _ in rows()), rows()
    assert {nodes for job, _, nodes in rows() if job.split("_")[0] == later} == {"None assigned"}, rows()
