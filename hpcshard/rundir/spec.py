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
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hpcshard.errors import UserError
from hpcshard.rundir import paths, store
from hpcshard.rundir.copies import refused
from hpcshard.rundir.files import locked, write_atomic
from hpcshard.rundir.paths import RunPaths

SPEC = paths.SPEC
POLICIES = ("requeue", "chain", "none")
"""After a clean stop on Slurm: requeue the job, chain a continuation job (sites that
forbid requeue), or stop."""
SCRIPT_GRACE_S = 60
"""A script's seconds from the notice to its ranks' kill where its spec names none (the
`script_grace` setting's default)."""


@dataclass(frozen=True, kw_only=True)
class Script:
    """A script run as it is (`hpcshard submit train.py -- ARGS`, `-m pkg.mod`), not an
    hpcshard job: spec.json's `script`, an empty object for a job."""

    kind: str
    """file | module."""
    target: str
    """The file's absolute path, or the module's name."""
    args: tuple[str, ...] = ()
    """Its own arguments (after `--`)."""
    cwd: str = ""
    """Where it was submitted from: it runs there where that exists on the node."""
    signal: str = "TERM"
    """What it is sent on a notice (`script_signal`)."""
    grace: float = SCRIPT_GRACE_S
    """Its seconds from the notice to its ranks' kill (`script_grace`)."""

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Script | None:
        """spec.json's object (None for a job's empty one)."""
        return cls(**{**_known(cls, raw), "args": tuple(raw.get("args", ()))}) if raw else None

    @property
    def command(self) -> str:
        """As it would be typed: `script -m pkg.mod ARGS` or `script /abs/train.py ARGS`."""
        return f"script {'-m ' if self.kind == 'module' else ''}{shlex.join([self.target, *self.args])}"


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What a job's preflight found at submit (`runtime.preflight`), spec.json's `resolved`;
    empty for a script, and in a spec whose preflight has not run yet."""

    config: dict[str, Any] = field(default_factory=dict)
    """The job's whole config as it resolved, flat (TrainConfig's fields): read through its
    sections (`hpcshard.sections`), never by key."""
    sharding: str = ""
    """The sharding mode the degrees give (`Parallel.mode`)."""
    replicate: int = 0
    """Replicas of the model on the data-parallel ranks (`Parallel.replicate`)."""
    shard: int = 0
    """Ranks each replica is sharded over (`Parallel.shard_degree`)."""
    block: str = ""
    """The class of the blocks that are sharded (and checkpointed) one by one."""
    blocks: int = 0
    params: int = 0
    """Parameters of the whole model."""
    micro_batch: int = 0
    """Samples per micro-batch on each rank."""
    accumulation: int = 0
    """Micro-batches per optimizer step on each rank."""
    train_tokens: int = 0
    """Tokens in the training data."""

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Resolved:
        """spec.json's object. A key this version does not know (a newer preflight's) is
        dropped: what it says cannot be acted on here."""
        return cls(**_known(cls, raw))

    @property
    def steps(self) -> int | None:
        """The run's optimizer steps (None: not resolved, a script)."""
        steps = self.config.get("steps")
        return None if steps is None else int(steps)


@dataclass(frozen=True, kw_only=True)
class Code:
    """The code a run runs (spec.json's `code`): its workspace as it was at submit, copied
    into the run directory (`cli.snapshot`). Every start of the run (a requeue, a
    continuation, a restart, a sweep's task) imports the job from the copy, not from where
    the user goes on editing; `resume --code current` takes a new copy."""

    source: str
    """The job (or script) as submitted: a file's absolute path, or a module's name."""
    dir: str = ""
    """The copy's root, on sys.path of every rank (empty: nothing copied: the code is an
    installed package, whose version `versions` records, or the run was submitted with
    `--code live`)."""
    path: tuple[str, ...] = ()
    """Directories of the copy put first on every rank's sys.path: the job's own directory
    and the one it was submitted from, as they are in the copy."""
    digest: str = ""
    """sha256 of the copy (its files' names and bytes, in order)."""
    files: int = 0
    bytes: int = 0
    commit: str = ""
    """The git commit of the workspace (empty: not a git repository)."""
    diff_sha256: str = ""
    """sha256 of `git diff HEAD` at submit (empty: no uncommitted change to tracked files);
    the diff itself is `DIR.diff` beside the copy."""
    versions: dict[str, str] = field(default_factory=dict)
    """Python's, torch's, hpcshard's and the installed distributions the job imports."""

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Code | None:
        """spec.json's object (None: a spec written before snapshots, or none taken)."""
        return cls(**{**_known(cls, raw), "path": tuple(raw.get("path", ()))}) if raw else None

    def moved(self, to: Path) -> Code:
        """This copy where it is now, `to` (its run directory was moved or copied)."""
        def there(p: str) -> str:
            return str(to / Path(p).relative_to(self.dir)) if Path(p).is_relative_to(self.dir) else p
        return replace(self, dir=str(to), path=tuple(there(p) for p in self.path))

    def use(self) -> None:
        """Put `path` first on this process's sys.path (a rank's, before it imports the
        job), as `python job.py` puts the job's own directory."""
        for entry in reversed(self.path):
            if entry in sys.path:
                sys.path.remove(entry)
            sys.path.insert(0, entry)

    @property
    def summary(self) -> str:
        """One line: what runs, from where."""
        where = (f"a copy of {self.files} file(s) ({self.bytes / 1e6:.1f} MB) in {self.dir}" if self.dir
                 else "installed or live code, not copied")
        git = f", git {self.commit[:12]}" + (" with uncommitted changes" if self.diff_sha256 else "")
        return f"{self.source}: {where}" + (git if self.commit else "")


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
    script: Script | None = None
    """A script run as it is, not an hpcshard job (None: a job)."""
    jobs: list[str] = field(default_factory=list)
    """Slurm job ids submitted for this run, oldest first."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """The sbatch request of its newest submission (Slurm backend), reused by `hpcshard
    resume`: `hpcshard.slurm.sbatch.SbatchRequest`'s fields, stored and read by it alone
    (`SbatchRequest.record`, `.recorded`; the run directory knows nothing of Slurm)."""
    resolved: Resolved = field(default_factory=Resolved)
    """What the preflight found: the whole config, sharding, blocks, parameters."""
    code: Code | None = None
    """The code the run runs (None: a spec written before snapshots: the job as named)."""
    created: float = field(default_factory=time.time)
    coord_key: str = field(default_factory=lambda: secrets.token_hex(16))
    """What a job's launchers show node 0's store (`launch.coord`) to be let in: the run
    directory is the user's own (0700), so another user on the cluster cannot speak for
    its launchers. Empty in a spec written before the store: its launchers coordinate
    through the run directory's files (a store that let in an empty key would let in
    anyone)."""

    def __post_init__(self) -> None:
        self.code_lost = ""
        """Set by `read` where the run's copy of its code is not where the spec says and no
        folder found is the copy: one line, why and the fix (`use_code` raises it). Not
        written to spec.json."""

    def write(self, run_dir: Path) -> None:
        raw = asdict(self)
        # (the file's shape since the first spec: an empty object for what there is not)
        raw["script"] = raw["script"] or {}
        raw["resolved"] = raw["resolved"] if self.resolved != Resolved() else {}
        if self.code is None:
            del raw["code"]
        write_atomic(run_dir / SPEC, json.dumps(raw, indent=2) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> RunSpec:
        raw = {"coord_key": "", **json.loads((run_dir / SPEC).read_text())}
        raw = _known(cls, raw)
        spec = cls(**{**raw, "script": Script.of(raw.get("script") or {}),
                      "resolved": Resolved.of(raw.get("resolved") or {}),
                      "code": Code.of(raw.get("code") or {})})
        spec._follow_code(run_dir)
        return spec

    def _follow_code(self, run_dir: Path) -> None:
        """A run directory moved (or copied) since its code was: the copy is found where it
        is now, in the run's `code/` (a sweep's task: the sweep's, its parent's, also where
        the task is read through a link, a split sweep's `.array-K/task-I`), by its digest.
        A folder of that name is only a name (the digest's first 16 digits, and the sweep's
        `code/` is the run directory's parent's): it is taken when it is the copy the spec
        records (`copies.refused`). Else the spec keeps the path the copy had, other code is
        never imported in its place, and `code_lost` says why."""
        code = self.code
        if code is None or not code.dir or Path(code.dir).is_dir():
            return
        name = Path(code.dir).name
        places = {p.resolve(): p for p in (run_dir / paths.CODE / name, run_dir.parent / paths.CODE / name,
                                           run_dir.resolve().parent / paths.CODE / name)}
        why = ""
        for place in (p for p in places.values() if p.is_dir()):
            why = refused(place, code.digest, self.run_group)
            if not why:
                break
            why = f"{place} was refused: {why}"
        else:
            why = why or "neither its code/ nor its sweep's holds it"
            self.code_lost = (f"the run's copy of its code is no longer at {code.dir} (its run directory "
                              f"moved?), and {why}; `hpcshard resume {run_dir} --code current` takes a "
                              "new copy")
            return
        old, now = code.dir, place.resolve()
        self.code = code.moved(now)
        if Path(self.job).is_relative_to(old):
            self.job = str(now / Path(self.job).relative_to(old))
        if self.script is not None and Path(self.script.target).is_relative_to(old):
            self.script = replace(self.script, target=self.job)

    def use_code(self) -> None:
        """Put the run's copy of its code first on this process's sys.path (a rank's, before
        it imports the job: `Code.use`); a UserError when the copy was not found
        (`code_lost`), rather than the job's import failing on its old path."""
        if self.code_lost:
            raise UserError(self.code_lost)
        if self.code is not None:
            self.code.use()

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
        return float(self.script.grace) if self.script else 0.0

    def newest_job(self, job_id: str) -> bool:
        """Only the run's newest job may train: a stale requeue or a second continuation
        exits at once instead of racing it for the checkpoints."""
        return not self.jobs or self.jobs[-1] == job_id


def _known(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` without the keys `cls` lacks: a newer hpcshard's (what they say is not acted on
    here; a compute node may run an older release than the login node)."""
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in known}


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
