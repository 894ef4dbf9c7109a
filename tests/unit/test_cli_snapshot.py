"""The code that was submitted is the code that runs (`cli.snapshot`): the job's workspace is
copied into the run directory when the run is scheduled, its spec names the job inside the
copy, and what the user edits afterwards changes nothing; git's commit and diff and the
package versions are recorded; installed code is not copied; too much is one line."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcshard import site
from hpcshard.cli import request, snapshot
from hpcshard.errors import UserError
from hpcshard.launch import backends
from hpcshard.rundir import status
from hpcshard.rundir.spec import Code, RunSpec, create_run_dir


def git(where: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(where), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository: a job that imports a helper module and finds a file beside itself,
    a package, ignored data, and an uncommitted change."""
    root = tmp_path / "repo"
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "train.py").write_text("import helper\nimport numpy\nfrom lib import util\n")
    (root / "jobs" / "helper.py").write_text("TAG = 'A'\n")
    (root / "lib").mkdir()
    (root / "lib" / "__init__.py").write_text("")
    (root / "lib" / "util.py").write_text("X = 1\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 4096)
    (root / ".gitignore").write_text("data/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "first")
    (root / "lib" / "util.py").write_text("X = 2\n")  # uncommitted
    (root / "notes.txt").write_text("untracked, not ignored\n")
    return root


def copied(job: Path, run: Path) -> tuple[RunSpec, snapshot.Snapshot]:
    """A run of `job` in `run` (made here) with its copy written, as `schedule` leaves it."""
    run.mkdir(parents=True)
    spec = RunSpec(job=str(job), sets={}, nodes=1, gpus=1, backend="local", name="r")
    snap = snapshot.take(str(job), module=False, limit_mb=10)
    snapshot.write(snap, run, spec)
    spec.write(run)
    return spec, snap


def test_a_git_workspace_is_copied_whole_with_its_commit_diff_and_versions(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo)
    job = repo / "jobs" / "train.py"
    snap = snapshot.take(str(job), module=False, limit_mb=10)
    assert sorted(snap.files) == [".gitignore", "jobs/helper.py", "jobs/train.py", "lib/__init__.py",
                                  "lib/util.py", "notes.txt"]  # not the ignored data
    assert snap.entry == "jobs/train.py" and snap.paths == ("jobs", ".")
    assert len(snap.commit) == 40 and b"X = 2" in snap.diff
    assert {"python", "torch", "hpcshard", "numpy"} <= set(snap.versions)

    run = tmp_path / "run"
    run.mkdir()
    spec = RunSpec(job=str(job), sets={}, nodes=1, gpus=1, backend="local", name="r")
    snapshot.write(snap, run, spec)
    copy = run / "code" / snap.digest[:16]
    assert spec.job == str(copy.resolve() / "jobs" / "train.py")
    assert spec.code is not None and spec.code.source == str(job) and spec.code.commit == snap.commit
    assert spec.code.path == (str((copy / "jobs").resolve()), str(copy.resolve()))
    assert spec.code.diff_sha256 == hashlib.sha256(snap.diff).hexdigest()
    assert (copy.with_suffix(".diff")).read_bytes() == snap.diff
    assert (copy / "lib" / "util.py").read_text() == "X = 2\n"  # the workspace as it is, changes and all

    (repo / "jobs" / "helper.py").write_text("TAG = 'B'\n")  # edited after submit
    spec.write(run)
    again = RunSpec.read(run)
    assert again.code == spec.code and Path(again.job).read_text() == job.read_text()
    assert (copy / "jobs" / "helper.py").read_text() == "TAG = 'A'\n"
    assert "git " + snap.commit[:12] + " with uncommitted changes" in spec.code.summary


def test_the_copy_is_what_a_rank_imports_first(repo: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run.mkdir()
    spec = RunSpec(job=str(repo / "jobs" / "train.py"), sets={}, nodes=1, gpus=1, backend="local", name="r")
    snapshot.write(snapshot.take(spec.job, module=False, limit_mb=10), run, spec)
    (repo / "jobs" / "helper.py").write_text("TAG = 'B'\n")
    monkeypatch.chdir(repo)  # the rank's working directory (on its sys.path) is the live one
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    monkeypatch.delitem(sys.modules, "helper", raising=False)
    assert spec.code is not None
    spec.code.use()
    spec.code.use()  # (once on the path, however often)
    assert sys.path[:len(spec.code.path)] == list(spec.code.path) and sys.path.count(spec.code.path[0]) == 1
    import helper  # type: ignore[import-not-found]

    assert helper.TAG == "A"
    monkeypatch.delitem(sys.modules, "helper")


def test_outside_git_the_jobs_directory_is_copied_without_caches_or_runs(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "__pycache__").mkdir(parents=True)
    (work / "__pycache__" / "x.pyc").write_bytes(b"x")
    (work / ".hidden").mkdir()
    (work / ".hidden" / "h.py").write_text("")
    (work / "runs" / "old").mkdir(parents=True)
    (work / "runs" / "old" / "spec.json").write_text("{}")
    (work / "runs" / "old" / "ckpt.bin").write_bytes(b"\0" * 100)
    (work / "job.py").write_text("")
    (work / "conf.yaml").write_text("a: 1\n")
    snap = snapshot.take(str(work / "job.py"), module=False, limit_mb=1)
    assert sorted(snap.files) == ["conf.yaml", "job.py"] and snap.commit == "" and snap.diff == b""


def test_too_much_to_copy_is_one_line_naming_the_largest_files(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text("")
    (work / "weights.bin").write_bytes(b"\0" * (2 * 2**20))
    with pytest.raises(UserError, match=r"more than code_max_mb=1 MB .*weights\.bin.*--code live"):
        snapshot.take(str(work / "job.py"), module=False, limit_mb=1)


def test_an_installed_module_is_not_copied_but_its_version_is_recorded(tmp_path: Path) -> None:
    snap = snapshot.take("hpcshard.jobs_that_need_not_exist", module=True, limit_mb=1)
    assert snap.root is None and snap.files == {} and "hpcshard" in snap.versions
    spec = RunSpec(job="hpcshard.x", sets={}, nodes=1, gpus=1, backend="local", name="r")
    snapshot.write(snap, tmp_path, spec)
    assert spec.job == "hpcshard.x" and spec.code is not None and spec.code.dir == "" and spec.code.path == ()
    assert not (tmp_path / "code").exists()


def test_a_local_package_module_is_copied_with_its_import_root(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    (src / "mypkg" / "jobs").mkdir(parents=True)
    (src / "mypkg" / "__init__.py").write_text("")
    (src / "mypkg" / "jobs" / "__init__.py").write_text("")
    (src / "mypkg" / "jobs" / "lm.py").write_text("")
    monkeypatch.syspath_prepend(str(src))
    snap = snapshot.take("mypkg.jobs.lm", module=True, limit_mb=1)
    assert snap.root == src and snap.entry == "" and snap.paths[0] == "."
    assert "mypkg/jobs/lm.py" in snap.files
    spec = RunSpec(job="mypkg.jobs.lm", sets={}, nodes=1, gpus=1, backend="local", name="r")
    (tmp_path / "run").mkdir()
    snapshot.write(snap, tmp_path / "run", spec)
    assert spec.job == "mypkg.jobs.lm"  # imported by name, from the copy first on sys.path
    assert spec.code is not None and Path(spec.code.path[0], "mypkg", "jobs", "lm.py").is_file()


def resolved(**cli: Any) -> site.Resolved:
    return site.resolve(site.load(), None, cli)


def test_a_request_asks_for_a_snapshot_its_check_takes_and_its_schedule_writes(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = str(repo / "jobs" / "train.py")
    live = request.new(resolved(code="live"), job, nodes=1, backend=backends.LOCAL, run_dir=tmp_path / "l")
    assert live.ask is None
    req = request.new(resolved(), job, nodes=1, backend=backends.LOCAL, run_dir=tmp_path / "r")
    assert req.ask == snapshot.Ask(job, False, 100, skip=(tmp_path / "r",)) and req.code is None
    monkeypatch.setattr(request, "preflight", lambda spec: {"config": {"steps": 3}})
    request.check([req])
    assert req.code is not None and req.code.entry == "jobs/train.py"


def test_resume_keeps_the_runs_copy_or_takes_the_current_code(repo: Path, tmp_path: Path) -> None:
    job, run = repo / "jobs" / "train.py", tmp_path / "run"
    spec, first = copied(job, run)
    kept = request.again(RunSpec.read(run), run)
    assert kept.ask is None and kept.spec.code == spec.code
    (repo / "jobs" / "helper.py").write_text("TAG = 'B'\n")
    now = request.again(RunSpec.read(run), run, code="current")
    assert now.ask == snapshot.Ask(str(job), False, 100, skip=(run,))
    second = now.ask.take()
    snapshot.write(second, run, now.spec)
    assert second.digest != first.digest and now.spec.code is not None
    assert Path(now.spec.job).parent.joinpath("helper.py").read_text() == "TAG = 'B'\n"
    assert (run / "code" / first.digest[:16] / "jobs" / "helper.py").read_text() == "TAG = 'A'\n"

    job.unlink()  # the source is gone: its copy still runs, a new copy cannot be taken
    with pytest.raises(UserError, match="--code current: the run's source .* is gone"):
        request.again(RunSpec.read(run), run, code="current")


def test_a_spec_without_code_is_one_from_before_snapshots(tmp_path: Path) -> None:
    spec = RunSpec(job="charlm", sets={}, nodes=1, gpus=1, backend="local", name="r")
    spec.write(tmp_path)
    assert "code" not in (tmp_path / "spec.json").read_text() and RunSpec.read(tmp_path).code is None
    assert Code.of({}) is None


def test_runs_inside_the_workspace_are_never_copied(repo: Path, tmp_path: Path) -> None:
    """`runs/` at the repository's root and not in .gitignore (storage_root's default): the
    earlier runs' checkpoints, logs and copies are data, not code."""
    old = repo / "runs" / "train-0"
    (old / "checkpoints").mkdir(parents=True)
    (old / "spec.json").write_text("{}")
    (old / "checkpoints" / "x.distcp").write_bytes(b"\0" * 4096)
    (repo / "sweeps" / "s").mkdir(parents=True)
    (repo / "sweeps" / "s" / "sweep.json").write_text("{}")
    snap = snapshot.take(str(repo / "jobs" / "train.py"), module=False, limit_mb=10)
    assert not [n for n in snap.files if n.startswith(("runs/", "sweeps/"))]


def test_a_module_is_found_from_the_directory_submitted_from(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed console script's sys.path does not hold the working directory; the
    ranks' does (torchrun -m in it): the module is looked up as they look it up."""
    (tmp_path / "mypkg2").mkdir()
    (tmp_path / "mypkg2" / "__init__.py").write_text("")
    (tmp_path / "mypkg2" / "lm.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    snap = snapshot.take("mypkg2.lm", module=True, limit_mb=1)
    assert snap.root == tmp_path and "mypkg2/lm.py" in snap.files
    with pytest.raises(UserError, match="module 'nothere.lm' is not importable from"):
        snapshot.take("nothere.lm", module=True, limit_mb=1)


def test_pythonpath_entries_in_the_workspace_are_imported_from_the_copy(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (repo / "src" / "mylib").mkdir(parents=True)
    (repo / "src" / "mylib" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{repo / 'src'}{os.pathsep}/elsewhere")
    snap = snapshot.take(str(repo / "jobs" / "train.py"), module=False, limit_mb=10)
    assert "src" in snap.paths and "src/mylib/__init__.py" in snap.files


def test_the_copy_keeps_modes_and_the_run_directorys_privacy(tmp_path: Path) -> None:
    work, run = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    (work / "job.py").write_text("")
    (work / "prep.sh").write_text("#!/bin/sh\n")
    (work / "prep.sh").chmod(0o755)
    run.mkdir(mode=0o700)
    run.chmod(0o700)
    spec = RunSpec(job=str(work / "job.py"), sets={}, nodes=1, gpus=1, backend="local", name="r")
    snapshot.write(snapshot.take(str(work / "job.py"), module=False, limit_mb=1), run, spec)
    assert spec.code is not None
    copy = Path(spec.code.dir)
    assert (copy / "prep.sh").stat().st_mode & 0o777 == 0o700  # executable, and private as the run
    assert copy.stat().st_mode & 0o777 == 0o700


def test_hidden_files_outside_git_stay_home(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("")
    (tmp_path / ".env").write_text("WANDB_API_KEY=secret\n")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai password secret\n")
    assert sorted(snapshot.take(str(tmp_path / "job.py"), module=False, limit_mb=1).files) == ["job.py"]


def test_a_copy_that_fails_on_a_full_disk_is_one_line_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, run = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    run.mkdir()
    (work / "job.py").write_text("")
    snap = snapshot.take(str(work / "job.py"), module=False, limit_mb=1)

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", full)
    spec = RunSpec(job=str(work / "job.py"), sets={}, nodes=1, gpus=1, backend="local", name="r")
    with pytest.raises(UserError, match="copy of the job's code .* failed .No space left on device"):
        snapshot.write(snap, run, spec)
    assert list((run / "code").iterdir()) == [] and spec.code is None


def test_a_moved_run_directory_finds_its_copy(repo: Path, tmp_path: Path) -> None:
    run = tmp_path / "a" / "run"
    copied(repo / "jobs" / "train.py", run)
    moved = tmp_path / "b"
    run.parent.rename(moved)
    again = RunSpec.read(moved / "run")
    assert again.code is not None and Path(again.job).is_file()
    assert again.job.startswith(str((moved / "run" / "code").resolve()))
    assert all(p.startswith(str(moved.resolve())) for p in again.code.path)


def in_the_parent(repo: Path, tmp_path: Path) -> tuple[Path, Path, RunSpec]:
    """A run whose copy of the code is its parent's `code/NAME`, as a sweep's task's is, and
    which was then moved: (the run as it is now, its copy, its spec as written)."""
    run = tmp_path / "a" / "run"
    spec, _ = copied(repo / "jobs" / "train.py", run)
    assert spec.code is not None
    copy = Path(spec.code.dir)
    (run.parent / "code").mkdir()
    copy.rename(run.parent / "code" / copy.name)
    (tmp_path / "a").rename(tmp_path / "b")
    return tmp_path / "b" / "run", tmp_path / "b" / "code" / copy.name, spec


def test_a_moved_sweeps_task_finds_its_copy_in_the_sweep_though_python_wrote_beside_it(
        repo: Path, tmp_path: Path) -> None:
    run, copy, _ = in_the_parent(repo, tmp_path)
    (copy / "jobs" / "__pycache__").mkdir()
    (copy / "jobs" / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"compiled")  # a rank's import
    copy.parent.chmod(0o775)  # (`code/` as a umask of 002 makes it, in a private sweep)
    again = RunSpec.read(run)
    assert again.code is not None and again.job == str(copy.resolve() / "jobs" / "train.py")


def test_a_moved_run_finds_its_copy_though_its_workspace_left_pythons_caches_unignored(
        repo: Path, tmp_path: Path) -> None:
    """A git workspace whose .gitignore does not name `__pycache__` (the job was run by
    hand once) listed its caches among the untracked files git does not ignore: the copy
    held them and its digest counted them, while the check of a moved copy leaves
    `__pycache__` out (a rank's import rewrites it there): the run's own copy was refused."""
    (repo / "jobs" / "__pycache__").mkdir()
    (repo / "jobs" / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"compiled at home")
    run = tmp_path / "a" / "run"
    spec, snap = copied(repo / "jobs" / "train.py", run)
    assert not any("__pycache__" in name for name in snap.files)  # caches are no code
    assert spec.code is not None
    copy = Path(spec.code.dir)
    (copy / "jobs" / "__pycache__").mkdir(exist_ok=True)
    (copy / "jobs" / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"compiled by a rank")
    (tmp_path / "a").rename(tmp_path / "b")
    again = RunSpec.read(tmp_path / "b" / "run")
    assert again.job == str((tmp_path / "b" / "run" / "code" / copy.name).resolve() / "jobs" / "train.py")


def test_a_run_submitted_under_a_umask_of_0_finds_its_copy_once_moved(repo: Path, tmp_path: Path) -> None:
    """`code/` was made with the umask's mode: 0777 under a umask of 0 (GitLab's docker
    executor runs job scripts so), and a moved run refuses a copy in a folder everyone
    may write (`copies.is_copy`): its own copy. It is made as private as the copy now."""
    run = tmp_path / "a" / "run"
    old = os.umask(0)
    try:
        create_run_dir(run)  # (0700 whatever the umask)
        job = str(repo / "jobs" / "train.py")
        spec = RunSpec(job=job, sets={}, nodes=1, gpus=1, backend="local", name="r")
        snapshot.write(snapshot.take(job, module=False, limit_mb=10), run, spec)
        spec.write(run)
    finally:
        os.umask(old)
    assert spec.code is not None
    copy = Path(spec.code.dir)
    assert not copy.parent.stat().st_mode & 0o002
    (tmp_path / "a").rename(tmp_path / "b")
    again = RunSpec.read(tmp_path / "b" / "run")
    assert again.job == str((tmp_path / "b" / "run" / "code" / copy.name).resolve() / "jobs" / "train.py")


def test_a_file_name_that_is_not_utf8_is_copied_and_found_again(repo: Path, tmp_path: Path) -> None:
    """Linux names are bytes: git lists one that is not UTF-8 (`café` in Latin-1) and the
    snapshot holds it (decoded with surrogateescape), but the digest encoded it strictly:
    the submit failed with a UnicodeEncodeError traceback, and a moved run's check of its
    copy with it (every command that reads the spec)."""
    (repo / os.fsdecode(b"caf\xe9.txt")).write_text("latin-1\n")
    run = tmp_path / "a" / "run"
    spec, _ = copied(repo / "jobs" / "train.py", run)
    assert spec.code is not None
    copy = Path(spec.code.dir)
    (tmp_path / "a").rename(tmp_path / "b")
    again = RunSpec.read(tmp_path / "b" / "run")
    assert again.job == str((tmp_path / "b" / "run" / "code" / copy.name).resolve() / "jobs" / "train.py")


def _edited(copy: Path) -> None:
    (copy / "jobs" / "helper.py").write_text("TAG = 'B'\n")


def _cut_short(copy: Path) -> None:
    (copy / "lib" / "util.py").unlink()


def _one_more(copy: Path) -> None:
    (copy / "lib" / "sitecustomize.py").write_text("import os\n")


def _linked(copy: Path) -> None:
    (copy / "jobs" / "helper.py").unlink()
    (copy / "jobs" / "helper.py").symlink_to(copy.parent.parent / "elsewhere.py")
    (copy.parent.parent / "elsewhere.py").write_text("TAG = 'A'\n")


def _writable_by_others(copy: Path) -> None:
    copy.parent.chmod(0o777)  # (anyone may swap the copy once it was checked)


def _another_users(copy: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(copy, 65534, 65534)


def _in_another_users_folder(copy: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(copy.parent, 65534, 65534)  # (they may rename it away and put theirs there)


NOT_THE_COPY = "its files are not the copy submitted (edited, cut short, added to or linked since)"
NOT_YOURS = "it is not yours (or the run group's) alone to write (drw"
NOT_YOUR_FOLDER = "the folder holding it is not yours, or everyone may write it (drw"


@pytest.mark.parametrize("other, why", [(_edited, NOT_THE_COPY), (_cut_short, NOT_THE_COPY),
                                        (_one_more, NOT_THE_COPY), (_linked, NOT_THE_COPY),
                                        (_writable_by_others, NOT_YOUR_FOLDER), (_another_users, NOT_YOURS),
                                        (_in_another_users_folder, NOT_YOUR_FOLDER)])
def test_a_moved_run_imports_no_other_code_under_its_copys_name_and_says_why(
        repo: Path, tmp_path: Path, other: Callable[[Path], None], why: str) -> None:
    """The copy's folder is named by the first 16 digits of its digest, and a sweep's task
    looks for it in its parent's `code/`: a folder of that name that is not the copy (edited
    since, cut short, another user's or one others may rewrite) was imported in its place.
    Now the spec keeps the copy's old path, and a rank (or `resume`'s preflight) says why
    in one line and how to take a new copy, not "job file ... does not exist; give a .py
    file or a module name" on the old path."""
    run, copy, spec = in_the_parent(repo, tmp_path)
    other(copy)
    again = RunSpec.read(run)
    assert again.job == spec.job and again.code == spec.code  # where it was: not there
    assert not Path(again.job).exists()
    assert spec.code is not None
    said = (f"the run's copy of its code is no longer at {spec.code.dir} (its run directory moved?), and "
            f"{copy} was refused: {why}")
    assert again.code_lost.startswith(said), again.code_lost
    assert again.code_lost.endswith(f"; `hpcshard resume {run} --code current` takes a new copy")
    assert "\n" not in again.code_lost
    with pytest.raises(UserError) as raised:
        again.use_code()  # (a rank's, `ckpt export`'s, an evaluation's: before the job is imported)
    assert str(raised.value) == again.code_lost


def test_resume_says_why_the_copy_was_refused_and_takes_a_new_one_when_asked(
        repo: Path, tmp_path: Path) -> None:
    """`resume` (the run's copy) stops at the refused copy with the ranks' line, before its
    preflight fails on the copy's old path; `--code current` copies the source again."""
    run, copy, _ = in_the_parent(repo, tmp_path)
    _edited(copy)
    with pytest.raises(UserError, match=r"^the run's copy of its code is no longer at .* was refused: its "
                       r"files are not the copy submitted .*--code current` takes a new copy$"):
        request.again(RunSpec.read(run), run)
    fresh = request.again(RunSpec.read(run), run, code="current")
    assert fresh.ask is not None and fresh.ask.source == str(repo / "jobs" / "train.py")


def test_a_moved_run_whose_copy_is_nowhere_says_so(repo: Path, tmp_path: Path) -> None:
    run = tmp_path / "a" / "run"
    spec, _ = copied(repo / "jobs" / "train.py", run)
    assert spec.code is not None
    (run / "code").rename(tmp_path / "elsewhere")
    again = RunSpec.read(run)
    assert again.code_lost == (f"the run's copy of its code is no longer at {spec.code.dir} (its run "
                               "directory moved?), and neither its code/ nor its sweep's holds it; "
                               f"`hpcshard resume {run} --code current` takes a new copy")
    assert f"code: {again.code_lost}" in status.report(run, again, None)


def test_a_split_sweeps_task_read_through_its_arrays_link_finds_the_sweeps_copy(
        repo: Path, tmp_path: Path) -> None:
    """A sweep split over several arrays reads its later arrays' tasks through links
    (SWEEP/.array-K/task-I -> ../task-I): the run directory's parent is `.array-K`, which
    holds no `code/`, and such a task of a moved sweep never found its copy."""
    run, copy, _ = in_the_parent(repo, tmp_path)
    (run.parent / ".array-1").mkdir()
    (run.parent / ".array-1" / "task-0").symlink_to(os.path.join("..", run.name))
    again = RunSpec.read(run.parent / ".array-1" / "task-0")
    assert again.job == str(copy.resolve() / "jobs" / "train.py") and not again.code_lost


def test_resume_with_live_code_imports_the_source_again(repo: Path, tmp_path: Path) -> None:
    job, run = repo / "jobs" / "train.py", tmp_path / "run"
    copied(job, run)
    live = request.again(RunSpec.read(run), run, code="live")
    assert live.spec.job == str(job) and live.spec.code is None and live.ask is None


def test_the_preflight_checks_the_workspace_the_snapshot_was_taken_of(repo: Path, tmp_path: Path) -> None:
    job = repo / "jobs" / "train.py"
    spec, _ = copied(job, tmp_path / "run")
    current = snapshot.take(str(job), module=False, limit_mb=10)
    assert request._code(spec, current) == {"job": str(job), "path": current.live}
    assert request._code(spec, None) == {"job": spec.job, "path": list(spec.code.path)}  # type: ignore[union-attr]
    assert current.live[0] == str(repo / "jobs")
