"""Inside a Slurm allocation: the Slurm environment (read here and nowhere else), the
rendezvous, and what submitit runs on every node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hpcshard import ledger
from hpcshard.launch.node import NodeEnv, run_node


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur] if p]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed hostlist, in Python (no `scontrol show hostnames` needed inside
    containers): "n[1-2],gpu[01-03,07]" -> n1 n2 gpu01 gpu02 gpu03 gpu07."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        m = re.search(r"\[([^\]]+)\]", part)
        if not m:
            hosts.append(part)
            continue
        head, tail = part[:m.start()], part[m.end():]
        for item in m.group(1).split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.extend(expand_nodelist(f"{head}{i:0{len(lo)}d}{tail}"))
    return hosts


def rdzv_port(job_id: str, restart: int) -> int:
    """A port for this job's rendezvous on its first node, below Linux's ephemeral range.

    Derived from the job id, so every node computes the same one without talking, two jobs
    sharing a node differ, and a requeued attempt does not meet its predecessor's store.
    """
    digits = int(re.sub(r"\D", "", job_id) or 0)
    return 20000 + (digits * 7 + restart * 3) % 10000


@dataclass(frozen=True, kw_only=True)
class SlurmEnv:
    """The one object that reads SLURM_* variables."""

    job_id: str
    nodes: list[str]
    node_id: int
    restart_count: int
    gpus_on_node: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> SlurmEnv:
        env = os.environ if environ is None else environ
        gpus = env.get("SLURM_GPUS_ON_NODE") or str(len(env.get("CUDA_VISIBLE_DEVICES", "").split(",")))
        return cls(job_id=env["SLURM_JOB_ID"], nodes=expand_nodelist(env["SLURM_JOB_NODELIST"]),
                   node_id=int(env["SLURM_NODEID"]),
                   # Unset on the first run, then 1, 2, ... after each requeue.
                   restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
                   gpus_on_node=int(gpus or 0))

    def node_env(self, per_node: int) -> NodeEnv:
        return NodeEnv(node_rank=self.node_id, nnodes=len(self.nodes), per_node=per_node,
                       rdzv_host=self.nodes[0], rdzv_port=rdzv_port(self.job_id, self.restart_count),
                       run_id=f"{self.job_id}-{self.restart_count}")


def requeue(job_id: str) -> str:
    """Ask Slurm to requeue this job; a job that reaches its time limit is never requeued by
    Slurm itself (it ends TIMEOUT), so the job must do it before the limit."""
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    return proc.stderr.strip() if proc.returncode else ""


def node_main(run_dir: str, per_node: int, first_attempt: int, max_requeues: int,
              resume: str = "auto") -> int:
    """What submitit runs in each task: one per node. Returns the node's exit code."""
    slurm = SlurmEnv.from_environ()
    attempt = first_attempt + slurm.restart_count
    os.environ["HPCSHARD_ATTEMPT"] = str(attempt)
    os.environ["HPCSHARD_RESUME"] = resume if slurm.restart_count == 0 else "auto"
    # submitit installed its own SIGUSR2 handler (checkpoint, then requeue from global rank
    # 0 with its own timeout bookkeeping). run_node replaces it: the notice goes to the ranks.
    code = run_node(slurm.node_env(per_node), Path(run_dir))
    if code == ledger.REQUEUE_EXIT and slurm.node_id == 0:
        if slurm.restart_count < max_requeues:
            err = requeue(slurm.job_id)
            ledger.append(Path(run_dir), {"event": "requeue", "attempt": attempt, "job": slurm.job_id,
                                          "error": err or None})
            print(f"hpcshard: requeued job {slurm.job_id}" + (f" (scontrol: {err})" if err else ""),
                  file=sys.stderr, flush=True)
        else:
            ledger.append(Path(run_dir), {"event": "gave_up", "attempt": attempt,
                                          "reason": f"requeue cap reached ({max_requeues})"})
            print(f"hpcshard: not requeued: the cap of {max_requeues} requeues is reached; "
                  f"continue with `hpcshard resume {run_dir}`", file=sys.stderr, flush=True)
    return code
