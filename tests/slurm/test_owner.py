"""One owner per run directory on the real cluster: while a job trains, `resume` refuses and
a second job started on the same run directory (a duplicate submission, a stale requeue)
leaves it alone."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

from hpcshard.rundir import lease, ledger
from hpcshard.rundir.spec import RunSpec
from tests.conftest import NOT_ABOUT_HANGS, hpcshard, sets, wait_for
from tests.distributed.test_runtime_checkpoint import committed, trained_to
from tests.slurm.conftest import slurm, wait_state
from tests.slurm.test_launch_slurm import DONE, submit


def test_a_second_job_on_a_live_run_refuses_it_and_the_first_trains_to_the_end(
        cluster: dict[str, str], tmp_path: Path) -> None:
    """Defect 5: `resume` took "Slurm did not answer" for "over" and submitted a second job on
    a live run, and wrote back a spec it read before its preflight. The run's lease names
    its job: `resume` refuses while Slurm says it runs (and when Slurm does not answer), and
    a second job on the run, submitted by hand from the same script, exits without a start
    record, a checkpoint or a cleaned file."""
    run = tmp_path / "owned"
    job = submit(cluster, run, "--partition", "low", "--time", "10:00",
                 *sets(steps=40, ckpt_every=5, keep_last=100, **NOT_ABOUT_HANGS))
    wait_for(partial(trained_to, run, 3), 240, "the first job to train")
    owner = lease.read(run)
    assert owner is not None and owner.job == job

    refused = hpcshard("resume", str(run), env=cluster)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"Slurm job {job} still owns it" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert RunSpec.read(run).jobs == [job]

    # The same submission again, by hand, on the debug nodes: it runs beside the first.
    folder = run / "submitit"
    second = slurm("sbatch", "--parsable", "--hold", "--partition", "debug",
                   str(folder / f"{job}_submission.sh")).strip().split(";")[0]
    try:  # (its own to clear: a failed test's cleanup empties the low/high partitions only)
        shutil.copy(folder / f"{job}_submitted.pkl", folder / f"{second}_submitted.pkl")
        slurm("scontrol", "release", second)
        assert wait_state(second, DONE, timeout=240) == "COMPLETED"
    finally:
        slurm("scancel", second)
    said = "".join(p.read_text() for p in folder.glob(f"{second}_*_log.err"))
    assert f"job {second} does not own {run}" in said, said

    assert wait_state(job, DONE, timeout=400) == "COMPLETED"
    assert not [r for r in ledger.read(run) if r.get("slurm_job") == second]
    assert [r["event"] for r in ledger.read(run) if r["event"] == "start"] == ["start"]
    assert 40 in committed(run)
    assert lease.read(run).job == job  # type: ignore[union-attr]
