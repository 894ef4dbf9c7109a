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

import ast
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpcshard.errors import UserError
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.spec import Code, RunSpec

SKIP_DIRS = {".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".venv", "venv",
             "node_modules", ".tox"}
"""Directories never copied from a workspace outside git (inside git, .gitignore decides)."""


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
    the directory its package is found in) and the directory it was submitted from, when
    that is in the workspace (a rank's sys.path holds its working directory)."""
    files: dict[str, bytes] = field(default_factory=dict)
    commit: str = ""
    diff: bytes = b""
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()

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
        found = importlib.util.find_spec(top)  # (a top-level name: nothing is imported)
        if found is None or found.origin is None and not found.submodule_search_locations:
            raise UserError(f"module {source!r} is not importable here; check its name or PYTHONPATH")
        where = Path(next(iter(found.submodule_search_locations or [])) if found.submodule_search_locations
                     else found.origin or "")
        base = where.parent
    else:
        base = Path(source).parent
    commit = _git(base, "rev-parse", "HEAD").decode().strip()
    top_dir = _git(base, "rev-parse", "--show-toplevel").decode().strip()
    root = Path(top_dir) if commit and top_dir else base
    names = _git_files(root) if commit else _walk(root)
    skipped = tuple(p.resolve() for p in skip)
    files = _read(root, names, skipped, limit_mb)
    real = root.resolve()
    entry = "" if module else Path(source).resolve().relative_to(real).as_posix()
    if entry and entry not in files:  # (a job file git ignores, or one in a skipped directory)
        files[entry] = Path(source).read_bytes()
    paths = [base.resolve().relative_to(real).as_posix()]
    if Path.cwd().resolve().is_relative_to(real):
        paths.append(Path.cwd().resolve().relative_to(real).as_posix())
    return Snapshot(source=source, root=root, entry=entry, paths=tuple(dict.fromkeys(paths)), files=files,
                    commit=commit,
                    diff=_git(root, "diff", "HEAD", "--binary") if commit else b"",
                    versions=_versions(_imports(files)))


def write(snap: Snapshot, run_dir: Path, spec: RunSpec) -> None:
    """Copy `snap` into the run directory (once per digest: a sweep's tasks and a resume of
    unchanged code share nothing they need not) and point `spec` at the copy."""
    if snap.root is None:
        spec.code = snap.code(None)
        return
    into = RunPaths(run_dir).code / snap.digest[:16]
    if not into.is_dir():
        into.parent.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".code-", dir=into.parent))
        for name, data in snap.files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        try:
            staging.rename(into)  # whole or not at all
        except OSError:  # another task's copy of the same digest won
            shutil.rmtree(staging, ignore_errors=True)
    if snap.diff:
        into.with_suffix(".diff").write_bytes(snap.diff)
    spec.code = snap.code(into.resolve())
    if snap.entry:
        job = str(into.resolve() / snap.entry)
        if spec.script is not None:
            spec.script = replace(spec.script, target=job)
        spec.job = job


def _installed(top: str) -> bool:
    """`top` comes from an installed distribution (an editable install too)."""
    return top in importlib.metadata.packages_distributions() or top in sys.stdlib_module_names


def _versions(imported: set[str]) -> dict[str, str]:
    """Python's, torch's and hpcshard's versions, and those of the installed distributions
    `imported` names (top-level import names)."""
    dists = importlib.metadata.packages_distributions()
    names = {"torch", "hpcshard", *(d for top in imported for d in dists.get(top, []))}
    out = {"python": platform.python_version()}
    for name in sorted(names):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _imports(files: dict[str, bytes]) -> set[str]:
    """The top-level names the workspace's Python files import (absolute imports)."""
    names: set[str] = set()
    for name, data in files.items():
        if not name.endswith(".py"):
            continue
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _git(where: Path, *args: str) -> bytes:
    """git's output in `where` (empty: no git, not a repository, or it failed)."""
    try:
        proc = subprocess.run(["git", "-C", str(where), *args], capture_output=True, timeout=30,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return b""
    return proc.stdout if proc.returncode == 0 else b""


def _git_files(root: Path) -> list[str]:
    """The repository's tracked files and its untracked ones that git does not ignore."""
    out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return sorted({n for n in out.decode(errors="surrogateescape").split("\0") if n})


def _walk(root: Path) -> list[str]:
    """Every file under a workspace that is not a git repository, but caches, hidden
    directories and run directories (they hold spec.json or sweep.json)."""
    found = []
    for folder, subdirs, names in os.walk(root):
        here = Path(folder)
        if here != root and ({"spec.json", "sweep.json"} & set(names)):
            subdirs[:] = []
            continue
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("."))
        found += [(here / n).relative_to(root).as_posix() for n in sorted(names)]
    return found


def _read(root: Path, names: list[str], skip: tuple[Path, ...], limit_mb: int) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    total = 0
    for name in names:
        path = root / name
        if not path.is_file() or any(path.resolve().is_relative_to(s) for s in skip):
            continue  # (a tracked file deleted since, a link to nowhere, the run's own files)
        data = path.read_bytes()
        files[name] = data
        total += len(data)
        if total > limit_mb * 2**20:
            biggest = sorted(files, key=lambda n: -len(files[n]))[:3]
            raise UserError(
                f"the job's workspace {root} holds more than code_max_mb={limit_mb} MB to copy (the "
                f"largest: {', '.join(biggest)}); ignore data in .gitignore, move the job into a "
                "directory of its own, raise code_max_mb, or run it uncopied with --code live")
    return files
