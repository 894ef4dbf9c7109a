"""The per-node launcher: read where this node sits, then run torchrun for it.

The same code runs under the local backend (emulated nodes on one machine) and, later,
inside a Slurm allocation; only `NodeEnv.from_environ` differs between them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcshard import script
from hpcshard.launch.procs import Agent, children, send
from hpcshard.launch.supervise import Supervisor
from hpcshard.launch.zygote import Zygote
from hpcshard.rundir import console, events, ledger
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.launchers import write_pid_file
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.rankenv import REQUEUE_EXIT, STORAGE_EXIT, RankEnv
from hpcshard.rundir.spec import RunSpec, Script
from hpcshard.rundir.store import last_save


@dataclass(frozen=True, kw_only=True)
class NodeEnv:
    """The one object that knows where this node sits in the job."""

    node_rank: int
    nnodes: int
    per_node: int
    rdzv_host: str
    rdzv_port: int
    run_id: str
    coord_port: int = 0
    """Where node 0's launcher serves the launchers' store (`launch.coord`); 0: none, the
    launchers coordinate through the run directory's files."""

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> NodeEnv:
        """The local backend passes the node's identity as HPCSHARD_* variables."""
        env = os.environ if environ is None else environ
        return cls(node_rank=int(env["HPCSHARD_NODE_RANK"]), nnodes=int(env["HPCSHARD_NNODES"]),
                   per_node=int(env["HPCSHARD_PER_NODE"]), rdzv_host=env["HPCSHARD_RDZV_HOST"],
                   rdzv_port=int(env["HPCSHARD_RDZV_PORT"]), run_id=env["HPCSHARD_RUN_ID"],
                   coord_port=int(env.get("HPCSHARD_COORD_PORT") or 0))

    def to_environ(self) -> dict[str, str]:
        return {"HPCSHARD_NODE_RANK": str(self.node_rank), "HPCSHARD_NNODES": str(self.nnodes),
                "HPCSHARD_PER_NODE": str(self.per_node), "HPCSHARD_RDZV_HOST": self.rdzv_host,
                "HPCSHARD_RDZV_PORT": str(self.rdzv_port), "HPCSHARD_RUN_ID": self.run_id,
                "HPCSHARD_COORD_PORT": str(self.coord_port)}


def torchrun_argv(node: NodeEnv, run_dir: Path, module: str = "hpcshard.entry",
                  warm: bool = False) -> list[str]:
    """torchrun for one node: the static rendezvous, on node_rank 0's host.

    Static, not c10d: c10d's rendezvous times its participants' keep-alives and deadlines
    by each host's wall clock (`datetime.now()` written by one agent, compared by another:
    torch's dynamic_rendezvous), and with clocks 30 s apart a job's agents hung after its
    ranks had finished (measured on the local Slurm's skewed nodes). Static takes the node
    ranks as given, and each agent's workers get contiguous ranks, so the mesh's shard
    dimension stays inside one node. `warm`:
    the same agent and options through `hpcshard.launch.warm`, whose ranks are forks of
    an agent that imported torch and the runtime once (hpcshard jobs only).
    """
    options = [f"--nnodes={node.nnodes}", f"--nproc_per_node={node.per_node}",
               "--rdzv_backend=static", f"--node_rank={node.node_rank}",
               f"--rdzv_endpoint={node.rdzv_host}:{node.rdzv_port}",
               f"--rdzv_id={node.run_id}", "--max_restarts=0"]
    if warm:
        return [sys.executable, "-m", "hpcshard.launch.warm", *options, str(run_dir)]
    return [sys.executable, "-m", "torch.distributed.run", *options, "-m", module, str(run_dir)]


def warm_start(module: str, script: Script | None) -> bool:
    """Fork warm ranks for hpcshard jobs unless HPCSHARD_WARM_START=0 (see launch.warm)."""
    return module == "hpcshard.entry" and script is None and os.environ.get("HPCSHARD_WARM_START") != "0"


def run_node(node: NodeEnv, run_dir: Path, stop_signal: int = RankEnv().notice_signal,
             module: str = "hpcshard.entry", local: bool = False) -> int:
    """Run this node's ranks; return the exit code, or REQUEUE_EXIT when the ranks stopped
    on request (the run continues in a requeued attempt). An hpcshard job's ranks are
    supervised (`launch.supervise`), an own script's too: a rank that dies (or, once it
    reports progress, hangs) is restarted with all the others, inside the allocation, from
    the newest checkpoint.

    INT and TERM go to torchrun, which forwards them to its workers and tears them down.
    The stop signal does not: torchrun forwards only INT/TERM/HUP/QUIT (pytorch issue
    154849) and an unhandled SIGUSR2 would kill torchrun itself. So the launcher takes it
    and hands it to torchrun's children, the ranks: an hpcshard job stops at the next step
    boundary; a script gets its own signal (`script_signal`) and, if it is still running
    after the grace period (`script_grace`), its ranks are killed.
    """
    console.harden()  # (under Slurm its console is a file in the run directory, which may fill)
    # (doctor's smoke test runs a module without a spec)
    spec = RunSpec.read(run_dir) if RunPaths(run_dir).spec.exists() else None
    own = spec.script if spec else None
    env = dict(os.environ)
    # torchrun would set 1 with a warning; on a CPU host, split the cores between ranks.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // node.per_node)))

    warm = warm_start(module, own)
    # Every cycle's warm agent forks from one zygote: a restart imports nothing again.
    zygotes = [Zygote(env)] if warm and spec is not None else []

    def start(where: NodeEnv, extra: dict[str, str]) -> Agent:
        argv = torchrun_argv(where, run_dir, module, warm)
        if zygotes:  # (it ignores the notice in the agent, as below)
            if zygotes[-1].proc.poll() is not None:  # it died (the OOM killer, a stray kill)
                print(f"hpcshard: node {node.node_rank}: the zygote exited "
                      f"({zygotes[-1].proc.returncode}); starting a new one", file=sys.stderr, flush=True)
                zygotes[-1].close()
                zygotes.append(Zygote(env))
                zygotes[-1].waiting = zygotes[0].waiting
            return zygotes[-1].start(argv[3:], {**env, **extra})
        # Slurm's --signal goes to every process of the step, torchrun included, and an
        # unhandled SIGUSR2 kills it mid-save. Ignored dispositions survive exec: torchrun
        # ignores the notice, and each rank's entry point installs its own handler first.
        return subprocess.Popen(argv, env={**env, **extra},
                                preexec_fn=lambda: signal.signal(stop_signal, signal.SIG_IGN))

    ranks = RankEnv.from_environ()
    grace = spec.grace_s if spec is not None else 0.0
    sup = (Supervisor(node, run_dir, spec, ranks, start, grace=grace if own else None, local=local)
           if spec is not None and module == "hpcshard.entry" else None)
    proc: list[Agent] = []
    if zygotes and sup is not None:
        zygotes[0].waiting = sup.beat

    def current() -> Agent | None:
        return sup.proc if sup is not None else (proc[0] if proc else None)

    def forward(signum: int, _frame: object) -> None:
        if sup is not None:  # (the supervisor hands it to an agent that starts later)
            sup.ending = signum
        if (p := current()) is not None:
            p.send_signal(signum)
            if sup is not None:
                sup.ending_sent = True

    def to_ranks(signum: int, _frame: object) -> None:
        if sup is not None:  # it tells every rank that is up, or comes up later, within a poll
            if sup.noticed is None:
                sup.noticed = time.monotonic()
        elif (p := current()) is not None:
            send(children(p.pid), signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    signal.signal(stop_signal, to_ranks)
    pids = _pid_file(run_dir, node.node_rank)
    try:
        if sup is not None:
            code = sup.run()
        else:  # doctor's smoke test: no spec, nothing to supervise
            proc.append(start(node, {}))
            code = proc[0].wait()
    finally:
        if pids is not None:
            with contextlib.suppress(OSError):
                pids.unlink(missing_ok=True)
        if zygotes:
            zygotes[-1].close()
        # No ranks left to tell. A Python handler would be reset to "terminate" while the
        # interpreter shuts down, and a late notice would then kill this task (-12).
        signal.signal(stop_signal, signal.SIG_IGN)
    if sup is not None and sup.fenced:
        return 0  # it left the run while the others went on: nothing of it is its to say
    if own and sup is not None:
        return _script_outcome(run_dir, sup.me == sup.roster.leader, ranks.attempt, code,
                               noticed=sup.noticed is not None, killed=sup.killed, grace=grace)
    try:
        end = ledger.end_of(run_dir, ranks.attempt)
    except OSError:  # (the run directory cannot be read: the supervisor's code says it all)
        end = None
    if end is not None and end.get("reason") == EndReason.STOP:
        return REQUEUE_EXIT
    if end is not None and end.get("reason") == EndReason.STORAGE:  # (the agent says 1 for any rank's exit)
        return STORAGE_EXIT
    return code


def _pid_file(run_dir: Path, node_rank: int) -> Path | None:
    """This launcher's pid file; None (said in one line) where the run directory refuses it:
    the supervisor's probe then stops the run for its storage, in a line of its own, and
    no traceback comes before it."""
    try:
        return write_pid_file(run_dir, node_rank)
    except OSError as err:
        print(f"hpcshard: node {node_rank}: its pid file could not be written ({err})", file=sys.stderr,
              flush=True)
        return None


def _script_outcome(run_dir: Path, first: bool, attempt: int, code: int, *, noticed: bool,
                    killed: bool, grace: float) -> int:
    """A script knows nothing of the ledger: each node's launcher decides what its exit
    means, and the cycle's leader (`first`: node 0 unless it was lost) records it. After a
    notice every exit is a stop and the job is requeued, a clean one too: a framework may
    save on SIGTERM and return from its loop as if it were done, and a run that quietly
    ended early is worse than one more short attempt that resumes from the end. Without a
    notice, a failure is reported and never requeued."""
    end = ledger.end_of(run_dir, attempt)
    if end is not None and end.get("reason") == EndReason.STOP:
        return REQUEUE_EXIT
    if code == REQUEUE_EXIT:  # the supervisor's: faults spent this allocation's restarts
        if first and end is None:
            ledger.append(run_dir, events.End.of_script(attempt=attempt, reason=EndReason.FAULT,
                                                        how="the restart budget is spent: requeued",
                                                        save=last_save(run_dir)))
        return code
    if noticed:
        if first and end is None:
            how = (f"killed {grace:g}s after the notice (the grace period)" if killed
                   else f"exited {code} after the notice")
            ledger.append(run_dir, events.End.of_script(attempt=attempt, reason=EndReason.STOP, how=how,
                                                        save=last_save(run_dir)))
        return REQUEUE_EXIT
    if first and end is None:
        if code == 0:
            saved = last_save(run_dir)
            ledger.append(run_dir, events.End(attempt=attempt, reason=EndReason.DONE,
                                              saved_step=saved["saved_step"], saved=saved["saved"]))
        else:
            ledger.append(run_dir, events.End(attempt=attempt, reason=EndReason.ERROR, error=f"exit {code}"))
    if first and code:  # (the supervisor may have closed the attempt: a bug, a give-up)
        for line in script.failures(run_dir, attempt):
            print(f"hpcshard: {line}", file=sys.stderr, flush=True)
    return code


def main() -> int:
    """A node of the local backend (`launch.local` starts one process per node)."""
    return run_node(NodeEnv.from_environ(), Path(sys.argv[1]),
                    stop_signal=RankEnv.from_environ().notice_signal, local=True)


if __name__ == "__main__":
    sys.exit(main())
