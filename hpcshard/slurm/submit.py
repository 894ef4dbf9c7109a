"""Submission through submitit, with hpcshard's own sbatch text: submitit keeps tracking
the job and its per-task logs; the script is the template's. submitit is imported only
when a job is submitted (`render` stays instant)."""

from __future__ import annotations

import math
import os
import shlex
import sys
import uuid
from pathlib import Path
from typing import Any

from hpcshard.rundir.paths import RunPaths
from hpcshard.slurm import cluster
from hpcshard.slurm.sbatch import SbatchRequest, render
from hpcshard.slurm.time import parse_time


def executor(req: SbatchRequest, run_dir: Path, after: str = "") -> Any:
    """A submitit SlurmExecutor whose sbatch text is hpcshard's rendered template, so that
    submitit still tracks the job and its per-task logs. `after`: sbatch's --dependency
    (one array of a split sweep waits for those before it: `slurm.arrays`)."""
    import submitit

    class Executor(submitit.SlurmExecutor):  # type: ignore[misc]
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return render(req, command, Path(self.folder))

        def _submit_command(self, command: str) -> Any:
            """submitit 1.5.4's own (core.Executor._submit_command), but sbatch through
            `cluster.sbatch`: submitit runs it with no timeout and no retry. The script's
            name is new for each submission, so a submission whose answer was lost is
            found by it instead of being sent twice."""
            from submitit.core import utils

            uid = uuid.uuid4().hex
            folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
            script = folder / f".submission_file_{uid}.sh"
            script.write_text(self._make_submission_file_text(command, uid))
            held = [f"--dependency={after}"] if after else []
            job = self.job_class(folder=self.folder, job_id=cluster.sbatch(*held, str(script), unique=True),
                                 tasks=list(range(self._num_tasks())))
            job.paths.move_temporary_file(script, "submission_file", keep_as_symlink=True)
            self._write_job_id(job.job_id, uid)
            self._set_job_permissions(job.paths.folder)
            return job

        def _internal_process_submissions(self, delayed: list[Any]) -> list[Any]:
            """A request with an array (a sweep's, even of one task) is one job array (as
            submitit's own for a batch, whose array executor would write submitit's sbatch
            text, not the template's): each task's pickle is named ARRAY_TASK, where
            `_submit` in the task looks."""
            if len(delayed) == 1 and not req.array:
                return list(super()._internal_process_submissions(delayed))
            from submitit.core import utils
            from submitit.slurm.slurm import SlurmJob

            folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
            folder.mkdir(parents=True, exist_ok=True)
            pickles = []
            for i, one in enumerate(delayed):
                one.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
                pickles.append(folder / f"task-{i}-{os.getpid()}.pkl")
                one.dump(pickles[-1])
            first = self._submit_command(self._submitit_command_str)
            jobs: list[Any] = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}",
                                        tasks=list(range(first.num_tasks))) for i in range(len(delayed))]
            for job, pickle in zip(jobs, pickles, strict=True):
                job.paths.move_temporary_file(pickle, "submitted_pickle")
            return jobs

    ex = Executor(folder=RunPaths(run_dir).submitit, python=shlex.quote(req.python) if req.python else None)
    # Only for submitit's bookkeeping (tasks to track, its timeout guess): the text is ours.
    ex.update_parameters(nodes=req.nodes, ntasks_per_node=1,
                         time=math.ceil(parse_time(req.time) / 60))
    return ex


def job_paths(folder: Path, job_id: str) -> Any:
    """submitit's names for job `job_id`'s files in its `folder` (submission script, pickle,
    per-task logs: submitit's own `JobPaths`, so a submitit release that renames them is
    followed, not re-derived)."""
    from submitit.core.utils import JobPaths

    return JobPaths(folder, job_id)


def submit_command(req: SbatchRequest, run_dir: Path) -> str:
    """The command submitit runs in every task (its `_submitit_command_str`), without
    importing submitit: `render` stays instant. A test holds the two equal."""
    python = shlex.quote(req.python) if req.python else shlex.quote(sys.executable)
    return f"{python} -u -m submitit.core._submit {shlex.quote(str(run_dir / 'submitit'))}"


def sbatch_text(req: SbatchRequest, run_dir: Path) -> str:
    """Exactly what `submit` would hand to sbatch."""
    return render(req, submit_command(req, run_dir), RunPaths(run_dir).submitit)


def submit(req: SbatchRequest, run_dir: Path, fn: Any, *args: Any) -> str:
    """Submit and return the job id; sbatch's own message on refusal, or that it gave no
    clear answer (ValueError: `cluster.sbatch`)."""
    return submit_array(req, run_dir, fn, [args])[0]


def submit_array(req: SbatchRequest, run_dir: Path, fn: Any, tasks: list[tuple[Any, ...]],
                 after: str = "") -> list[str]:
    """Submit `fn(*args)` for each args in `tasks`: one job, or one job array (`req.array`
    set) whose task i runs tasks[i]; their job ids (ARRAY_i for a task). `after`: sbatch's
    --dependency, on its command line (the rendered script stays the template's). sbatch's
    own message on refusal (ValueError)."""
    ex = executor(req, run_dir, after)
    with ex.batch():  # submitted when the batch closes (`_submit_command`: cluster.sbatch)
        jobs = [ex.submit(fn, *args) for args in tasks]
    return [str(job.job_id) for job in jobs]
