"""One warm process per node that forks each cycle's warm agent: a restart after a fault
starts no new Python and imports nothing.

`launch.warm` saves the ranks their imports: each is a fork of an agent that imported
torch and the runtime once. But a fault's restart still started a new agent, a new
Python importing all of that again: 3 s of the 7 s a recovery took here. The launcher
now starts this zygote once (`Zygote`); it imports what the agent needs and then waits
for orders on a pipe. Each cycle's agent is a fork of it (`Zygote.start`), with the
cycle's environment, the same code as `python -m hpcshard.launch.warm ARGS` runs; the
zygote waits for it and reports its exit status. `Forked` looks like the Popen the
supervisor had before (pid, poll, wait, send_signal, returncode).

Fork safety is the warm agent's (see `launch.warm`): no CUDA, no user code, and the
zygote has no threads of its own when it forks.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from hpcshard.rundir import console
from hpcshard.rundir.rankenv import RankEnv


class Zygote:
    """The launcher's handle on its node's zygote."""

    def __init__(self, env: dict[str, str]) -> None:
        orders_r, self._orders = os.pipe()
        self._replies, replies_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpcshard.launch.zygote", str(orders_r), str(replies_w)],
            env=env, pass_fds=(orders_r, replies_w))
        os.close(orders_r)
        os.close(replies_w)
        self._buffer = b""
        self.closed = False
        self.waiting: Callable[[], None] = lambda: None
        """Called every half second while an order waits (the first one waits for the
        zygote's imports, seconds on a loaded host): the launcher's heartbeat."""

    def start(self, argv: list[str], env: dict[str, str]) -> Forked:
        """Fork an agent running `launch.warm` with `argv` and exactly `env`."""
        try:
            os.write(self._orders, (json.dumps({"argv": argv, "env": env}) + "\n").encode())
        except BrokenPipeError:  # it died: the launcher starts another (`launch.node`)
            raise RuntimeError(f"hpcshard's zygote is gone (exit {self.proc.poll()})") from None
        while (reply := self.reply(0.5)) is None and self.proc.poll() is None:
            self.waiting()
        if reply is None or "pid" not in reply:
            raise RuntimeError(f"hpcshard's zygote did not start an agent (exit {self.proc.poll()})")
        return Forked(self, int(reply["pid"]))

    def reply(self, timeout: float | None) -> dict[str, Any] | None:
        """The zygote's next line, or None: none within `timeout`, or the zygote is gone."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._replies], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self._replies, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    def close(self) -> None:
        """No more orders: the zygote exits (it does on its own if the launcher dies)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            os.close(self._orders)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._replies)


class Forked:
    """A cycle's agent, forked by the zygote: what the supervisor needs of a Popen."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._collect(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0)
        return self.returncode

    def _collect(self, timeout: float | None) -> None:
        reply = self.zygote.reply(timeout)
        if reply is not None:
            self.returncode = int(reply["code"])
        elif self.zygote.proc.poll() is not None:
            self.returncode = 1  # the zygote is gone: so is what it waited for

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _serve(orders: int, replies: int) -> None:
    """The zygote: import, then fork an agent per order and report how it ended."""
    # What the agent and every rank need (launch.warm imports the same, in the same order),
    # and torch._dynamo, which every FSDP rank imports (each DTensor is built under
    # torch._compile's disable wrapper, which imports it): 0.9 CPU-s per rank here, paid
    # once per node instead, and never again on a restart. (The agent does not import it:
    # measured slower when each cycle's agent was a new Python importing it again.)
    import torch._dynamo  # noqa: F401
    import torch.distributed.run  # noqa: F401
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401

    import hpcshard.runtime.main  # noqa: F401
    from hpcshard.launch import warm

    stop_signal = RankEnv.from_environ().notice_signal
    with os.fdopen(orders, "rb") as pipe:
        for line in pipe:
            order = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the agent
                code = 1
                try:
                    # As the launcher starts torchrun: the notice ignored (each rank takes it).
                    signal.signal(stop_signal, signal.SIG_IGN)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    # The agent says its pid itself, once it takes TERM: the launcher may send
                    # one at once (a cancel that came while it started), and a TERM before
                    # this point would meet the zygote's "ignore" (measured: the run trained on).
                    os.write(replies, (json.dumps({"pid": os.getpid()}) + "\n").encode())
                    os.close(replies)
                    pipe.close()
                    os.environ.clear()
                    os.environ.update(order["env"])
                    code = warm.main(order["argv"])
                except SystemExit as exit_:
                    code = exit_.code if isinstance(exit_.code, int) else 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            os.write(replies, (json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n").encode())


if __name__ == "__main__":
    console.harden()  # (its console, and its agents' and ranks', may be a file on a full disk)
    # The launcher's TERM and INT are for the agent, not for this process: it ends when the
    # launcher closes its orders (or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(RankEnv.from_environ().notice_signal, signal.SIG_IGN)
    _serve(int(sys.argv[1]), int(sys.argv[2]))
