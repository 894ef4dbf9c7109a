"""Talking to Slurm from the login node: what the cluster offers, and submission through
submitit with hpcshard's own sbatch text. submitit is imported only when it is needed."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcshard.sbatch import SbatchRequest, parse_time, render


def available() -> bool:
    """Slurm's client commands are here and a controller answers."""
    if not shutil.which("sbatch"):
        return False
    try:
        proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):  # missing, or a controller that hangs
        return False
    return proc.returncode == 0 and "UP" in proc.stdout


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: int
    gpus_per_node: int
    max_time_s: int | None = None
    """The partition's MaxTime; None: unlimited."""


def _limit(text: str) -> int | None:
    try:
        return parse_time(text)
    except ValueError:  # infinite, UNLIMITED, n/a
        return None


def partitions() -> dict[str, Partition]:
    """From sinfo: partition, node count, and GPUs per node (gres gpu:N)."""
    if not shutil.which("sinfo"):
        raise ValueError("Slurm's client commands are not installed here (no sinfo on PATH); "
                         "submit from a login node, or use --backend local")
    proc = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%G|%l"], capture_output=True, text=True)
    if proc.returncode:
        detail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise ValueError(f"Slurm does not answer (sinfo: {detail}); check that the controller runs "
                         "and SLURM_CONF points at its slurm.conf, or use --backend local")
    out = proc.stdout
    found: dict[str, Partition] = {}
    for line in out.splitlines():
        name, count, gres, limit = line.split("|")
        gpus = re.search(r"gpu(?::[^:,(]+)?:(\d+)", gres)
        part = Partition(name=name.rstrip("*"), default=name.endswith("*"), nodes=int(count),
                         gpus_per_node=int(gpus.group(1)) if gpus else 0, max_time_s=_limit(limit))
        prev = found.get(part.name)  # one line per node state: add the counts up
        found[part.name] = part if prev is None else Partition(
            part.name, part.default or prev.default, prev.nodes + part.nodes,
            max(prev.gpus_per_node, part.gpus_per_node), part.max_time_s)
    return found


def check_request(req: SbatchRequest) -> str:
    """Refuse shapes the partition cannot run; returns the partition used."""
    parts = partitions()
    name = req.partition or next((p.name for p in parts.values() if p.default), "")
    if name not in parts:
        raise ValueError(f"--partition {req.partition!r} does not exist; partitions: "
                         + ", ".join(sorted(parts)))
    part = parts[name]
    if req.nodes > part.nodes:
        raise ValueError(f"--nodes {req.nodes} is more than partition {name!r} has ({part.nodes})")
    if req.gpus_per_node > part.gpus_per_node:
        raise ValueError(f"{req.gpus_per_node} GPUs per node (--gpus, or the profile's gpus_per_node) "
                         f"is more than the nodes of partition {name!r} have ({part.gpus_per_node}); "
                         f"use --gpus {part.gpus_per_node} or fewer")
    return name


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


def job_state(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (works without accounting; finished jobs stay visible
    for MinJobAge). Empty when Slurm no longer knows the job."""
    if not shutil.which("scontrol"):
        return _sacct_state(job_id)
    from hpcshard.launch.slurm import show_job

    fields = show_job(job_id)
    return _sacct_state(job_id) if fields is None else fields


def _sacct_state(job_id: str) -> dict[str, str]:
    """Jobs older than MinJobAge are gone from scontrol; accounting, where a site runs it,
    still knows them. Without slurmdbd, sacct exits non-zero: then nobody knows."""
    if not shutil.which("sacct"):
        return {}
    proc = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,Elapsed,NodeList"],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode or not lines:
        return {}
    state, elapsed, nodes = (lines[-1].split("|") + ["", "", ""])[:3]
    return {"JobState": state.split()[0] if state else "", "RunTime": elapsed, "NodeList": nodes}
