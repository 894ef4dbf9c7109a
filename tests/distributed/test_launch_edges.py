"""What comes at the edges of supervision, with real processes on the local backend (2 nodes):
a stop notice or a cancel that comes before there are ranks or an agent to hear it, a
disk that fills up while the launchers handle a fault, and a run directory that refuses
writes with another error (EACCES, EIO), for good or for a while. The runs that end bitwise equal to
an uninterrupted one are 2 x 1 (`uninterrupted_2x1`): what they test is between the
launchers, and a 2 x 2 start costs about 9 CPU-s more."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from hpcshard.launch.procs import children, descendants
from hpcshard.rundir import ledger
from hpcshard.rundir.launchers import launchers
from hpcshard.rundir.rankenv import STORAGE_EXIT
from tests.conftest import (
    NOT_ABOUT_HANGS,
    ROOT,
    STEPS,
    gone,
    hpcshard,
    hpcshard_bg,
    pending,
    quiet_env,
    sets,
    step_records,
    tmpfs,
    wait_for,
)
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
    trained_to,
)

pytestmark = pytest.mark.dist


def started(run: Path) -> bool:
    """Both launchers run (their signal handlers are in before their pid files are written)
    and no rank has started yet."""
    return len(launchers(run)) == 2 and not [r for r in ledger.read(run) if r["event"] == "start"]


def agent(launcher: int) -> int | None:
    """The warm agent a launcher's zygote forked for this cycle (None: not yet)."""
    for zygote in children(launcher):
        if b"hpcshard.launch.zygote" in Path(f"/proc/{zygote}/cmdline").read_bytes():
            found = children(zygote)
            return found[0] if found else None
    return None


def test_a_notice_during_the_rendezvous_reaches_the_ranks_and_the_run_requeues_bitwise_equal(
        uninterrupted_2x1: Path, tmp_path: Path) -> None:
    """Defect 8: a notice that came while the agents were in their rendezvous (no rank
    forked yet) reached nobody: the run trained on, and a time-limit notice so lost ended in
    TIMEOUT, never requeued. Node 1's agent is held (SIGSTOP) so that neither node's ranks
    can start while the notice comes; every rank that joins the board after it gets it."""
    run = tmp_path / "early"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=STEPS, ckpt_every=4, keep_last=100))
    wait_for(lambda: len(launchers(run)) == 2 and agent(launchers(run)[1]), 120, "node 1's agent")
    first = agent(launchers(run)[1])
    assert first is not None
    # (the static rendezvous lets each agent fork its ranks at once; they meet in the
    # process group's join: node 1's agent and whatever it forked are held there)
    held = [first, *descendants(first)]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: agent(launchers(run)[0]), 60, "node 0's agent")
        assert not trained_to(run, 1)  # no step anywhere yet: every rank waits for node 1's
        assert hpcshard("preempt", str(run)).returncode == 0
        # Node 1 is held until both launchers have taken the notice (it is no longer pending
        # in either: their handlers ran), so that it came in the rendezvous; not for 1 s,
        # in which a loaded machine may not have run them at all.
        wait_for(lambda: not any(pending(pid) >> (signal.SIGUSR2 - 1) & 1 for pid in launchers(run)), 60,
                 "the launchers to take the notice")
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    ends = [r for r in ledger.read(run) if r["event"] == "end"]
    assert [(e["attempt"], e["reason"]) for e in ends] == [(0, "stop"), (1, "done")], ends
    assert ends[0]["saved_step"] < 4  # it stopped at its first step boundary, not at the end
    assert_bitwise_equal(load(committed(run)[STEPS]), load(committed(uninterrupted_2x1)[STEPS]), "the end")


def test_a_cancel_before_the_agent_exists_ends_the_run_at_once(tmp_path: Path) -> None:
    """Defect 8: a TERM (`hpcshard cancel` of a local run) during the agent's start was
    noted but signalled no one: the run trained on to its end."""
    run = tmp_path / "cancelled"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=400))
    wait_for(partial(started, run), 120, "the launchers, before any rank")
    assert hpcshard("cancel", str(run)).returncode == 0
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert len(step_records(run)) < 400
    assert not [r for r in ledger.read(run) if r["event"] == "end" and r.get("reason") == "done"]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """48 MiB: room for the run and two of its 11 MB checkpoints, until it is filled."""
    with tmpfs(tmp_path / "disk", "48m") as mnt:
        yield mnt


def fill(mnt: Path) -> Path:
    """Take every byte left on `mnt` (what the cluster's quota or a neighbour's job does)."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, shutil.disk_usage(mnt).free)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


def test_a_disk_that_fills_during_a_fault_stops_the_run_for_its_storage_and_blames_no_node(
        uninterrupted_2x1: Path, disk: Path) -> None:
    """Defects 2 and 3: a full run directory made every fault-path write raise (the launcher
    died before it killed its ranks, left no `done`, its peers took its node for lost), and
    a full disk failed node health checks (nodes drained, one per requeue). Now the ranks
    are killed, the run stops with STORAGE_EXIT and one line saying what is full, no node is
    bad, and once there is room again `resume` ends it bitwise equal to an uninterrupted run."""
    run = disk / "run"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=STEPS, ckpt_every=4, keep_last=1))
    wait_for(partial(trained_to, run, 6), 180, "step 6, past the commit of step 4")
    victims = rank_pids(run)
    filler = fill(disk)
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == STORAGE_EXIT, out[-4000:]
    assert f"the run directory {run} is full" in out
    # Every rank was killed: each is gone once its end is through (a torch process's exit
    # takes a while on a loaded machine: waited for, not 1 s). One left behind would wait in
    # its collective for gloo's 30 minutes, far past this bound.
    wait_for(lambda: all(gone(p) for p in victims), 60, "every rank's end")
    assert not [r for r in ledger.read(run) if r["event"] == "bad_node"]  # no node blamed
    filler.unlink()
    done = hpcshard("resume", str(run))
    assert done.returncode == 0, done.stdout[-4000:]
    assert_bitwise_equal(load(committed(run)[STEPS]), load(committed(uninterrupted_2x1)[STEPS]), "the end")


def refuse_writes(run: Path) -> None:
    """Every directory and file of the run loses its write bits: what a root-squash change
    or an expired Kerberos ticket does to a run's writes (EACCES), for a process that
    permission bits bind (`as_a_user`)."""
    for where, dirs, files in os.walk(run):
        for path in [Path(where, name) for name in (*dirs, *files)]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & ~0o222)
    run.chmod(run.stat().st_mode & ~0o222)


def as_a_user(*argv: str) -> list[str]:
    """`argv` as root without the capability to override permission bits: bound by them as
    any user is (the tests run as root, which no mode refuses)."""
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *argv]


SHORT_WAIT = '''import hpcshard.launch.health as _health
_health.STORAGE_WAIT_S = 5.0  # (a run waits 300 s for a storage error that may pass)
'''


def hooked(tmp_path: Path, *code: str) -> dict[str, str]:
    """The environment of a run whose every Python process first runs `code` (a
    sitecustomize on PYTHONPATH)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("\n".join(code))
    return {"PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}


def test_a_run_directory_that_refuses_writes_stops_the_run_for_its_storage_and_blames_no_node(
        tmp_path: Path) -> None:
    """Issue 42, defect 1: an error other than ENOSPC, EDQUOT and EROFS that persisted was
    taken for the node's. With EACCES on the whole run directory after a rank died, the
    launchers restarted the ranks twice (no probe counted it) and gave up, exit 1, each with
    a traceback (and the next attempt's health checks would have declared both nodes bad).
    Now the fault's probe names the error and the path, the decider waits for the storage
    (STORAGE_WAIT_S, 5 s here), and the run stops for it (STORAGE_EXIT) on both launchers,
    through the store: nothing of it could be written."""
    run = tmp_path / "eacces"
    argv = as_a_user(sys.executable, "-m", "hpcshard", "submit", "--nodes", "2", "--gpus", "1",
                     "jobs/charlm.py", "--run-dir", str(run),
                     *sets(steps=400, ckpt_every=1000, **NOT_ABOUT_HANGS))
    proc = subprocess.Popen(argv, cwd=ROOT, env=quiet_env(**hooked(tmp_path, SHORT_WAIT)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(partial(trained_to, run, 2), 180, "step 2")
        victims = rank_pids(run)
        refuse_writes(run)
        with contextlib.suppress(ProcessLookupError):  # (a rank the refused writes ended first)
            os.kill(victims[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
        subprocess.run(["chmod", "-R", "u+w", str(run)], check=False)
    assert proc.returncode == STORAGE_EXIT, out[-4000:]
    assert f"{run} takes no write (EACCES: Permission denied) (3 tries); trying it again" in out
    assert re.search(rf"{re.escape(str(run))} takes no write \(EACCES: Permission denied\), tried for \d+ s; "
                     "no node is blamed", out), out[-4000:]
    assert not [line for line in out.splitlines() if line.startswith("Traceback")]  # (torchrun's are logged)
    assert not [p for p in victims if Path(f"/proc/{p}").exists()]  # every rank was killed
    assert not [r for r in ledger.read(run) if r["event"] == "bad_node"]


PROBE_EIO = '''import errno, os
_fsync = os.fsync
def fsync(fd):
    # The EIO a soft NFS mount or an evicted Lustre client gives a write: here the
    # launchers' write probe alone, so that the ledger still says what they did.
    if ".probe." in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return _fsync(fd)
os.fsync = fsync
'''


def test_an_eio_on_the_run_directory_at_the_health_check_drains_no_node(tmp_path: Path) -> None:
    """Issue 42, defect 1: with EIO on the run directory both nodes of a 2-node job declared
    themselves bad at their health check (drained with `bad_nodes = drain`, excluded from
    every later requeue; on the local backend the run gave up for want of nodes). Every
    write probe of both launchers gets EIO (a sitecustomize on PYTHONPATH): the run waits
    for its storage (5 s here), then stops for it before a step, and no node is bad."""
    run = tmp_path / "eio"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                    *sets(steps=4), env=hooked(tmp_path, PROBE_EIO, SHORT_WAIT), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == STORAGE_EXIT, out[-4000:]
    assert f"the run directory {run} takes no write (EIO: Input/output error) (3 tries)" in out
    assert f"the run directory {run} takes no write (EIO: Input/output error), tried for " in out
    records = ledger.read(run)
    assert not [r for r in records if r["event"] == "bad_node"]
    (end,) = [r for r in records if r["event"] == "end"]
    assert end["reason"] == "storage" and "no node is blamed" in end["how"]
    assert not step_records(run)


PROBE_EIO_WHILE = '''import errno, os
_fsync = os.fsync
def fsync(fd):
    # An EIO while a file server fails over: the launchers' write probe alone, while the
    # flag file is there; each EIO given is counted beside it.
    if ".probe." in os.path.basename(os.readlink(f"/proc/self/fd/{{fd}}")) and os.path.exists({flag!r}):
        with open({flag!r} + ".count", "a") as count:
            count.write("x")
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return _fsync(fd)
os.fsync = fsync
'''


def test_an_eio_for_a_while_at_the_health_check_is_waited_for_and_the_run_trains(tmp_path: Path) -> None:
    """Issue 42's review: an EIO that lasted the probe's three tries (2 s) stopped the run for
    good (exit 74, the job FAILED). Both launchers' probes get EIO at their health check
    until the flag file is gone, taken away once the decider's wait has probed once more in
    vain: the decider waits, the storage answers, both launchers restart the ranks, the run
    trains to its end, and no node is bad."""
    flag = tmp_path / "failing-over"
    flag.touch()
    count = Path(f"{flag}.count")
    run = tmp_path / "eio-while"
    proc = hpcshard_bg("submit", "--nodes", "2", "--gpus", "1", "jobs/charlm.py", "--run-dir", str(run),
                       *sets(steps=4), env=hooked(tmp_path, PROBE_EIO_WHILE.format(flag=str(flag))))
    try:
        # both health checks' 3 tries, and one probe of the decider's wait (or the run's end)
        wait_for(lambda: (count.exists() and len(count.read_text()) >= 7) or proc.poll() is not None, 240,
                 "7 EIOs of the probes")
        flag.unlink()
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "trying it again for up to 300 s" in out and "takes writes again after" in out
    records = ledger.read(run)
    assert not [r for r in records if r["event"] == "bad_node"]
    (fault,) = [r for r in records if r["event"] == "fault"]
    assert fault["restart"] and fault["cause"] == "the health check's write probe", fault
    assert len(step_records(run)) >= 4
