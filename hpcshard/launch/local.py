"""The local backend: N emulated nodes as local processes, the launcher Slurm will run.

Each "node" is one `hpcshard.launch.node` process running torchrun for its ranks; they
meet through torchrun's static rendezvous on loopback, exactly as nodes meet on a cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from hpcshard.launch.node import NodeEnv
from hpcshard.launch.ports import listen_ports
from hpcshard.launch.procs import descendants, send
from hpcshard.rundir import lease, ledger
from hpcshard.rundir.rankenv import REQUEUE_EXIT, RankEnv

# A node that failed takes the job down: the others get this long to follow (they see
# node 0's decision within a poll) before they are terminated, and as long again before
# what is left of them (a frozen node ignores TERM) is killed. Their exit codes then say
# nothing of the run.
PEER_GRACE_S = 15.0


def free_ports(n: int) -> list[int]:
    """`n` different free ports on loopback, below the ephemeral range (`launch.ports`)."""
    return listen_ports(n, "127.0.0.1")


def run_local(run_dir: Path, nodes: int, per_node: int, *, spares: int = 0, resume: str = "auto",
              max_requeues: int = 10, on_attempt: Callable[[int, int], None] | None = None,
              owner: str = "") -> int:
    """Run the job in `run_dir` on `nodes` x `per_node` local ranks (and `spares` more
    emulated nodes, waiting to take a lost one's place); returns its exit code.

    An attempt that ends with REQUEUE_EXIT (stopped on request, checkpoint committed) is
    started again the way Slurm requeues a job, up to `max_requeues` times; the new
    attempt resumes from the newest checkpoint. `owner`: the lease token of this process,
    which owns the run (`rundir.lease`), for the launchers and ranks.
    """
    attempt = ledger.next_attempt(run_dir)
    requeues = 0
    procs: list[subprocess.Popen[bytes]] = []
    ended: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        ended.append(signum)
        for p in procs:
            p.send_signal(signum)

    # A TERM to the CLI (a job scheduler's kill, `kill PID`, `hpcshard cancel` between two
    # attempts, when no launcher runs) ends the ranks too, not only this process: the
    # launchers pass it to torchrun, which tears its workers down; no attempt starts after.
    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            if ended:  # (a cancel between two attempts: no launcher to hear it)
                return 128 + ended[0]
            procs.clear()
            code = _attempt(run_dir, nodes, per_node, attempt, resume, requeues, spares, owner, procs,
                            forward)
            if code != REQUEUE_EXIT or requeues >= max_requeues:
                return code
            requeues += 1
            if on_attempt:
                on_attempt(attempt + 1, requeues)
            attempt, resume = attempt + 1, "auto"
    finally:
        signal.signal(signal.SIGTERM, previous)


def _attempt(run_dir: Path, nodes: int, per_node: int, attempt: int, resume: str, restarts: int,
             spares: int, owner: str, procs: list[subprocess.Popen[bytes]],
             forward: Callable[[int, object], None]) -> int:
    (port, coord_port), run_id = free_ports(2), uuid.uuid4().hex[:12]
    cores = os.cpu_count() or 1
    for rank in range(nodes + spares):
        node = NodeEnv(node_rank=rank, nnodes=nodes + spares, per_node=per_node, rdzv_host="127.0.0.1",
                       rdzv_port=port, run_id=run_id, coord_port=coord_port)
        ranks = RankEnv(attempt=attempt, resume=resume, restart_count=restarts, owner=owner)
        env = {**os.environ, **node.to_environ(), **ranks.to_environ()}
        # All emulated nodes share this host's cores.
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (nodes * per_node))))
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcshard.launch.node", str(run_dir)],
                                      env=env))
    try:
        return _wait_all(procs, run_dir, attempt)
    except KeyboardInterrupt:
        forward(signal.SIGINT, None)
        return _wait_all(procs, run_dir, attempt)


def _wait_all(procs: list[subprocess.Popen[bytes]], run_dir: Path, attempt: int) -> int:
    """First non-zero exit code wins; survivors of a failed job are stopped after a grace.
    A node the launchers declared lost (it froze: a spare took its place, or the job went
    on with fewer nodes) is killed once another has ended: it will never end by itself."""
    failed_at: float | None = None
    killed: set[int] = set()
    while True:
        codes = [p.poll() for p in procs]
        if any(c is not None for c in codes):
            for n in _lost(run_dir, attempt):
                if n < len(procs) and procs[n].poll() is None:
                    send([*descendants(procs[n].pid), procs[n].pid], signal.SIGKILL)
                    killed.add(procs[n].pid)
            codes = [p.poll() if p.pid not in killed else p.wait() for p in procs]
        if all(c is not None for c in codes):
            # All nodes asking for a requeue is a requeue; any other failure wins over it.
            mine = [c for p, c in zip(procs, codes, strict=True) if p.pid not in killed]
            failures = [c for c in mine if c and c != REQUEUE_EXIT]
            return failures[0] if failures else next((c for c in mine if c), 0)  # type: ignore[return-value]
        if failed_at is None and any(c for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        if failed_at is not None and time.monotonic() - failed_at > 2 * PEER_GRACE_S:
            for p in procs:
                if p.poll() is None:  # a lost node (frozen, stuck): it and all below it
                    send([*descendants(p.pid), p.pid], signal.SIGKILL)
                    killed.add(p.pid)
        time.sleep(0.2)


def _lost(run_dir: Path, attempt: int) -> set[int]:
    return {int(r["node"]) for r in ledger.bad_nodes(run_dir, attempt, lost=True)}


def main(argv: list[str]) -> int:
    """`python -m hpcshard.launch.local RUN_DIR`: run a prepared run directory (a sweep's
    task) on its own shape, as `submit` would, and exit with its code."""
    from hpcshard.rundir.spec import RunSpec

    run_dir = Path(argv[0]).resolve()
    spec = RunSpec.read(run_dir)
    try:
        me = lease.take(run_dir, lease.Owner.of_process("a local sweep's task"), lambda job: None)
    except lease.Busy as err:
        print(f"hpcshard: {err}", file=sys.stderr, flush=True)
        return 2
    try:
        return run_local(run_dir, spec.nodes, spec.gpus, spares=spec.spares,
                         max_requeues=spec.max_requeues, owner=me.token)
    finally:
        lease.release(run_dir, me)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
