"""The job steps of an allocation the user holds (`hpcshard run` inside `salloc`): a run
there is one step, named after the run (`step_name`), not a job of its own. What the
login node asks of it (does it still run?) and does to it (a notice, a cancel) goes to
that step alone: the allocation, and whatever else the user runs in it, stay theirs.
Stdlib; the error convention of `hpcshard.slurm.cluster` (a query never raises)."""

from __future__ import annotations

import hashlib
import re

from hpcshard.slurm import client
from hpcshard.slurm.env import parse_gpus_per_node


def step_name(run_name: str, created: float) -> str:
    """The step's name (srun --job-name): the run's name, readable in `squeue -s`, and a
    digest of when the run was made, so two runs of one name in one allocation differ.
    Letters, digits, `.`, `_` and `-` only: it is matched in squeue's output."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", run_name).strip("-")[:40] or "run"
    return f"hpcshard-{readable}-{hashlib.sha1(repr(created).encode()).hexdigest()[:8]}"


def parse_steps(text: str, name: str) -> list[str]:
    """The ids (JOB.STEP) of the steps called `name` in `squeue -s -h -o "%i %j"`'s output."""
    found = []
    for line in text.splitlines():
        step, _, called = line.strip().partition(" ")
        if called.strip() == name:
            found.append(step)
    return found


def run_steps(job_id: str, name: str, timeout: float | None = None) -> list[str] | None:
    """The steps of allocation `job_id` named `name` that run now ([] when none does, or
    the allocation is over); None: Slurm did not answer. One squeue."""
    reply = client.run(["squeue", "-s", "-j", job_id, "-h", "-o", "%i %j"], timeout=timeout, tries=2,
                       retry=lambda r: r.blip)
    if reply.says("Invalid job id"):
        return []
    if not reply.ok:
        return None
    return parse_steps(reply.out, name)


def gpus_per_node(job_id: str, timeout: float | None = None) -> int | None:
    """The GPUs per node allocation `job_id` holds, as Slurm says (`salloc --gres=gpu:4`
    leaves no trace of them in its shell's environment); None: not said, or no answer."""
    reply = client.run(["squeue", "-j", job_id, "-h", "-o", "%b"], timeout=timeout, tries=2,
                       retry=lambda r: r.blip)
    return parse_gpus_per_node(reply.out.strip()) if reply.ok else None
