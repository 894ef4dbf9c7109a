"""Before an attempt trains: can this node do its part, and can the run's storage take the
run's writes? The two answers are kept apart: a node that fails its own check is bad (it
is replaced, excluded, maybe drained), while the run directory that takes no write is the
run's trouble, never a node's, whatever the error (measured before this split: a full run
directory made every node fail its check, one drained per requeue until the run gave up;
and while only ENOSPC, EDQUOT and EROFS were the storage's, an EIO drained both nodes of a
2-node job, and an EACCES left both launchers idle until the time limit).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

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
    """Full, over quota, read-only: no retry helps (any other error is tried again first)."""
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


PROBE_TRIES = 3
"""Tries of the run directory's write probe, a second apart: a file server's blip (ESTALE
after a failover, an EIO while a client reconnects) passes; what persists is the storage's."""
PROBE_WAIT_S = 60.0
"""The longest the probe may take before the storage is called hung (a hard NFS mount whose
server is gone blocks a write until it is back): the launcher beats meanwhile (a silent one
would be taken for lost, its node blamed for the storage), and the decider, which waits
`supervise.DOWN_TIMEOUT_S` for every node's word, hears it in time."""


def storage_problem(run_dir: Path, need: int | Callable[[], int] = 0, tries: int = PROBE_TRIES,
                    waiting: Callable[[], None] = lambda: None, within: float | None = None) -> str:
    """Does the run directory take a write (a real one: permission bits say nothing on a
    read-only mount or for root) and have `need` bytes free? What is wrong with the run's
    storage; "" where nothing is. Any error that persists through `tries` is the storage's,
    whatever its errno: the run directory is every node's, and nothing one node sees of it
    makes that node bad (a stale mount on one node alone is rare; the decider names the
    nodes that saw it, `Supervisor.decide`). `need`: bytes, or what sizes them once the
    write landed (a listing of the checkpoints, which a hung mount hangs too: it runs
    inside the probe's bound). `waiting`: called while the probe runs (the launcher
    beats); a probe that takes over `within` (PROBE_WAIT_S) is the storage hung."""
    within = PROBE_WAIT_S if within is None else within
    found: list[str] = []
    probing = threading.Thread(target=lambda: found.append(_storage_problem(run_dir, need, tries)),
                               name="hpcshard-probe", daemon=True)
    probing.start()
    deadline = time.monotonic() + within
    while probing.is_alive():
        waiting()
        probing.join(0.2)
        if probing.is_alive() and time.monotonic() > deadline:
            return f"the run directory {run_dir} did not answer a write within {within:.0f} s (hung)"
    return found[0] if found else f"the run directory {run_dir} could not be probed"


def _storage_problem(run_dir: Path, need: int | Callable[[], int], tries: int) -> str:
    for attempt in range(tries):
        err = _probe(run_dir)
        if err is None:
            break
        if is_storage_error(err) or attempt + 1 == tries:
            return storage_error(err, run_dir) + ("" if is_storage_error(err) else f" ({tries} tries)")
        time.sleep(1.0)
    room = need() if callable(need) else need
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError as err:
        return storage_error(err, run_dir)
    if free < room:
        return (f"the run directory {run_dir} has {free / 1e9:.2f} GB free, less than the next "
                f"checkpoint needs (about {room / 1e9:.2f} GB)")
    return ""


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
    except OSError:
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
    """A node's health before an attempt trains: what is wrong with the node itself, and
    what is wrong with the run's storage (each "" when nothing is)."""

    node: str = ""
    storage: str = ""


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
