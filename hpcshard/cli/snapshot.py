"""The code that was submitted is the code that runs.

`submit` and `sweep` read the job's workspace when they build the request: the git
repository that holds the job file (its tracked files and the untracked ones git does not
ignore), or, outside git, the job file's directory. `schedule` writes that copy into the
run directory (RUN_DIR/code/DIGEST/, the same layout, so a job that finds a file beside
itself still does), and the run's spec names the job inside the copy. Every start of the
run imports it from there: a requeue, a continuation job, an in-place restart, a sweep's
task, a `resume` (unless `--code current` takes a new copy). What the user edits after
submitting changes nothing that is queued or running. This is the workspace copy that Ray
(`working_dir`), SkyPilot (`workdir`) and TorchX (workspaces) make, kept with the run.

A module job that is an installed distribution (`pip install -e .` included) is not
copied: its version is recorded, as are Python's, torch's and hpcshard's. The commit and
the hash of `git diff HEAD` go into spec.json, the diff itself beside the copy.

Login-node code: stdlib only (git is asked in a subprocess, where it is installed).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpcshard.errors import UserError
from hpcshard.rundir.copies import cached, code_digest
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.spec import Code, RunSpec

SKIP_DIRS = {"__pycache__", "venv", "node_modules"}
"""Directories never copied from a workspace outside git (nor hidden ones, nor hidden files:
`.env`, `.netrc` hold secrets); inside git, .gitignore decides."""
RUN_FILES = {"spec.json", "sweep.json"}
"""A directory holding one is a run (or a sweep): never part of a workspace's code."""
IMPORT = re.compile(rb"^\s*(?:from|import)\s+([A-Za-z_]\w*)", re.MULTILINE)


@dataclass(frozen=True)
class Snapshot:
    """A workspace read at submit, not yet written (`write`)."""

    source: str
    """The job as submitted (a file's absolute path, or a module's name)."""
    root: Path | None
    """The workspace (None: nothing to copy, an installed module)."""
    entry: str = ""
    """The job file, relative to `root` (empty for a module)."""
    paths: tuple[str, ...] = ()
    """Where the job imports from, relative to `root`: the job file's directory (a module's:
    the directory its package is found in), the directory it was submitted from and the
    PYTHONPATH entries, where they are in the workspace (a rank's sys.path holds its working
    directory and PYTHONPATH: their copies go first)."""
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    """Each file's permission bits (a script beside the job stays executable)."""
    commit: str = ""
    diff: bytes = b""
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return code_digest((name, hashlib.sha256(data).digest()) for name, data in self.files.items())

    @property
    def live(self) -> list[str]:
        """`paths` in the workspace itself (what a preflight of it imports from)."""
        return [str(self.root / p) for p in self.paths] if self.root else []

    def code(self, where: Path | None) -> Code:
        """Its record in spec.json, copied to `where` (None: not copied)."""
        return Code(source=self.source, dir=str(where) if where else "", digest=self.digest if where else "",
                    path=tuple(str((where / p).resolve()) for p in self.paths) if where else (),
                    files=len(self.files) if where else 0,
                    bytes=sum(map(len, self.files.values())) if where else 0, commit=self.commit,
                    diff_sha256=hashlib.sha256(self.diff).hexdigest() if self.diff else "",
                    versions=self.versions)


@dataclass(frozen=True)
class Ask:
    """A snapshot a request asks for (`cli.request`, which runs nothing): taken by its
    check, where git is asked."""

    source: str
    module: bool
    limit_mb: int
    skip: tuple[Path, ...] = ()

    def take(self) -> Snapshot:
        return take(self.source, module=self.module, limit_mb=self.limit_mb, skip=self.skip)


def take(source: str, *, module: bool, limit_mb: int, skip: tuple[Path, ...] = ()) -> Snapshot:
    """Read the workspace of `source` (a job or script file's absolute path, or a module's
    name), at most `limit_mb` MB of it; `skip`: directories never copied (the run's own)."""
    if module:
        top = source.split(".", 1)[0]
        if _installed(top):
            return Snapshot(source=source, root=None, versions=_versions({top}))
        base = _module_base(source, top)
    else:
        base = Path(source).parent
    commit = _git(base, "rev-parse", "HEAD").decode().strip()
    top_dir = _git(base, "rev-parse", "--show-toplevel").decode().strip()
    root = Path(top_dir) if commit and top_dir else base
    real, limit = root.resolve(), limit_mb * 2**20
    listed = _git_files(root) if commit else _walk(root, limit)
    skipped = tuple(p.resolve() for p in skip)
    code = [n for n in _without_runs(listed) if not cached(n)]  # (git lists unignored caches)
    files, modes = _read(root, code, skipped, limit_mb)
    entry = "" if module else Path(source).resolve().relative_to(real).as_posix()
    if entry and entry not in files:  # (a job file git ignores, or one in a skipped directory)
        files[entry], modes[entry] = Path(source).read_bytes(), Path(source).stat().st_mode & 0o777
    where = [base, Path.cwd(), *(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    paths = [w.resolve().relative_to(real).as_posix() for w in where if w.resolve().is_relative_to(real)]
    diff = _git(root, "diff", "HEAD", "--binary") if commit else b""
    return Snapshot(source=source, root=root, entry=entry, paths=tuple(dict.fromkeys(paths)), files=files,
                    modes=modes, commit=commit, diff=diff, versions=_versions(_imports(files)))


def write(snap: Snapshot, run_dir: Path, spec: RunSpec) -> None:
    """Copy `snap` into the run directory (once per digest: a sweep's tasks and a resume of
    unchanged code share nothing they need not), as private as the run directory (its
    group's where the run is shared), and point `spec` at the copy. A copy that fails (a
    full disk, a quota) leaves nothing half-written and is one line."""
    if snap.root is None:
        spec.code = snap.code(None)
        return
    into = RunPaths(run_dir).code / snap.digest[:16]
    try:
        if not into.is_dir():
            _copy(snap, into, run_dir.stat().st_mode & 0o2770)
        if snap.diff:
            into.with_suffix(".diff").write_bytes(snap.diff)
    except OSError as err:
        raise UserError(f"the copy of the job's code into {into.parent} failed ({err.strerror or err}); "
                        "free space in the run directory's file system, or submit with --code live") from None
    spec.code = snap.code(into.resolve())
    if snap.entry:
        job = str(into.resolve() / snap.entry)
        if spec.script is not None:
            spec.script = replace(spec.script, target=job)
        spec.job = job


def _copy(snap: Snapshot, into: Path, mode: int) -> None:
    if not into.parent.is_dir():
        # As private as the copies, not the umask's mode: a moved run takes a copy only in
        # a `code/` that no one else may write (`copies.is_copy`), and a umask of 0 made it 0777.
        into.parent.mkdir(exist_ok=True)
        os.chmod(into.parent, mode | 0o700)
    staging = Path(tempfile.mkdtemp(prefix=".code-", dir=into.parent))
    try:
        for name, data in snap.files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
            os.chmod(staging / name, snap.modes.get(name, 0o644) & (mode | 0o700) | 0o400)
        for folder in [staging, *(d for d in staging.rglob("*") if d.is_dir())]:
            os.chmod(folder, mode | 0o700)
        staging.rename(into)  # whole or not at all
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not into.is_dir():  # (another task's copy of the same digest may have won)
            raise


def _module_base(source: str, top: str) -> Path:
    """The directory the module's package is found in, searched as a rank searches: its
    working directory (this one) first, then this interpreter's path."""
    found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
    locations = list(found.submodule_search_locations or []) if found else []
    if found is None or not locations and not found.origin:
        raise UserError(f"module {source!r} is not importable from {os.getcwd()}; check its name, "
                        "the directory you submit from, or PYTHONPATH")
    return Path(locations[0] if locations else found.origin or "").parent


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _installed(top: str) -> bool:
    """`top` comes from an installed distribution (an editable install too)."""
    return top in _distributions() or top in sys.stdlib_module_names


def _versions(imported: set[str]) -> dict[str, str]:
    """Python's, torch's and hpcshard's versions, and those of the installed distributions
    `imported` names (top-level import names)."""
    dists = _distributions()
    names = {"torch", "hpcshard", *(d for top in imported for d in dists.get(top, []))}
    out = {"python": platform.python_version()}
    for name in sorted(names):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _imports(files: dict[str, bytes]) -> set[str]:
    """The top-level names the workspace's Python files import (a line's first name: read,
    not parsed)."""
    return {m.decode() for name, data in files.items() if name.endswith(".py") for m in IMPORT.findall(data)}


def _git(where: Path, *args: str) -> bytes:
    """git's output in `where` (empty: no git, not a repository, or it failed)."""
    try:
        proc = subprocess.run(["git", "-C", str(where), *args], capture_output=True, timeout=60,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return b""
    return proc.stdout if proc.returncode == 0 else b""


def _git_files(root: Path) -> list[str]:
    """The repository's tracked files (its submodules' too) and its untracked ones that git
    does not ignore. A repository whose files git does not list is refused: a copy of the job
    file alone would pass for the workspace."""
    tracked = _git(root, "ls-files", "-z", "--cached", "--recurse-submodules")
    if not tracked:
        raise UserError(f"git did not list the files of {root} (slow storage, or a git that fails "
                        "there); submit again, or with --code live")
    others = _git(root, "ls-files", "-z", "--others", "--exclude-standard")
    names = (tracked + b"\0" + others).decode(errors="surrogateescape").split("\0")
    return sorted({n for n in names if n})


def _walk(root: Path, limit: int) -> list[str]:
    """Every file under a workspace that is not a git repository, but caches, hidden files
    and directories, and run directories; the walk stops once the files pass `limit`
    bytes (`_read` then refuses)."""
    found, total = [], 0
    for folder, subdirs, names in os.walk(root):
        here = Path(folder)
        if here != root and RUN_FILES & set(names):
            subdirs[:] = []
            continue
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("."))
        for n in sorted(names):
            if not n.startswith("."):
                found.append((here / n).relative_to(root).as_posix())
                total += _size(here / n)
        if total > limit:
            break
    return found


def _without_runs(names: list[str]) -> list[str]:
    """`names` but those inside a run or sweep directory (one that holds a RUN_FILES file):
    a run directory inside the workspace (`runs/` not in .gitignore) is data, not code."""
    split = (n.rpartition("/") for n in names)
    runs = {folder + "/" for folder, _, last in split if folder and last in RUN_FILES}
    return [n for n in names if not any(n.startswith(r) for r in runs)]


def _size(path: Path) -> int:
    try:
        st = path.stat()
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _read(root: Path, names: list[str], skip: tuple[Path, ...],
          limit_mb: int) -> tuple[dict[str, bytes], dict[str, int]]:
    files: dict[str, bytes] = {}
    modes: dict[str, int] = {}
    names = [n for n in names if not any((root / n).resolve().is_relative_to(s) for s in skip)]
    sizes = {n: _size(root / n) for n in names}
    if sum(sizes.values()) > limit_mb * 2**20:  # (sized before anything is read)
        biggest = sorted(sizes, key=lambda n: -sizes[n])[:3]
        raise UserError(
            f"the job's workspace {root} holds more than code_max_mb={limit_mb} MB to copy (the "
            f"largest: {', '.join(biggest)}); ignore data in .gitignore, move the job into a "
            "directory of its own, raise code_max_mb, or run it uncopied with --code live")
    for name in names:
        path = root / name
        if not sizes[name] and not path.is_file():
            continue  # (a tracked file deleted since, a link to nowhere)
        try:
            files[name], modes[name] = path.read_bytes(), path.stat().st_mode & 0o777
        except OSError as err:
            raise UserError(f"the job's workspace file {path} cannot be read ({err.strerror}); fix its "
                            "permissions, ignore it in .gitignore, or submit with --code live") from None
    return files, modes
