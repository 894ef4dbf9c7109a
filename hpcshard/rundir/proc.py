"""This host's processes, from /proc (Linux): who a pid is, and the clock they share.

A pid alone names nobody for long: pids wrap (at 32768 by default, pid_max), and a
container has pid namespaces of its own. A process is (boot, pid namespace, pid, start
time): the boot id is a random UUID per boot of a host's kernel, and the start time is
/proc/PID/stat's `starttime`, clock ticks since boot, which no later process with the same
pid can have in the same boot (the host name is recorded too, for people). Nothing here
reads the wall clock: a clock step (NTP, an admin's `date`) moves neither the boot clock
nor start times.
Stdlib: the launchers, the CLI and the ranks share this module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal as _signal
import socket
import time
from pathlib import Path
from typing import Any

BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
"""Seconds since boot, suspend included: the clock of /proc/PID/stat's start times (Linux;
CLOCK_MONOTONIC where there is no CLOCK_BOOTTIME). Every process of a host (of a time
namespace) reads the same value, and a step of the wall clock does not move it."""


def clock() -> float:
    """Now on the host's boot clock (seconds): what progress boards and the watchdog time
    phases with, and what `started` returns."""
    return time.clock_gettime(BOOT_CLOCK)


def stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ... (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def runqueue_wait(pid: int) -> float:
    """Seconds the main thread of `pid` has spent ready to run but waiting for a CPU (the
    kernel's /proc/PID/schedstat); 0.0 where the kernel keeps no such count or it is gone.
    A host whose cores are oversubscribed (data loader workers, another job's processes)
    starves a rank without hanging it: this is how long."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (None if it is gone): with the boot,
    it tells this process from any later one that gets its pid."""
    fields = stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None


def started(pid: int) -> float:
    """When `pid` started, on the boot clock (`clock`): 0.0 if it is gone. A record naming a
    pid is about this process only if it was written after that (pids wrap)."""
    ticks = start_ticks(pid)
    return 0.0 if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def boot_id() -> str:
    """This boot of this host (a new one at every boot: start ticks count from it)."""
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def pid_namespace() -> str:
    """This process's pid namespace (pid:[INODE]): a pid means a process only inside it."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return ""


def identity(pid: int) -> dict[str, Any] | None:
    """What names process `pid` of this host for good (None if it is gone): for a pid file
    that another process, on this host or not, checks later."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    return {"pid": pid, "start": ticks, "boot": boot_id(), "host": socket.gethostname(),
            "pidns": pid_namespace()}


def here(record: dict[str, Any]) -> bool:
    """Was `record` (an `identity`) taken in this boot of this host's kernel, in this pid
    namespace: can its pid be looked up from here at all? Another host's or another boot's
    pid, or a container's own, would name an unrelated process here. The boot id decides
    (a random UUID per boot of a kernel), not the host name: emulated nodes in UTS
    namespaces of one kernel (the local Slurm cluster) have names of their own and share
    its pids."""
    boot = boot_id()
    return (record.get("boot") == boot and record.get("pidns") == pid_namespace()
            and (bool(boot) or record.get("host") == socket.gethostname()))


def same(record: dict[str, Any]) -> bool:
    """Is the process `record` names still running here: same place, same pid, and the same
    start time (a reused pid has a later one)?"""
    pid = record.get("pid")
    return (here(record) and isinstance(pid, int) and pid > 0
            and start_ticks(pid) == record.get("start"))


def running(record: dict[str, Any]) -> bool:
    """`same`, and not a zombie: a process that exited but was not yet reaped (its parent
    killed with it, or busy) still has its pid and start time, but it holds nothing and
    writes nothing more: its files were closed, and their data flushed, as it exited."""
    return same(record) and stat_fields(int(record["pid"]))[:1] not in (["Z"], ["X"])


def _pidfd(pid: int) -> int | None:
    """A handle on process `pid` that a later process with its pid cannot take over (Linux
    5.3+); None where there is none (then the pid itself is signalled)."""
    try:
        return os.pidfd_open(pid)
    except AttributeError:
        return None
    except OSError as err:
        if err.errno in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
            return None
        raise


def signal(record: dict[str, Any], sig: int) -> bool:
    """Send `sig` to the process `record` (an `identity`) names, if it is still that
    process; True when it was sent. With a pidfd the check and the signal are about one
    process: opened first, then the start time checked, so a pid reused in between fails
    the check instead of getting the signal."""
    if not here(record):
        return False
    try:
        fd = _pidfd(int(record["pid"]))
    except (ProcessLookupError, ValueError, TypeError, KeyError):
        return False
    try:
        if not same(record):
            return False
        if fd is None:
            os.kill(int(record["pid"]), sig)
        else:
            _signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)
