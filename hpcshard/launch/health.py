"""Before an attempt trains: can this node do its part, and can the run's storage take the
run's writes? The two answers are kept apart: a node that fails its own check is bad (it
is replaced, excluded, maybe drained), while the run directory that takes no write is the
run's trouble, never a node's, whatever the error (measured before this split: a full run
directory made every node fail its check, one drained per requeue until the run gave up;
and while only ENOSPC, EDQUOT and EROFS were the storage's, an EIO drained both nodes of a
2-node job, and an EACCES left both launchers idle until the time limit). An error that
may pass (EIO, ESTALE, EACCES, a mount that hangs) is waited for before the run stops for
it (`wait_for_storage`): stopped at once, a 2.5 s EIO while a file server failed over
ended a run for good.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO

from hpcshard.launch.bounded import POLL_S, Hung, bounded
from hpcshard.rundir import store
from hpcshard.rundir.files import STORAGE_ERRNOS, side_name
from hpcshard.rundir.launchers import LAUNCH

CHECK_TIMEOUT_S = 120.0
"""How long the profile's health check (or nvidia-smi) may take."""
MIN_FREE_MEMORY = 0.05
"""A node with less than this share of its memory available fails its health check (a
leaked process from an earlier job, a full tmpfs)."""
ROOM_FACTOR = 1.1
"""Room asked for the next checkpoint: the newest one's size, and a margin."""
STORAGE_WORDS = {errno.ENOSPC: "is full", errno.EDQUOT: "is over its quota", errno.EROFS: "is read-only"}
"""What each of files.STORAGE_ERRNOS says of the run directory."""


def storage_error(err: OSError, run_dir: Path) -> str:
    """One line for a write the run directory refused: what is wrong with the storage, the
    error named (EACCES, EIO...: what an admin searches for)."""
    what = STORAGE_WORDS.get(err.errno or 0)
    if what is None:
        name = errno.errorcode.get(err.errno or 0, "")
        what = f"takes no write ({name + ': ' if name else ''}{err.strerror or err})"
    return f"the run directory {run_dir} {what}"


def is_storage_error(err: BaseException) -> bool:
    """Full, over quota, read-only: no wait helps (any other error is waited for first)."""
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


@dataclass(frozen=True)
class Storage:
    """What the run directory's write probe found wrong with the run's storage (false when
    nothing is)."""

    why: str = ""
    """One line that names the error and the path ("" when a write landed, with room)."""
    lasting: bool = False
    """Full, over quota, read-only, or without room for the next checkpoint: a person must
    act, and the run stops at once. Any other error (EIO, ESTALE, ENOTCONN, EACCES, a probe
    that hung) may pass: the run waits for it first (`wait_for_storage`)."""
    hung: bool = False
    """The probe gave no answer within its bound: a read now would hang too."""

    def __bool__(self) -> bool:
        return bool(self.why)


def _refusal(err: OSError, run_dir: Path, tries: int = 1) -> Storage:
    """What a write the run directory refused with `err` (after `tries`) says of it."""
    lasting = is_storage_error(err)
    return Storage(storage_error(err, run_dir) + ("" if lasting or tries == 1 else f" ({tries} tries)"),
                   lasting=lasting)


PROBE_TRIES = 3
"""Tries of the run directory's write probe, a second apart: a file server's blip (ESTALE
after a failover, an EIO while a client reconnects) passes at once."""
PROBE_WAIT_S = 60.0
"""The longest the probe may take before the storage is called hung (a hard NFS mount whose
server is gone blocks a write until it is back): the launcher beats meanwhile (a silent one
would be taken for lost, its node blamed for the storage), and the decider, which waits
`supervise.DOWN_TIMEOUT_S` for every node's word, hears it in time."""
STORAGE_WAIT_S = 300.0
"""How long the run waits for storage that refuses writes with an error that may pass, or
does not answer, before it stops for it. An NFS server that restarts or fails over to its
partner holds its clients for the takeover and then its NFSv4 grace period (90 s by default
on Linux's nfsd); a Lustre client evicted, or one whose OST or MDT fails over, reconnects
within about obd_timeout (100 s by default) and the target's recovery; a Kerberos ticket is
renewed by its daemon within a minute or two. Tens of seconds to a couple of minutes:
300 s covers them with a margin, as long as Slurm waits for a silent node by default
(SlurmdTimeout); storage gone longer than that needs a person."""
PAUSE_S = 1.0
"""The first pause between two probes while the run waits for its storage; each pause
doubles, up to PAUSE_MAX_S (a file server that comes back is not met by every node's probe
every second)."""
PAUSE_MAX_S = 30.0


def storage_problem(run_dir: Path, need: int | Callable[[], int] = 0, tries: int = PROBE_TRIES,
                    waiting: Callable[[], None] = lambda: None, within: float | None = None) -> Storage:
    """Does the run directory take a write (a real one: permission bits say nothing on a
    read-only mount or for root) and have `need` bytes free? What is wrong with the run's
    storage (false where nothing is). Whatever the error, it is the storage's: the run
    directory is every node's, and nothing one node sees of it makes that node bad (the
    decider compares the nodes' probes: `policy.storage_verdict`). `need`: bytes, or what
    sizes them once the write landed (a listing of the checkpoints, which a hung mount
    hangs too: it runs inside the probe's bound). `waiting`: called while the probe runs
    (the launcher beats); a probe that takes over `within` (PROBE_WAIT_S) is the storage
    hung."""
    within = PROBE_WAIT_S if within is None else within
    try:
        return bounded(partial(_storage_problem, run_dir, need, tries), within, waiting)
    except Hung:
        return Storage(f"the run directory {run_dir} did not answer a write within {within:.0f} s (hung)",
                       hung=True)


def _storage_problem(run_dir: Path, need: int | Callable[[], int], tries: int) -> Storage:
    for attempt in range(tries):
        err = _probe(run_dir)
        if err is None:
            break
        if is_storage_error(err) or attempt + 1 == tries:
            return _refusal(err, run_dir, tries)
        time.sleep(1.0)
    room = need() if callable(need) else need
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError as err:
        return _refusal(err, run_dir)
    if free < room:
        return Storage(f"the run directory {run_dir} has {free / 1e9:.2f} GB free, less than the next "
                       f"checkpoint needs (about {room / 1e9:.2f} GB)", lasting=True)
    return Storage()


def wait_for_storage(run_dir: Path, seen: Storage, waiting: Callable[[], None],
                     stop: Callable[[], bool] = lambda: False, within: float | None = None) -> Storage:
    """Storage that refused a write with an error that may pass (`seen`): probe it again,
    a pause between two probes (PAUSE_S, doubling up to PAUSE_MAX_S), `waiting` called all
    along (the launcher beats), for up to `within` (STORAGE_WAIT_S; the last probe may
    take its own PROBE_WAIT_S more). Storage() once a write lands; else what the last probe
    found, saying how long it was tried. An error a person must fix (full, quota,
    read-only) ends the wait at once; so does `stop()` (a notice, a cancel), with what
    the last probe found."""
    within = STORAGE_WAIT_S if within is None else within
    began, pause = time.monotonic(), PAUSE_S
    while not seen.lasting and not stop():
        left = began + within - time.monotonic()
        if left <= 0:
            break
        _pause(min(pause, left), waiting, stop)
        seen = storage_problem(run_dir, tries=1, waiting=waiting)
        if not seen:
            return seen
        pause = min(2 * pause, PAUSE_MAX_S)
    if seen.lasting:
        return seen
    return replace(seen, why=f"{seen.why}, tried for {time.monotonic() - began:.0f} s")


def _pause(seconds: float, waiting: Callable[[], None], stop: Callable[[], bool]) -> None:
    """Sleep `seconds`, calling `waiting` every POLL_S, until `stop()`."""
    deadline = time.monotonic() + seconds
    while not stop() and (left := deadline - time.monotonic()) > 0:
        waiting()
        time.sleep(min(POLL_S, left))


def _probe(run_dir: Path) -> OSError | None:
    """Write, fsync and remove a small file in the run directory: the error, if any."""
    probe = side_name(run_dir / LAUNCH / ".probe")
    try:
        probe.parent.mkdir(exist_ok=True)
        with probe.open("w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return err
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def next_checkpoint_bytes(run_dir: Path) -> int:
    """Room for another checkpoint as big as the newest committed one (0: none yet, or the
    run directory cannot be listed: the probe says why)."""
    try:
        newest = store.committed(run_dir / store.CHECKPOINTS)
    except (OSError, ValueError):
        return 0
    return int(max((c.bytes for c in newest), default=0) * ROOM_FACTOR)


def memory_short(meminfo: Path = Path("/proc/meminfo")) -> str:
    """"" when at least MIN_FREE_MEMORY of the node's memory is available, else why not."""
    try:
        fields = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in
                                                         meminfo.read_text().splitlines()) if v}
    except (OSError, ValueError):
        return ""  # not Linux, or no /proc: nothing to judge by
    total, available = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
    if total and available < MIN_FREE_MEMORY * total:
        return (f"{available / 2**20:.1f} GiB of {total / 2**20:.0f} GiB memory available, under "
                f"{MIN_FREE_MEMORY:.0%} (a process left from another job?)")
    return ""


@dataclass(frozen=True)
class Health:
    """A node's health before an attempt trains: what is wrong with the node itself ("" when
    nothing is), and what its probe found wrong with the run's storage."""

    node: str = ""
    storage: Storage = Storage()


def check(run_dir: Path, *, leader: bool, ranks: int, command: str,
          waiting: Callable[[], None]) -> Health:
    """The node's checks: the run directory takes a write (every node mounts it: what it
    refuses is the storage's) and, on the leader, has room for another checkpoint (the file
    system is shared: one look is enough); memory is free, the GPUs answer (where
    nvidia-smi is), and the profile's `health_check` command exits 0. `waiting`: called
    while a probe or command runs (the launcher beats: a check may take a minute, and a
    silent launcher is a lost one)."""
    storage = storage_problem(run_dir, partial(next_checkpoint_bytes, run_dir) if leader else 0,
                              waiting=waiting)
    node = memory_short() or gpus_short(ranks, waiting)
    if not node and command:
        node = run_check(["bash", "-c", command], "the profile's health_check", run_dir, waiting)
    return Health(node=node, storage=storage)


def gpus_short(ranks: int, waiting: Callable[[], None]) -> str:
    """Where nvidia-smi is (a GPU node): it must list a GPU for every rank of the node."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    with tempfile.NamedTemporaryFile("w+") as out:
        said = run_check([smi, "--query-gpu=index", "--format=csv,noheader"], "nvidia-smi", None,
                         waiting, out=out)
        if said:
            return said
        out.seek(0)
        found = len([line for line in out.read().splitlines() if line.strip()])
    return "" if found >= ranks else f"nvidia-smi lists {found} GPU(s); this node runs {ranks} ranks"


def run_check(argv: list[str], name: str, run_dir: Path | None, waiting: Callable[[], None],
              out: IO[str] | None = None, poll: float = 0.2) -> str:
    """Run a check command; "" when it exits 0, else what it said last. `out`: a file that
    gets what it printed (else a temporary one). The command is killed when it takes over
    CHECK_TIMEOUT_S, or when `waiting` raises (the launcher leaves the run)."""
    env = {**os.environ, **({"HPCSHARD_RUN_DIR": str(run_dir)} if run_dir else {})}
    with contextlib.ExitStack() as stack:
        out = out or stack.enter_context(tempfile.TemporaryFile("w+"))
        proc = stack.enter_context(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        while proc.poll() is None:
            try:
                waiting()
            except BaseException:  # (Popen's exit would wait for the command)
                proc.kill()
                raise
            if time.monotonic() > deadline:
                proc.kill()
                return f"{name} took over {CHECK_TIMEOUT_S:.0f} s"
            time.sleep(poll)
        out.seek(0)
        said = out.read().strip().splitlines()
    if not proc.returncode:
        return ""
    return f"{name} exited {proc.returncode}" + (f": {said[-1]}" if said else "")
