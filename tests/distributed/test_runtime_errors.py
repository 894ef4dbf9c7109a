"""Which failures of a rank stop the run as the user's error (exit 2, never restarted):
only hpcshard's own `UserError`. A ValueError from json, torch or the job's code is a
rank failure, which the launchers restart (and stop, as a bug, if it comes back). The
user-error side: test_runtime_checkpoint's read-only run directory and changed model."""

from __future__ import annotations

from pathlib import Path

from hpcshard.rundir import ledger
from hpcshard.rundir.rankenv import BUG_EXIT
from tests.conftest import hpcshard, sets
from tests.distributed.test_launch_supervise import FAULTY, faults


def test_a_valueerror_from_the_jobs_code_is_restarted_not_a_user_error(tmp_path: Path) -> None:
    run = tmp_path / "json"
    proc = hpcshard("submit", "--gpus", "1", FAULTY, "--run-dir", str(run),
                    *sets(steps=6, ckpt_every=100, fail_at=3, fail_with="json"))
    assert proc.returncode == BUG_EXIT, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = faults(run)
    assert first["restart"] and not second["restart"]  # retried once, then taken for a bug
    assert second["culprit"]["error"] == "JSONDecodeError"
    assert not any(r.get("user_error") for r in ledger.read(run))

