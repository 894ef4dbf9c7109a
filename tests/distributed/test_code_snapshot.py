"""The code that was submitted is the code that runs: a job edited after `submit` (its file
and a module it imports) runs as it was in every later start of the run: the ranks the
launchers restart in place after a rank is killed, and the attempt requeued after a
preemption; and a sweep's task that starts after the edit runs the sweep's copy.

(A continuation job, Slurm's `chain` policy, submits the first job's script and submitit
pickle again (`launch.slurm.chain`): its launchers and ranks start from the same spec.json
as a requeue's, and `runtime.main` imports the copy it names, the path tested here; on the
real cluster, tests/slurm/test_launch_slurm.py's chain test edits its job after submit.)"""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

from hpcshard.rundir import ledger
from hpcshard.rundir.spec import RunSpec
from tests.conftest import ROOT, hpcshard, hpcshard_bg, sets, wait_for
from tests.distributed.test_runtime_checkpoint import rank_pids, trained_to

DEMO = (ROOT / "jobs" / "charlm.py").read_text()


def workspace(tmp_path: Path) -> Path:
    """A job outside the repository that prints, at import, the tag of a module beside it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "tag.py").write_text("TAG = 'A'\n")
    (work / "job.py").write_text(DEMO + "\nimport tag\n\nprint(f'code tag {tag.TAG}', flush=True)\n")
    return work


def edit(work: Path) -> None:
    """Both files edited: the module the job imports, and the job itself."""
    (work / "tag.py").write_text("TAG = 'B'\n")
    (work / "job.py").write_text(DEMO + "\nprint('code tag C', flush=True)\n")


def starts(run: Path) -> list[tuple[int, int]]:
    return [(r["attempt"], r.get("cycle", 0)) for r in ledger.read(run) if r["event"] == "start"]


def test_an_edit_after_submit_changes_nothing_that_runs(tmp_path: Path) -> None:
    """Edited at step 2; then a rank is killed (the launchers restart both ranks in place:
    each imports the job again), then the run is preempted (the requeued attempt imports it
    again). Every one of the 3 starts x 2 ranks runs the code submitted."""
    work, run = workspace(tmp_path), tmp_path / "run"
    job = work / "job.py"
    proc = hpcshard_bg("submit", "--backend", "local", "--nodes", "1", "--gpus", "2", str(job), "--run-dir",
                       str(run), *sets(steps=20, ckpt_every=2, dim=32, n_layers=2), cwd=work)
    wait_for(partial(trained_to, run, 2), 180, "step 2")
    edit(work)  # while the run trains
    os.kill(rank_pids(run)[-1], signal.SIGKILL)
    wait_for(lambda: (0, 1) in starts(run), 180, "the ranks restarted in place")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert starts(run) == [(0, 0), (0, 1), (1, 0)], out[-4000:]
    assert "requeued as attempt 1" in out and "code: " + str(job) in out
    assert out.count("code tag A") == 6, out[-4000:]  # 2 ranks, 3 starts: the code submitted
    assert "code tag B" not in out and "code tag C" not in out
    assert ledger.end_of(run, 1)["reason"] == "done"  # type: ignore[index]
    spec = RunSpec.read(run)
    assert spec.code is not None and spec.code.source == str(job) and spec.job != str(job)


def test_a_sweep_task_started_after_an_edit_runs_the_sweep_copy(tmp_path: Path) -> None:
    """Two tasks, one at a time (one rank each): the job is edited while task 0 trains,
    before task 1 has started; task 1 imports the copy taken when the sweep was made."""
    work, root = workspace(tmp_path), tmp_path / "sweep"
    proc = hpcshard_bg("sweep", "--backend", "local", "--nodes", "1", "--gpus", "1", str(work / "job.py"),
                       "--grid", "seed=1,2", "--max-parallel", "1", "--sweep-dir", str(root),
                       *sets(steps=8, ckpt_every=8, dim=32, n_layers=2), cwd=work)
    wait_for(partial(trained_to, root / "task-0", 1), 180, "task 0 training")
    assert not (root / "task-1" / "logs" / "run.out").exists()  # (made as task 1 starts)
    edit(work)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "task 1 (seed=2): finished" in out, out[-4000:]
    for task in ("task-0", "task-1"):
        printed = (root / task / "logs" / "run.out").read_text()
        assert printed.count("code tag A") == 1 and "code tag B" not in printed, printed[-3000:]
        assert "code tag C" not in printed
        spec = RunSpec.read(root / task)
        assert spec.code is not None and Path(spec.job).is_relative_to(root / "code")
