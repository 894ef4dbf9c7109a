"""RUN_DIR/spec.json, the request a run was started with: `RunSpec` is its only reader and
writer (atomic, so a launcher never reads half of one), and the checks and names of run
directories. Stdlib: the CLI writes it, launchers and ranks read it."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcshard.rundir import paths, store
from hpcshard.rundir.files import locked, write_atomic
from hpcshard.rundir.paths import RunPaths

SPEC = paths.SPEC
POLICIES = ("requeue", "chain", "none")
SCRIPT_GRACE_S = 60
"""A script's seconds from the notice to its ranks' kill where its spec names none (the
`script_grace` setting's default)."""
"""After a clean stop on Slurm: requeue the job, chain a continuation job (sites that
forbid requeue), or stop."""


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
    spares: int = 0
    """Nodes allocated besides `nodes` that wait, each ready to take a lost node's place."""
    min_nodes: int = 0
    """Fewest nodes the run may go on with after losing nodes it has no spare for (the mesh
    is planned again, DCP reshards); 0: `nodes`, i.e. never fewer."""
    backend: str
    """Where it runs: local."""
    name: str
    """Run name, shown by tools."""
    max_requeues: int = 10
    """Restarts after stop requests before the run gives up."""
    max_restarts: int = 3
    """In-place restarts of the ranks per allocation after a fault."""
    no_progress_restarts: int = 2
    """Restarts in a row without a newer committed checkpoint before the run stops."""
    requeue_policy: str = "requeue"
    """Slurm: after a clean stop, requeue | chain (a continuation job) | none."""
    profile: str = ""
    """The site profile the run was submitted with (empty: none)."""
    bad_nodes: str = "drain"
    """Slurm: a bad node is also drained with the reason (drain) or only avoided (exclude)."""
    health_check: str = ""
    """A shell command every node runs before each attempt trains (the profile's); a
    non-zero exit makes the node bad for this run."""
    run_group: str = ""
    """The Unix group the run directory is shared with (the profile's `run_group`): its
    checkpoint files are loaded when that group owns them, whoever wrote them. Empty: the
    run is private, and only the user's own files load."""
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
    coord_key: str = field(default_factory=lambda: secrets.token_hex(16))
    """What a job's launchers show node 0's store (`launch.coord`) to be let in: the run
    directory is the user's own (0700), so another user on the cluster cannot speak for
    its launchers. Empty in a spec written before the store: its launchers coordinate
    through the run directory's files (a store that let in an empty key would let in
    anyone)."""

    def write(self, run_dir: Path) -> None:
        write_atomic(run_dir / SPEC, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> RunSpec:
        return cls(**{"coord_key": "", **json.loads((run_dir / SPEC).read_text())})

    @classmethod
    def update(cls, run_dir: Path, change: Callable[[RunSpec], None]) -> RunSpec:
        """Read, change and write spec.json under its lock: several writers (a command, a
        job's launcher adding a continuation, a guard taking over) each keep the others'
        changes. Never write back a spec read seconds ago: what others wrote meanwhile
        would be lost (a guard's take-over, erased by a `resume` that read the spec before
        its preflight)."""
        with locked(run_dir / SPEC) as held:
            spec = cls.read(run_dir)
            change(spec)
            held()
            spec.write(run_dir)
        return spec

    @classmethod
    def add_job(cls, run_dir: Path, job_id: str) -> RunSpec:
        """Record a Slurm job submitted for the run (a continuation job, say)."""
        return cls.update(run_dir, lambda spec: spec.jobs.append(job_id))

    @property
    def no_kill(self) -> bool:
        """Slurm: the allocation outlives a failed node (spares, or fewer nodes allowed)."""
        return self.spares > 0 or 0 < self.min_nodes < self.nodes

    @property
    def guarded(self) -> bool:
        """Slurm: a job that Slurm itself would not requeue when a node fails (--no-kill, or
        --no-requeue for a chain) gets a guard job (`launch.slurm.guard`)."""
        return self.no_kill or self.requeue_policy == "chain"

    @property
    def grace_s(self) -> float:
        """A script's seconds from the notice to its ranks' kill; 0 for an hpcshard job."""
        return float(self.script.get("grace", SCRIPT_GRACE_S)) if self.script else 0.0

    def newest_job(self, job_id: str) -> bool:
        """Only the run's newest job may train: a stale requeue or a second continuation
        exits at once instead of racing it for the checkpoints."""
        return not self.jobs or self.jobs[-1] == job_id


def read_spec(run_dir: Path) -> RunSpec:
    if not (run_dir / SPEC).is_file():
        if (run_dir / "sweep.json").is_file():
            raise ValueError(f"{str(run_dir)!r} is a sweep: give one of its runs ({run_dir / 'task-0'}, "
                             "...); status, plot, cancel and ls take the sweep itself")
        raise ValueError(f"{str(run_dir)!r} holds no run (no {SPEC}); start one with hpcshard submit")
    return RunSpec.read(run_dir)


def check_resume(run_dir: Path, resume: str) -> None:
    """Fail early, without torch, on a --resume that names no usable checkpoint."""
    store.select(run_dir / store.CHECKPOINTS, resume)


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


def check_run_dir(path: Path, group: str = "") -> None:
    """Refuse a run directory that holds another run, is not the user's, or cannot be
    written, and a `group` (the profile's run_group) the user is not in; creating nothing."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"run directory {str(path)!r} is a file; choose a directory path")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"run directory {str(path)!r} is not empty; choose a new --run-dir")
    if path.is_dir() and (owner := path.stat().st_uid) != os.geteuid():
        raise ValueError(f"run directory {str(path)!r} belongs to uid {owner}, not to you: its owner "
                         "could replace what the run loads; choose a --run-dir of your own")
    if group:
        group_id(group)
    probe_writable(path)


def group_id(group: str) -> int:
    """The id of `group`, a group this user is in (root: any); ValueError saying why not."""
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"run_group {group!r} is not a group on this host; name one of yours "
                         "(`id -Gn` lists them), or leave run_group empty for private runs") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ValueError(f"run_group {group!r}: you are not in that group (`id -Gn` lists yours); "
                         "name one of yours, or leave run_group empty for private runs")
    return gid


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


def create_run_dir(path: Path, group: str = "") -> None:
    """Run directories are the user's: checkpoints in them hold pickles, and a file others
    can write is code others can run. Private (0700) by default; with `group` (the
    profile's run_group) owned by that group, 2770 (setgid: what is made inside keeps the
    group), for a project whose members share runs. The mode is set, not asked of mkdir:
    an existing (empty) directory would keep its own, and the umask would trim it."""
    gid = group_id(group) if group else -1
    path.mkdir(parents=True, exist_ok=True)
    for d in (path, RunPaths(path).logs):
        d.mkdir(exist_ok=True, mode=0o700)
        if group:
            os.chown(d, -1, gid)
        d.chmod(0o2770 if group else 0o700)


def trusted_gid(run_dir: Path) -> int | None:
    """The group whose members' checkpoint files this run loads (`RunSpec.run_group`), or
    None: only the user's own (no spec, no group, or a group unknown here).

    The trust is only as good as who wrote it: a spec.json this user does not own (or
    that others may write) names no group. The user's own submit, resume or job writes it
    before the job's ranks start, so a run shared by a project is trusted by whichever
    member's job runs it; a spec another user wrote (a run of theirs, `ckpt export`ed) is
    not taken at its word."""
    spec = run_dir / SPEC
    try:
        group = RunSpec.read(run_dir).run_group
        if not group or store.unsafe_permissions(spec):
            return None
        return grp.getgrnam(group).gr_gid
    except (FileNotFoundError, KeyError):
        return None


def wandb_id(run_dir: Path, created: float) -> str:
    """A W&B run id for the run directory: the same at every start, different for another
    run of the same name (W&B ids are letters, digits, - and _)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", run_dir.name).strip("-")[:40] or "run"
    digest = hashlib.sha1(f"{run_dir.resolve()}:{created!r}".encode()).hexdigest()[:8]
    return f"{name}-{digest}"
