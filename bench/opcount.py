"""What a launcher asks of the run directory's file system, counted with strace: the
control-plane bench's (`bench.control`) metadata counter.

A *metadata operation* is a system call that an NFS client turns into a metadata RPC to
the server (LOOKUP, GETATTR, CREATE, RENAME, LINK, REMOVE, MKDIR, READDIR, SETATTR, ACCESS):
every call that names a path under the run directory (open, stat, access, rename, link,
unlink, mkdir, chmod...) and every directory read (getdents). A negative lookup (an open
of a file that is not there yet: the fault file, polled) is one. What moves bytes (read,
write, fsync: READ, WRITE, COMMIT RPCs) is counted apart as *data*; what the kernel answers
from the open file (fstat right after an open, lseek, close, fcntl) as *other*. On Lustre
and GPFS the same calls land on the metadata server, whose load is what admins police.

strace stops the traced process at every system call (ptrace): a traced launcher runs
slower, so its poll loop makes its looks a little less often than untraced. The counts
are therefore a slight underestimate of the untraced rate (the bench reports the poll
rate it saw: fault-file looks a second, 5 untraced).
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

METADATA = frozenset({
    "open", "openat", "openat2", "creat", "stat", "lstat", "newfstatat", "fstatat64", "statx",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "rename", "renameat",
    "renameat2", "link", "linkat", "symlink", "symlinkat", "unlink", "unlinkat", "rmdir", "mkdir",
    "mkdirat", "mknod", "mknodat", "getdents", "getdents64", "chmod", "fchmod", "fchmodat",
    "chown", "fchown", "lchown", "fchownat", "utime", "utimes", "utimensat", "futimesat",
    "truncate", "ftruncate", "statfs", "fstatfs", "getxattr", "lgetxattr", "setxattr",
    "lsetxattr", "removexattr", "listxattr"})
"""Calls that an NFS client sends to the server as metadata RPCs (see the module's text)."""
DATA = frozenset({
    "read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev", "pwritev",
    "pwritev2", "fsync", "fdatasync", "sync_file_range", "copy_file_range", "sendfile"})
"""Calls that move a file's bytes (READ, WRITE, COMMIT)."""

_LINE = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(?:(?P<ts>\d+\.\d+)\s+)?"
                   r"(?P<call>[a-z_0-9]+)\((?P<rest>.*)$")
"""One strace line (`-f -ttt`): an optional pid, an optional epoch time, then `call(`.
Lines that resume a call (`<... openat resumed>`), signals and exits do not match: a
call split by another thread's is counted once, at its start, which names its path."""


_AT_CALLS = frozenset({"newfstatat", "fstatat64", "statx"})
_EMPTY_PATH = re.compile(r'^\d+(?:<[^>]*>)?, "",')
"""A stat of an open file by its descriptor (what the kernel answers from the open file):
not a lookup."""


def category(call: str) -> str:
    """metadata, data or other (see the module's text)."""
    return "metadata" if call in METADATA else "data" if call in DATA else "other"


def kind(path: str, root: str, host: str | None = None) -> str:
    """What a path under `root` is, numbers folded (alive-0-17.json -> alive-N-N.json); a
    writer's side file (`files.side_name`: `.NAME.HOST.PID.HEX.tmp`, `host` this one's) ->
    `.NAME.*.tmp`."""
    name = path[len(root):].lstrip("/") or "."
    host = socket.gethostname() if host is None else host
    name = re.sub(rf"(^|/)\.([^/]+)\.{re.escape(host)}\.\d+\.[0-9a-f]+\.tmp$", r"\1.\2.*.tmp", name)
    return re.sub(r"\d+", "N", name)


@dataclass
class Counts:
    """A traced process's calls on the run directory over `seconds`."""

    seconds: float
    calls: Counter[str] = field(default_factory=Counter)
    """Every call that named the run directory, by call name."""
    files: Counter[str] = field(default_factory=Counter)
    """The metadata operations, by what they named (`kind`)."""

    def of(self, what: str) -> int:
        """How many calls of one category (`category`)."""
        return sum(n for call, n in self.calls.items() if category(call) == what)

    def rate(self, what: str = "metadata") -> float:
        return self.of(what) / self.seconds if self.seconds > 0 else 0.0


def count(lines: Iterable[str], root: str, since: float | None = None, until: float | None = None,
          ) -> Counts:
    """The calls in strace output (`-f -ttt -y`) that name `root` or a path below it, as
    an argument or through a file descriptor (`-y`), between `since` and `until` (epoch
    seconds; None: no bound; lines without a time are kept)."""
    under = re.compile(re.escape(root.rstrip("/")) + r"(?:/[^\"<>]*)?(?=[\"<>])")
    found = Counts(seconds=(until - since) if since is not None and until is not None else 0.0)
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        ts = float(m["ts"]) if m["ts"] else None
        if ts is not None and ((since is not None and ts < since) or (until is not None and ts >= until)):
            continue
        path = under.search(m["rest"])
        if path is None:
            continue
        call = m["call"]
        if call in _AT_CALLS and _EMPTY_PATH.match(m["rest"]):
            call = "fstat"  # (Python's os.fstat: newfstatat(fd, "", AT_EMPTY_PATH))
        found.calls[call] += 1
        if category(call) == "metadata":
            found.files[kind(path.group(0), root.rstrip("/"))] += 1
    return found


ATTACH_S = 1.0
"""How long strace gets to attach before the counted window begins."""


class Tracer:
    """strace attached to some processes (`-f`: their threads and children too), one output
    file each; `stop` detaches and counts what each did to `root` while attached."""

    def __init__(self, pids: dict[str, int], out: Path, root: Path) -> None:
        self.root = str(root)
        self.files = {name: out / f"{name}.strace" for name in pids}
        self.procs = [subprocess.Popen(
            ["strace", "-f", "-qq", "-ttt", "-y", "-e", "trace=%file,%desc", "-e", "signal=none",
             "-o", str(self.files[name]), "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]
        time.sleep(ATTACH_S)
        self.since = time.time()

    @staticmethod
    def available() -> bool:
        return shutil.which("strace") is not None

    def stop(self) -> dict[str, Counts]:
        until = time.time()
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # (strace detaches and leaves the process running)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        counted = {}
        for name, path in self.files.items():
            with path.open(errors="replace") as lines:
                counted[name] = count(lines, self.root, self.since, until)
        return counted
