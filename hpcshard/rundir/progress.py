"""The progress board: how a node's ranks tell their launcher, every step, where they are.

One small file per node in node-local memory (/dev/shm where it exists), one fixed slot
per local rank: pid, global rank, step, phase and when the phase began. A rank writes its
slot in place through mmap (no system call per step, nothing on shared storage, no
collective); the launcher reads the whole board a few times a second. Stdlib: the
launcher and the ranks share this module.

A board decides which pids its launcher kills, and /dev/shm is writable by every user of
the host: a board is the user's own. Its name holds a random token (the ranks learn it
from HPCSHARD_BOARD), it is created exclusively without following a symlink, mode 0600,
and a board that another user owns, or that others may write, is never read or joined.
Times are on the host's boot clock (`rundir.proc.clock`), never the wall clock.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from hpcshard.rundir.proc import clock

PHASES = ("idle", "setup", "load", "step", "eval", "save", "done", "join", "profile")
"""What a rank is doing. `done`: it left the training loop (finished, stopped, failed);
`join`: it joins the process group (init_process_group: the store, the backend's mesh);
`profile`: a profile window starts or ends (the recording ranks stop the profiler and
write the trace, the others wait for them at the boundary: judged as a save is, never by
the steps' learned limit)."""

_SLOT = struct.Struct("<qqqqd")  # pid, rank, step, phase, phase start (boot clock)


@dataclass(frozen=True)
class Slot:
    local_rank: int
    pid: int
    rank: int
    step: int
    phase: str
    since: float
    """When this phase began, on the host's boot clock (`rundir.proc.clock`: the clock of
    process start times, which wall-clock steps do not move)."""


def board_dir() -> Path:
    """Node-local: /dev/shm when it exists (RAM files), else the temp directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def board_path(run_id: str, node_rank: int) -> Path:
    """A new board's path: a fresh random token each call, so that nobody can create (or
    link) the file before the launcher does."""
    return board_dir() / f"hpcshard-{run_id}-node{node_rank}-{secrets.token_hex(16)}.board"


def boards() -> list[list[Slot]]:
    """Every board of this user on this host, read (boards that vanish while read, and
    boards that are not this user's alone, are left out)."""
    found = []
    for path in board_dir().glob("hpcshard-*.board"):
        try:
            board = Board(path)
        except (OSError, ValueError):
            continue
        found.append(board.read())
        board.close()
    return found


def _refuse_foreign(path: Path, fd: int) -> None:
    """PermissionError unless the open file is this user's and only this user's to write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"progress board {path} is not this user's own (uid {st.st_uid}, "
                              f"mode {stat.filemode(st.st_mode)}): refused, its pids may be anyone's")


class Board:
    """A node's board. The launcher creates it (`create`); each rank opens it once."""

    def __init__(self, path: Path, slots: int | None = None) -> None:
        """Open an existing board (its size gives `slots` when None); PermissionError when
        it is a symlink or not this user's own."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            _refuse_foreign(path, fd)
            self.path = path
            self.slots = os.fstat(fd).st_size // _SLOT.size if slots is None else slots
            self._map = mmap.mmap(fd, _SLOT.size * self.slots)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, path: Path, slots: int) -> Board:
        """A fresh, zeroed board (the launcher, before each start of its ranks), at a path
        from `board_path`. FileExistsError if anything is there already (a symlink too:
        never followed)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\0" * _SLOT.size * slots)
        finally:
            os.close(fd)
        return cls(path, slots)

    def publish(self, local_rank: int, *, rank: int, step: int, phase: str) -> None:
        """Write this rank's slot: an in-memory copy of 40 bytes, packed aside first.
        (`struct.pack_into` zero-fills the slot, then writes field after field: a launcher
        reading between the pid and the phase start saw a phase begun at boot, and declared
        a rank hung "for 29301 s" while it stepped, under the load of the whole suite.)"""
        at = local_rank * _SLOT.size
        self._map[at:at + _SLOT.size] = _SLOT.pack(os.getpid(), rank, step, PHASES.index(phase), clock())

    def read(self) -> list[Slot]:
        """Every slot a rank has written (a rank that has not started yet has none)."""
        out = []
        for i in range(self.slots):
            pid, rank, step, phase, since = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and since > 0:  # (a slot half written: no phase starts at boot)
                out.append(Slot(i, pid, rank, step, PHASES[phase], since))
        return out

    def close(self, remove: bool = False) -> None:
        self._map.close()
        if remove:
            self.path.unlink(missing_ok=True)


_own: list[tuple[Board, int, int]] = []
"""This process's board and slot, once opened (`report`)."""
LAST: dict[str, int | None] = {"step": None}
"""The step this process last reported (a failing script's rank names it)."""


def report(phase: str, step: int | None = None) -> bool:
    """Put this process on its node's board, when a launcher of hpcshard's watches one
    (HPCSHARD_BOARD, set for every rank): the slot of LOCAL_RANK, global RANK. `step`
    None keeps the last one. False where there is no board (plain torchrun, a notebook):
    then this costs one dictionary lookup."""
    if not _own:
        path = os.environ.get("HPCSHARD_BOARD")
        if not path or not Path(path).exists():
            return False
        slots = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        _own.append((Board(Path(path), slots), int(os.environ.get("LOCAL_RANK", "0")),
                     int(os.environ.get("RANK", "0"))))
    board, local_rank, rank = _own[0]
    if step is None:
        step = LAST["step"] or 0
    else:
        LAST["step"] = step
    board.publish(local_rank, rank=rank, step=step, phase=phase)
    return True
