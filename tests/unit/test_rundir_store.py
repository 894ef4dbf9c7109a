"""The checkpoint store's rules, on directories laid out as the runtime writes them."""

from __future__ import annotations

import grp
import json
import os
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.rundir import files, launchers, store
from hpcshard.rundir.spec import RunSpec, check_run_dir, create_run_dir, trusted_gid


def make(root: Path, step: int, *, commit: bool = True, files: dict[str, int] | None = None) -> Path:
    files = files or {".metadata": 10, "__0_0.distcp": 100, "__1_0.distcp": 100}
    name = store.step_name(step) + ("" if commit else store.TMP_SUFFIX)
    path = root / name
    path.mkdir(parents=True, mode=0o750)
    for fname, size in files.items():
        (path / fname).write_bytes(b"x" * size)
        (path / fname).chmod(0o640)
    if commit:
        manifest = {"step": step, "world": 4, "mesh": [2, 2], "files": files,
                    "bytes": sum(files.values()), "time": 0, "reason": "periodic"}
        (path / store.MANIFEST).write_text(json.dumps(manifest))
    return path


SPEC = {"job": "x.py", "sets": {}, "nodes": 1, "gpus": 1, "backend": "local", "name": "x"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """RUN_DIR/checkpoints of a run (its spec.json: commands that take a run check it)."""
    r = tmp_path / "run" / store.CHECKPOINTS
    r.mkdir(parents=True, mode=0o750)
    (tmp_path / "run").chmod(0o750)
    (tmp_path / "run" / "spec.json").write_text(json.dumps(SPEC))
    return r


def test_auto_takes_the_newest_committed(root: Path) -> None:
    for s in (10, 20, 30):
        make(root, s)
    make(root, 40, commit=False)
    chosen, skipped = store.select(root, "auto")
    assert chosen is not None and chosen.step == 30
    assert [(c.step, c.problem.split(" ")[0]) for c in skipped] == [(40, "incomplete")]


@pytest.mark.parametrize("damage,reason", [
    (lambda p: (p / "__1_0.distcp").write_bytes(b"x" * 7), "size differs from the manifest"),
    (lambda p: (p / "__0_0.distcp").unlink(), "missing files: __0_0.distcp"),
    (lambda p: (p / store.MANIFEST).unlink(), "incomplete (no manifest)"),
    (lambda p: (p / store.MANIFEST).write_text("{not json"), "corrupt manifest"),
])
def test_a_damaged_newest_falls_back_to_the_previous(root: Path, damage, reason: str) -> None:
    make(root, 10)
    damage(make(root, 20))
    chosen, skipped = store.select(root, "auto")
    assert chosen is not None and chosen.step == 10
    assert skipped[0].step == 20 and reason in skipped[0].problem


def test_resume_step_and_path(root: Path) -> None:
    make(root, 10)
    p20 = make(root, 20)
    assert store.select(root, "10")[0].step == 10  # type: ignore[union-attr]
    assert store.select(root, str(p20))[0].step == 20  # type: ignore[union-attr]
    assert store.select(root, "never") == (None, [])
    with pytest.raises(ValueError, match="no committed checkpoint at step 15.*committed steps: 10, 20"):
        store.select(root, "15")
    with pytest.raises(ValueError, match="is not a usable checkpoint"):
        store.select(root, str(root / "elsewhere"))


def test_retention_keeps_last_k_and_multiples(root: Path) -> None:
    for s in range(10, 70, 10):
        make(root, s)
    gone = store.retire(root, keep_last=2, keep_every=20)
    assert sorted(p.name for p in gone) == [store.step_name(s) for s in (10, 30)]
    assert [c.step for c in store.committed(root)] == [20, 40, 50, 60]
    store.retire(root, keep_last=0)  # the newest committed one is never deleted
    assert [c.step for c in store.committed(root)] == [60]
    # Retired at once (renamed to *.tmp, which nothing loads), deleted beside training.
    deadline = time.monotonic() + 10
    while sorted(p.name for p in root.iterdir()) != [store.step_name(60)]:
        assert time.monotonic() < deadline, sorted(p.name for p in root.iterdir())
        time.sleep(0.01)


def test_retention_never_counts_incomplete_ones(root: Path) -> None:
    make(root, 10)
    make(root, 20, commit=False)
    store.retire(root, keep_last=1)
    assert [c.step for c in store.committed(root)] == [10]


SHARDS = {"__0_0.distcp": 100, "__1_0.distcp": 100}
"""What DCP's .metadata of `make`'s checkpoints says was written: file -> fewest bytes."""


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    (lambda p: (p / "__1_0.distcp").write_bytes(b"x" * 60), "__1_0.distcp has 60 of the 100 bytes DCP wrote"),
    (lambda p: (p / store.METADATA).unlink(), ".metadata is missing"),
])
def test_a_save_missing_a_file_its_metadata_names_is_not_committed(root: Path, damage, reason: str) -> None:
    """A second job's start removes every step-N.tmp: what is left of a save must not
    become a checkpoint, and retention must not make room for it (keep_last=1)."""
    make(root, 10)
    store.write_atomic(root / store.LATEST, store.step_name(10) + "\n")
    tmp = make(root, 20, commit=False)
    damage(tmp)
    with pytest.raises(store.Incomplete, match=reason):
        store.commit(tmp, 20, {}, keep_last=1, least=SHARDS)
    assert [c.step for c in store.committed(root)] == [10]
    assert not (root / store.step_name(20)).exists() and not (tmp / store.MANIFEST).exists()
    assert (root / store.LATEST).read_text() == store.step_name(10) + "\n"


def test_the_manifest_lists_the_files_dcp_wrote_and_their_sizes(root: Path) -> None:
    tmp = make(root, 20, commit=False, files={".metadata": 10, "__0_0.distcp": 130, "__1_0.distcp": 100,
                                             "stray": 5})
    final, manifest, _ = store.commit(tmp, 20, {}, keep_last=1, least=SHARDS)
    assert manifest["files"] == {".metadata": 10, "__0_0.distcp": 130, "__1_0.distcp": 100}
    assert manifest["bytes"] == 240 and store.inspect(final).committed
    (final / "__1_0.distcp").unlink()  # gone after the commit: never loaded, never counted
    assert store.inspect(final).problem == "missing files: __1_0.distcp"


def test_retention_keeps_the_newest_loadable_checkpoint(root: Path) -> None:
    make(root, 10)
    (make(root, 20) / "__0_0.distcp").unlink()  # committed, then a file went missing
    assert store.retire(root, keep_last=1) == []
    assert [c.step for c in store.committed(root)] == [10]


def test_a_checkpoint_the_file_system_cannot_read_is_not_skipped(root: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """ESTALE on NFS says nothing about the checkpoint: skipping it would get it renamed
    .corrupt once the older one loads."""
    make(root, 10)
    make(root, 20)
    real = Path.read_text

    def stale(self: Path, *args, **kwargs) -> str:
        if self.parent.name == store.step_name(20):
            raise OSError(116, "Stale file handle")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", stale)
    with pytest.raises(store.Unreadable, match="step-00000020 is unreadable.*Stale file handle"):
        store.select(root, "auto")
    assert store.inspect(root / store.step_name(20)).unreadable
    assert store.retire(root, keep_last=1) == []  # an unreadable one does not count, nor go


def test_retired_checkpoints_are_deleted_before_the_process_leaves(root: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank leaves by os._exit, which kills the deleting thread: it waits for it first."""
    import shutil

    real = shutil.rmtree

    def slow(path, *args, **kwargs) -> None:
        time.sleep(0.5)
        real(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", slow)
    for s in (10, 20, 30):
        make(root, s)
    store.retire(root, keep_last=1)
    assert store.wait_retired(0.05) == [root / (store.step_name(s) + store.DELETING) for s in (10, 20)]
    assert store.wait_retired(5) == []
    assert [p.name for p in root.iterdir()] == [store.step_name(30)]


def test_incomplete_directories_are_cleaned(root: Path) -> None:
    make(root, 10)
    make(root, 20, commit=False)
    assert store.clean_incomplete(root) == [store.step_name(20) + store.TMP_SUFFIX]
    assert [p.name for p in root.iterdir()] == [store.step_name(10)]


def test_a_write_probe_a_killed_rank_left_is_removed_at_the_next_start(root: Path) -> None:
    """The probe after a failed save (`guard.probe`) is removed at once; a rank killed
    between its write and its removal leaves it, 1 MiB, hidden: the next start removes it."""
    make(root, 10)
    left = files.side_name(root / store.PROBE)
    left.write_bytes(b"x" * 64)
    assert store.clean_incomplete(root) == []  # (not a checkpoint: not named)
    assert [p.name for p in root.iterdir()] == [store.step_name(10)]


def test_checkpoints_others_can_write_are_refused(root: Path) -> None:
    path = make(root, 10)
    store.check_safe(store.inspect(path))
    (path / "__0_0.distcp").chmod(0o666)
    with pytest.raises(ValueError, match=r"__0_0.distcp is writable by others.*chmod go-w"):
        store.check_safe(store.inspect(path))
    (path / "__0_0.distcp").chmod(0o640)
    path.chmod(0o770)
    with pytest.raises(ValueError, match="writable by its group"):
        store.check_safe(store.inspect(path))


def test_write_atomic_replaces(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    store.write_atomic(target, "a")
    store.write_atomic(target, "b")
    assert target.read_text() == "b" and os.listdir(tmp_path) == ["latest"]


def test_cli_resume_unknown_step_lists_the_steps(root: Path) -> None:
    run = root.parent
    (run / "spec.json").write_text(json.dumps({"job": "x.py", "sets": {}, "nodes": 1, "gpus": 1,
                                               "backend": "local", "name": "x"}))
    make(root, 10)
    make(root, 20)
    result = CliRunner().invoke(main, ["resume", str(run), "--resume", "7"])
    assert result.exit_code == 2
    assert "no committed checkpoint at step 7" in result.output and "10, 20" in result.output


def test_cli_ckpt_list(root: Path) -> None:
    make(root, 10)
    make(root, 20, commit=False)
    result = CliRunner().invoke(main, ["ckpt", "list", str(root.parent)])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert "committed" in lines[1] and "0.0MB" in lines[1] and "[2, 2]" in lines[1]
    assert "invalid" in lines[2] and "incomplete" in lines[2]


def test_cli_ckpt_list_shows_what_deletions_and_quarantines_left(root: Path) -> None:
    """A deletion cut short (the rank's exit) leaves step-N.deleting.tmp: it takes room
    and must not be invisible."""
    make(root, 10)
    (root / "step-00000010").rename(root / ("step-00000010" + store.DELETING))
    make(root, 20, files={".metadata": 10, "__0_0.distcp": 2_000_000})
    (root / "step-00000020").rename(root / ("step-00000020" + store.CORRUPT))
    make(root, 30)
    lines = CliRunner().invoke(main, ["ckpt", "list", str(root.parent)]).output.splitlines()
    assert "deleting" in lines[1] and "step-00000010.deleting.tmp" in lines[1] and "next start" in lines[1]
    assert "corrupt" in lines[2] and "2.0MB" in lines[2] and "quarantined" in lines[2]
    assert "committed" in lines[3] and len(lines) == 4


@pytest.mark.parametrize("command", [["resume"], ["ckpt", "list"], ["ckpt", "export", "--out", "m.pt"],
                                     ["plot"], ["preempt"]])
def test_commands_that_take_a_run_say_when_there_is_none(tmp_path: Path, command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, str(tmp_path)])
    assert result.exit_code == 2 and "holds no run" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_preempt_without_a_running_launcher(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["preempt", str(tmp_path)])
    assert result.exit_code == 2 and "holds no run" in result.output
    (tmp_path / "spec.json").write_text(json.dumps({"job": "x.py", "sets": {}, "nodes": 1,
                                                    "gpus": 1, "backend": "local", "name": "x"}))
    result = CliRunner().invoke(main, ["preempt", str(tmp_path)])
    assert result.exit_code == 2 and "nothing to preempt" in result.output


def test_resuming_an_older_step_moves_the_newer_timeline_aside(root: Path) -> None:
    for s in (10, 20, 30):
        make(root, s)
    assert store.supersede(root, 10) == [store.step_name(20), store.step_name(30)]
    assert [c.step for c in store.committed(root)] == [10]
    (aside,) = root.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == [store.step_name(20), store.step_name(30)]
    assert store.supersede(root, 10) == []


def test_periodic_triggers_by_steps_and_by_wall_time(tmp_path: Path) -> None:
    import time

    import torch

    from hpcshard.config import TrainConfig
    from hpcshard.runtime.checkpoint import Checkpointer, TrainParts
    from hpcshard.runtime.device import DistEnv

    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    model = torch.nn.Linear(2, 2)
    parts = TrainParts(model=model, optimizer=torch.optim.SGD(model.parameters()), scheduler=None,
                       batches=None)
    ckpt = Checkpointer(parts, env, TrainConfig(ckpt_every=4, ckpt_minutes=0.001), tmp_path)
    assert not ckpt.due(3)
    assert ckpt.due(4)
    time.sleep(0.07)  # 0.001 minutes = 60 ms
    assert ckpt.due(5)


def test_resume_refuses_a_run_that_is_still_going(root: Path) -> None:
    run = root.parent
    (run / "spec.json").write_text(json.dumps({"job": "x.py", "sets": {}, "nodes": 1, "gpus": 1,
                                               "backend": "local", "name": "x"}))
    launchers.write_pid_file(run, 0)  # alive: this very process
    result = CliRunner().invoke(main, ["resume", str(run)])
    assert result.exit_code == 2 and "still running" in result.output
    (run / "launch" / "node-0.pid").write_text("999999999\n")  # left by a launcher killed -9
    result = CliRunner().invoke(main, ["resume", str(run)])
    assert "still running" not in result.output


def test_write_atomic_ignores_a_group_writable_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        store.write_atomic(tmp_path / "manifest.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o640


def test_a_record_cut_short_by_a_full_disk_is_taken_back_and_torn_lines_are_skipped(
        tmp_path: Path) -> None:
    """A full disk cuts a write short (here: a file size limit, which does the same). The
    file must not keep half a record, with the next one glued to it: every reader of the
    ledger and the metrics (the launchers' decisions, `status`) would fail on it."""
    import resource
    import signal

    from hpcshard.rundir.files import append_line, read_lines

    path = tmp_path / "log.jsonl"
    append_line(path, json.dumps({"step": 1}) + "\n")
    size = path.stat().st_size
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, old[1]))
    try:
        with pytest.raises(OSError):
            append_line(path, json.dumps({"step": 2, "loss": 1.0, "pad": "x" * 80}) + "\n")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert path.stat().st_size == size
    append_line(path, json.dumps({"step": 3}) + "\n")
    with path.open("a") as f:  # a line torn before appends were taken back
        f.write('{"step": 4, "lo\n')
    append_line(path, json.dumps({"step": 5}) + "\n")
    assert [r["step"] for r in read_lines(path)] == [1, 3, 5]


# -- whose checkpoint it is ----------------------------------------------------------------

NOBODY = 65534
"""uid and gid of nobody/nogroup: another user, another group."""
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def trusting(run: Path, group: str) -> None:
    """The run's spec, written by this user, naming the group it is shared with."""
    RunSpec(job="x.py", sets={}, nodes=1, gpus=1, backend="local", name="x", run_group=group).write(run)


@as_root
def test_a_checkpoint_another_user_owns_is_refused_unless_the_profile_trusts_its_group(root: Path) -> None:
    """A shared run directory keeps its mode, so another user may put files in it: a
    checkpoint file another uid owns is refused (one line), even one only this user may
    write now; accepted when the run's run_group owns it."""
    path = make(root, 10)
    os.chown(path / "__0_0.distcp", NOBODY, NOBODY)
    with pytest.raises(ValueError, match=r"distcp belongs to .*uid 65534.*not to you.*run_group") as err:
        store.check_safe(store.inspect(path))
    assert "\n" not in str(err.value)
    store.check_safe(store.inspect(path), trusted_gid=NOBODY)
    run = root.parent
    assert trusted_gid(run) is None  # the fixture's spec names no group
    trusting(run, grp.getgrgid(NOBODY).gr_name)
    assert trusted_gid(run) == NOBODY
    os.chown(run / "spec.json", NOBODY, NOBODY)  # another user's word is not taken
    assert trusted_gid(run) is None


@as_root
def test_another_users_checkpoint_directory_is_refused(root: Path) -> None:
    path = make(root, 10)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"refusing checkpoint {path}: {path} belongs to"):
        store.check_safe(store.inspect(path))


@as_root
def test_the_trainer_refuses_another_users_checkpoint_unless_the_run_trusts_its_group(
        root: Path, world_of_one: None) -> None:
    """The loader asks the run's spec which group it trusts (run_group)."""
    import torch

    from hpcshard.config import TrainConfig
    from hpcshard.runtime.checkpoint import Checkpointer, TrainParts
    from hpcshard.runtime.device import DistEnv

    make(root, 10)
    os.chown(root / store.step_name(10) / ".metadata", NOBODY, NOBODY)
    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    model = torch.nn.Linear(2, 2)
    parts = TrainParts(model=model, optimizer=torch.optim.SGD(model.parameters()), scheduler=None,
                       batches=None)
    trainer = Checkpointer(parts, env, TrainConfig(), root.parent)
    with pytest.raises(ValueError, match=r"\.metadata belongs to"):
        trainer.resume("auto")
    trusting(root.parent, grp.getgrgid(NOBODY).gr_name)
    with pytest.raises(ValueError) as err:  # trusted: it is loaded (and fails: no real shards)
        trainer.resume("10")
    assert "belongs to" not in str(err.value) and "failed to load" in str(err.value)


def test_run_directories_are_private_by_default(tmp_path: Path) -> None:
    """0700, whatever the umask, and an existing (empty) directory too: it keeps no mode
    of its own that would let others in."""
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir(mode=0o777)
    existing.chmod(0o777)
    for path in (fresh, existing):
        check_run_dir(path)
        create_run_dir(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert stat.S_IMODE((path / "logs").stat().st_mode) == 0o700


def test_a_run_group_shares_the_run_directory_with_that_group(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getegid()).gr_name
    create_run_dir(tmp_path / "run", group)
    st = (tmp_path / "run").stat()
    assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == os.getegid()


def test_a_run_group_the_user_is_not_in_or_another_users_directory_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="run_group 'no-such-group-x' is not a group"):
        check_run_dir(tmp_path / "run", "no-such-group-x")
    other = next(g for g in grp.getgrall() if g.gr_gid not in (os.getegid(), *os.getgroups()))
    monkeypatch.setattr(os, "geteuid", lambda: 4321)  # not root, and in none of it
    with pytest.raises(ValueError, match=f"run_group {other.gr_name!r}: you are not in that group"):
        check_run_dir(tmp_path / "run", other.gr_name)
    with pytest.raises(ValueError, match="belongs to uid .*not to you"):
        check_run_dir(tmp_path)  # (empty: otherwise acceptable)
    assert not (tmp_path / "run").exists()


def test_auto_takes_the_newest_step_the_launchers_know_though_this_hosts_listing_lacks_it(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS a checkpoint another host committed can be missing from this host's listing
    for the directory's cache (30-60 s); a restart's rank 0 on another node would resume
    from an older one and train its steps again. The launchers pass the newest committed
    step they know (`RankEnv.newest`); rank 0 looks it up by its name."""
    for s in (10, 20):
        make(root, s)
    make(root, 30)
    listing = store.scan

    def cached(where: Path) -> list[store.Checkpoint]:  # (this host's stale listing)
        return [c for c in listing(where) if c.step != 30]

    monkeypatch.setattr(store, "scan", cached)
    assert store.select(root, "auto")[0].step == 20  # type: ignore[union-attr]
    assert store.select(root, "auto", newest=30)[0].step == 30  # type: ignore[union-attr]
    assert store.select(root, "auto", newest=50)[0].step == 20  # type: ignore[union-attr]
    (root / store.step_name(30) / store.MANIFEST).unlink()  # damaged: the previous, as ever
    chosen, skipped = store.select(root, "auto", newest=30)
    assert chosen is not None and chosen.step == 20 and [c.step for c in skipped] == [30]
