"""Submission through submitit, with hpcshard's own sbatch text: submitit keeps tracking
the job and its per-task logs; the script is the template's. submitit is imported only
when a job is submitted (`render` stays instant)."""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcshard.slurm.sbatch import SbatchRequest, render
from hpcshard.slurm.time import parse_time


def executor(req: SbatchRequest, run_dir: Path) -> Any:
    """A submitit SlurmExecutor whose sbatch text is hpcshard's rendered template, so that
    submitit still tracks the job and its per-task logs."""
    import submitit

    class Executor(submitit.SlurmExecutor):  # type: ignore[misc]
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return render(req, command, Path(self.folder))

    ex = Executor(folder=run_dir / "submitit", python=shlex.quote(req.python) if req.python else None)
    # Only for submitit's bookkeeping (tasks to track, its timeout guess): the text is ours.
    ex.update_parameters(nodes=req.nodes, ntasks_per_node=1,
                         time=math.ceil(parse_time(req.time) / 60))
    return ex


def submit_command(req: SbatchRequest, run_dir: Path) -> str:
    """The command submitit runs in every task (its `_submitit_command_str`), without
    importing submitit: `render` stays instant. A test holds the two equal."""
    python = shlex.quote(req.python) if req.python else shlex.quote(sys.executable)
    return f"{python} -u -m submitit.core._submit {shlex.quote(str(run_dir / 'submitit'))}"


def sbatch_text(req: SbatchRequest, run_dir: Path) -> str:
    """Exactly what `submit` would hand to sbatch."""
    return render(req, submit_command(req, run_dir), run_dir / "submitit")


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """submitit runs sbatch without capturing its stderr: catch it at the file descriptor, so
    a refusal is reported once, in hpcshard's own error line."""
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.extend(line for line in sink.read().splitlines() if line.strip())


def submit(req: SbatchRequest, run_dir: Path, fn: Any, *args: Any) -> str:
    """Submit and return the job id; sbatch's own message on refusal (ValueError)."""
    import submitit

    ex = executor(req, run_dir)
    failure: BaseException | None = None
    with _stderr_captured() as said:
        try:
            job = ex.submit(fn, *args)
        except (subprocess.CalledProcessError, submitit.core.utils.FailedJobError) as err:
            failure = err
    if failure is not None:
        lines = said or [str(failure)]
        raise ValueError(f"sbatch refused the job: {lines[-1]}") from None
    for line in said:  # sbatch's warnings on success still reach the user
        print(line, file=sys.stderr)
    return str(job.job_id)
