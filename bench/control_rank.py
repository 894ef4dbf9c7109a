"""A fake rank for the control-plane bench (`bench.control`): one tiny stdlib process per
emulated node instead of a torch rank (128 torch ranks do not fit this machine's memory).

It does what the launcher watches a rank do: it joins its node's progress board
(`rundir.progress`, HPCSHARD_BOARD), reports `setup`, then a step every 1/rate seconds,
and after `steps` steps reports `done` and exits 0. It ignores the launcher's flight and
stacks signals as a real rank survives them (the launcher still waits for their records).
It stamps, on one line each, when it started, when it made its first step and when it
reached the steady step, into BENCH_CONTROL_STAMPS (outside the run directory: the bench
counts the run directory's operations): `event cycle node pid unix-time`.

    python bench/control_rank.py RANK STEPS RATE STEADY
"""

from __future__ import annotations

import time

BEGAN = time.time()  # (before any import: the interpreter's own start is not ours to hide)

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from hpcshard.rundir.flight import FLIGHT_SIGNAL  # noqa: E402
from hpcshard.rundir.progress import Board  # noqa: E402
from hpcshard.rundir.rankenv import STACKS_SIGNAL  # noqa: E402


def stamp(event: str, when: float) -> None:
    """One line, one write, O_APPEND: the bench's nodes share the file on a local disk."""
    line = (f"{event} {os.environ.get('HPCSHARD_CYCLE', '0')} {os.environ.get('HPCSHARD_NODE_RANK', '0')} "
            f"{os.getpid()} {when:.6f}\n")
    fd = os.open(os.environ["BENCH_CONTROL_STAMPS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def main(rank: int, steps: int, rate: float, steady: int) -> int:
    for sig in (FLIGHT_SIGNAL, STACKS_SIGNAL):  # (their default action would end us)
        signal.signal(sig, signal.SIG_IGN)
    stamp("start", BEGAN)
    board = Board(Path(os.environ["HPCSHARD_BOARD"]), 1)
    board.publish(0, rank=rank, step=0, phase="setup")
    for step in range(1, steps + 1):
        board.publish(0, rank=rank, step=step, phase="step")
        if step == 1:
            stamp("first", time.time())
        if step == steady:
            stamp("steady", time.time())
        time.sleep(1.0 / rate)
    board.publish(0, rank=rank, step=steps, phase="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
