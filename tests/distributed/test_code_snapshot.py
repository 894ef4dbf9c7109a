"""The code that was submitted is the code that runs: a job edited after `submit` (its file
and a module it imports) is requeued, after a preemption, with the code as it was."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from hpcshard.rundir import ledger
from hpcshard.rundir.spec import RunSpec
from tests.conftest import ROOT, hpcshard, hpcshard_bg, sets, wait_for
from tests.distributed.test_runtime_checkpoint import trained_to


def test_an_edit_after_submit_changes_nothing_that_runs(tmp_path: Path) -> None:
    work, run = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    (work / "tag.py").write_text("TAG = 'A'\n")
    job = work / "job.py"
    demo = (ROOT / "jobs" / "charlm.py").read_text()
    job.write_text(demo + "\nimport tag\n\nprint(f'code tag {tag.TAG}', flush=True)\n")
    proc = hpcshard_bg("submit", "--backend", "local", "--nodes", "1", "--gpus", "2", str(job), "--run-dir",
                       str(run), *sets(steps=8, ckpt_every=2, dim=32, n_layers=2), cwd=work)
    wait_for(partial(trained_to, run, 2), 180, "step 2")
    (work / "tag.py").write_text("TAG = 'B'\n")  # both edited while the run trains
    job.write_text(demo + "\nprint('code tag C', flush=True)\n")
    assert hpcshard("preempt", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "requeued as attempt 1" in out and "code: " + str(job) in out
    assert out.count("code tag A") == 4, out[-4000:]  # 2 ranks, 2 attempts: the code submitted
    assert "code tag B" not in out and "code tag C" not in out
    assert ledger.end_of(run, 1)["reason"] == "done"  # type: ignore[index]
    spec = RunSpec.read(run)
    assert spec.code is not None and spec.code.source == str(job) and spec.job != str(job)
