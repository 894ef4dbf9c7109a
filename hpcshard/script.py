"""Bring your own script: any torchrun training script, run unmodified on every node.

`hpcshard submit train.py -- ARGS` (or `-m package.module -- ARGS`) runs the script under
torchrun on every node exactly as `torchrun ... train.py ARGS` would: `__name__` is
"__main__", `sys.argv` is `[train.py, *ARGS]` byte for byte (no shell ever sees ARGS),
and torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) are set. On top
of them each rank gets the HPCSHARD_* variables of `rundir.rankenv.ENV_DOC` (docs/user/scripts.md's
table): the run and checkpoint directories, the attempt, the deadline, the notice signal.

What the rank runs is `hpcshard.entry` (stdlib, before any import of the script), which
installs the preemption notice handler first, copies the rank's output into
RUN_DIR/logs/rank-N.log, runs the script with `runpy`, and turns its exit into a ledger
record: `sys.exit(75)` (`hpcshard.preemption.REQUEUE`) means "stopped, requeue me";
another non-zero exit is recorded with the rank, so a script that fails on every rank is
reported (rank and last log lines) and never requeued.

Stdlib only: the CLI imports this module to check a script before anything is created.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import importlib.util
import os
import runpy
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from hpcshard.errors import UserError
from hpcshard.rundir import events, flight, launchers, ledger, progress
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.proc import clock
from hpcshard.rundir.rankenv import (
    ENV_DOC,
    REQUEUE_EXIT,
    SCRIPT_SIGNALS,
    STACKS_SIGNAL,
    RankEnv,
    script_environ,
    signal_name,
)
from hpcshard.rundir.runlogs import start_line
from hpcshard.rundir.spec import Script
from hpcshard.rundir.store import last_save
from hpcshard.slurm.env import current_run

__all__ = ["ENV_DOC", "SCRIPT_SIGNALS", "check_module", "defines_job", "failures", "last_save", "run"]


# -- on the login node: what is this file, and can it run? --------------------------------

def defines_job(path: Path) -> bool:
    """Does this Python file define an hpcshard job (a top-level `job = ...`)? Read, not
    imported: a training script may start training on import."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as err:
        raise ValueError(f"{path}:{err.lineno}: syntax error: {err.msg}; fix the file") from None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "job" for t in targets):
            return True
    return False


def check_module(name: str) -> str:
    """The file a `-m` module runs from, checked without running it: the module (and its
    packages) must be found, and its source must compile. Returns the file's path."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:  # a parent package that fails to import
        raise ValueError(f"-m {name}: {type(err).__name__}: {err}; check the module name and "
                         "that its package is installed (pip install -e .) or on PYTHONPATH") from None
    if spec is None:
        raise ValueError(f"-m {name}: no module named {name!r}; check the name and that its "
                         "package is installed (pip install -e .) or on PYTHONPATH")
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        main = importlib.util.find_spec(f"{name}.__main__")
        if main is None:
            raise ValueError(f"-m {name}: {name} is a package without __main__.py; name the "
                             "module that trains, e.g. -m {name}.train")
        spec = main
    origin = spec.origin or ""
    if origin.endswith(".py"):
        source = Path(origin).read_bytes()
        try:
            compile(source, origin, "exec")
        except SyntaxError as err:
            raise ValueError(f"-m {name}: {origin}:{err.lineno}: syntax error: {err.msg}") from None
    return origin


# -- on every rank -----------------------------------------------------------------------

class _Tee:
    """A rank's stdout/stderr, also written to its log file (what the launcher shows when
    the rank fails). Python-level: output written by C code goes to the console only."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer...
        return getattr(self._stream, name)


RECEIVED: list[float] = []
"""When this rank's wrapper took the launcher's notice, on the host's boot clock
(`hpcshard.preemption` reads it)."""


def _notice_handler(notice: signal.Signals, script_signal: str) -> Any:
    """The launcher's notice, once, turned into the signal the script listens to."""
    forward = None if script_signal == "none" else signal.Signals[signal_name(script_signal)]

    def handle(_signum: int, _frame: object) -> None:
        if RECEIVED:  # Slurm signals every process of the step and the launcher forwards
            return    # the notice too: the script hears it once
        RECEIVED.append(clock())
        if forward is not None and forward != notice:
            os.kill(os.getpid(), forward)
    return handle


def refuse(run_dir: Path, why: str) -> int:
    """A script that cannot run here, for a reason a restart would meet again (its copy of
    the code was not found: `RunSpec.code_lost`): one line, an end record saying it is the
    user's to fix (the launchers restart nothing), and the user error's exit code, as a
    job's rank does (`runtime.main`)."""
    env = RankEnv.from_environ()
    print(f"error: {why}", file=sys.stderr, flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with contextlib.suppress(OSError):
            ledger.append(run_dir, events.End(attempt=env.attempt, reason=EndReason.ERROR, cycle=env.cycle,
                                              user_error=True, error=why))
    return UserError.exit_code


def run(run_dir: Path, script: Script, early: list[int]) -> int:
    """Run `script` (RunSpec.script) on this rank; returns the rank's exit code. `early`:
    notices that came before the entry point called this."""
    rank = int(os.environ.get("RANK", "0"))
    env = RankEnv.from_environ()
    attempt, notice = env.attempt, env.notice_signal
    handler = _notice_handler(notice, script.signal)
    signal.signal(notice, handler)
    os.environ.update(script_environ(run_dir, attempt, script.signal))
    os.environ.setdefault("HPCSHARD_RESTART_COUNT", "0")
    paths = RunPaths(run_dir)
    paths.logs.mkdir(exist_ok=True)
    log_path = paths.rank_log(rank)
    log = log_path.open("a", buffering=1)
    slurm = current_run()  # where this start begins in the log (`hpcshard logs`: rundir.runlogs)
    log.write(start_line(attempt, env.cycle, os.getpid(), socket.gethostname(),
                         rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1")), slurm[0] if slurm else None)
              + "\n")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)  # type: ignore[assignment]
    # On the node's board from the start: a rank whose process dies is a crash, seen in a
    # poll; `preemption.progress` moves it to "step" (then a hang is seen too). Before its
    # launcher kills a hung rank, it asks for every thread's stack, into this log.
    progress.report("idle", None)
    faulthandler.register(STACKS_SIGNAL, file=log, all_threads=True, chain=False)
    flight.arm(run_dir, attempt, env.cycle)  # before the script makes its process group
    if rank == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        ledger.append(run_dir, events.Start(attempt=attempt, cycle=env.cycle, script=True, world=world,
                                            nodes=world // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                            host=os.uname().nodename))
    if script.cwd and Path(script.cwd).is_dir():
        os.chdir(script.cwd)
    for signum in early:  # a notice that came while the interpreter started
        handler(signum, None)
    failure: dict[str, Any] = {}
    code = _run_main(script, failure)
    # The script is over: a late notice means nothing now, and a Python handler would be
    # reset to the default action (terminate) while the interpreter shuts down.
    signal.signal(notice, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (0, REQUEUE_EXIT):
        progress.report("done", None)  # left on purpose: not a crash, whatever comes next
    if code == REQUEUE_EXIT:
        # Stopped on request (its own checkpoint saved): the launcher requeues. Exit 0, or
        # torchrun would report a failure and tear the other ranks down mid-save.
        if rank == 0:
            ledger.append(run_dir, events.End.of_script(
                attempt=attempt, reason=EndReason.STOP,
                how="the script exited with hpcshard.preemption.REQUEUE",
                save=last_save(run_dir)))
        return 0
    if code and not launchers.over(run_dir, attempt, env.cycle):  # (else: stale, see `over`)
        # What the launcher needs to tell a bug (the same error at the same step again)
        # from a fault: the exception, or the exit code, and the step last reported.
        ledger.append(run_dir, events.RankFailed(
            attempt=attempt, cycle=env.cycle, rank=rank, host=socket.gethostname(), code=code,
            step=progress.LAST["step"], error=failure.get("error", f"exit {code}"),
            message=failure.get("message", ""), log=str(log_path), after_notice=bool(RECEIVED)))
    return code


def _run_main(script: Script, failure: dict[str, Any]) -> int:
    """runpy, as `python train.py ARGS` / `python -m pkg.mod ARGS` would run it. An
    exception is named in `failure` (its type and first line)."""
    target, args = script.target, list(script.args)
    try:
        if script.kind == "module":
            sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = str(Path(target).parent)  # as `python train.py` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        return _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException as err:  # the script's own error: its traceback, in its log
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next  # from the script's first frame: hpcshard's are noise here
        traceback.print_exception(type(err), err, tb)
        text = str(err).strip()
        failure.update(error=type(err).__name__, message=text.splitlines()[0][:300] if text else "")
        return 1
    return 0


def _exit_code(code: object) -> int:
    """sys.exit's argument as the interpreter would turn it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def failures(run_dir: Path, attempt: int, lines: int = 10) -> list[str]:
    """What `submit` and the launcher print when ranks failed: the first failing rank (by
    time) and the last lines of its log, then the other failing ranks."""
    failed = [r for r in ledger.read(run_dir)
              if r.get("event") == "rank_failed" and r.get("attempt") == attempt]
    if not failed:
        return []
    last = max(r.get("cycle", 0) for r in failed)  # the ranks' last start, after restarts
    failed = [r for r in failed if r.get("cycle", 0) == last]
    first = failed[0]
    path = RunPaths(run_dir).rank_log(first["rank"])
    out = [f"rank {first['rank']} failed first (exit {first['code']}); "
           f"the last lines of {path}:"]
    tail = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
    out += [f"  {line}" for line in tail]
    others = sorted({int(r["rank"]) for r in failed[1:]} - {int(first["rank"])})
    if others:
        out.append(f"also failed: rank {', '.join(map(str, others))}")
    return out
