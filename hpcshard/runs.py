"""Run directories and the request that fills them (login node: stdlib only, no torch).

A run directory holds everything one run produces:

    spec.json      the request: job, --set values, shape, backend, resolved config
    metrics.jsonl  one JSON record per logged step / event (rank 0)
    logs/          rank-N.log for every rank
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SPEC = "spec.json"


@dataclass(kw_only=True)
class RunSpec:
    """Everything needed to start (or restart) a run, written to RUN_DIR/spec.json."""

    job: str
    """Job file (absolute path) or module name."""
    sets: dict[str, str]
    """--set values as given; the job's config parses them on every rank."""
    nodes: int
    """Nodes (emulated nodes under the local backend)."""
    gpus: int
    """GPUs, i.e. ranks, per node."""
    backend: str
    """Where it runs: local."""
    name: str
    """Run name, shown by tools."""
    max_requeues: int = 10
    """Restarts after stop requests before the run gives up."""
    requeue_policy: str = "requeue"
    """Slurm: after a clean stop, requeue | chain (a continuation job) | none."""
    profile: str = ""
    """The site profile the run was submitted with (empty: none)."""
    script: dict[str, Any] = field(default_factory=dict)
    """A script run as is (not an hpcshard job): kind (file|module), target, args, cwd,
    signal and grace (what it is sent on a notice, and how long it has). Empty for a job."""
    jobs: list[str] = field(default_factory=list)
    """Slurm job ids submitted for this run, oldest first."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """The sbatch request (Slurm backend), reused by `hpcshard resume`."""
    resolved: dict[str, Any] = field(default_factory=dict)
    """What the preflight found: the full config, sharding, block, parameters."""
    created: float = field(default_factory=time.time)

    def write(self, run_dir: Path) -> None:
        (run_dir / SPEC).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> RunSpec:
        return cls(**json.loads((run_dir / SPEC).read_text()))


def read_spec(run_dir: Path) -> RunSpec:
    if not (run_dir / SPEC).is_file():
        raise ValueError(f"{str(run_dir)!r} holds no run (no {SPEC}); start one with hpcshard submit")
    return RunSpec.read(run_dir)


def check_resume(run_dir: Path, resume: str) -> None:
    """Fail early, without torch, on a --resume that names no usable checkpoint."""
    from hpcshard import checkpoints

    checkpoints.select(run_dir / checkpoints.CHECKPOINTS, resume)


def job_ref(job: str) -> str:
    """A job file as an absolute path (ranks may start elsewhere); a module name as is."""
    path = Path(job)
    if job.endswith(".py") or path.exists():
        if not path.is_file():
            raise ValueError(f"job or script file {job!r} does not exist; give a .py file or a module name")
        return str(path.resolve())
    return job


def job_stem(job: str) -> str:
    """`jobs/charlm.py` -> charlm, `pkg.jobs.lm` -> lm: a run's default name."""
    return Path(job).stem if job.endswith(".py") else job.rsplit(".", 1)[-1]


def default_run_dir(job: str, root: Path = Path("runs")) -> Path:
    """ROOT/JOB-TIME; the root is the profile's storage_root."""
    return root / f"{job_stem(job)}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(path: Path) -> None:
    """Refuse a run directory that holds another run or cannot be written, creating nothing."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"run directory {str(path)!r} is a file; choose a directory path")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"run directory {str(path)!r} is not empty; choose a new --run-dir")
    probe_writable(path)


def probe_writable(path: Path) -> None:
    """Create and remove a directory in `path` (or its nearest existing ancestor): a real
    probe, since permission bits say nothing on read-only mounts or for root."""
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        tempfile.TemporaryDirectory(dir=ancestor).cleanup()
    except OSError as err:
        raise ValueError(f"run directory {str(path)!r} is not writable ({err.strerror} in "
                         f"{str(ancestor)!r}); choose a --run-dir you can write") from None


def create_run_dir(path: Path) -> None:
    """Run directories are private to the user and group: checkpoints in them hold pickles,
    and a file others can write is code others can run."""
    path.mkdir(parents=True, exist_ok=True, mode=0o750)
    (path / "logs").mkdir(exist_ok=True, mode=0o750)


def preflight(spec: RunSpec) -> dict[str, Any]:
    """Import the job and check it in a subprocess (torch stays out of the CLI process)."""
    request = {"job": spec.job, "sets": spec.sets, "nodes": spec.nodes, "gpus": spec.gpus}
    proc = subprocess.run([sys.executable, "-m", "hpcshard.runtime.preflight"],
                          input=json.dumps(request), capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode == 2:
        raise ValueError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                         else "the job failed its preflight check")
    if proc.returncode:
        raise RuntimeError(f"preflight of {spec.job} crashed:\n{proc.stderr}")
    return dict(json.loads(proc.stdout))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of RUN_DIR/metrics.jsonl, oldest first (none yet: empty)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step training records (not evaluations, not start/end events)."""
    return [r for r in records if "loss" in r and "event" not in r]


def last_record(run_dir: Path, key: str) -> dict[str, Any] | None:
    """The newest step record that has `key` (e.g. "loss" or "eval_loss")."""
    found = [r for r in read_metrics(run_dir) if r.get(key) is not None and "event" not in r]
    return found[-1] if found else None
