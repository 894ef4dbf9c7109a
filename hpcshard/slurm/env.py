"""Inside an allocation: the one object that reads Slurm's SLURM_* variables (stdlib)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


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


@dataclass(frozen=True, kw_only=True)
class SlurmEnv:
    """The one object that reads SLURM_* variables."""

    job_id: str
    """This job's own id (an array task has one of its own, the same across requeues)."""
    ref: str
    """How the run's spec, squeue and sacct name it: ARRAY_TASK for an array task (a sweep's),
    else the job id."""
    nodes: list[str]
    node_id: int
    restart_count: int
    gpus_on_node: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmEnv:
        env = os.environ if environ is None else environ
        gpus = env.get("SLURM_GPUS_ON_NODE") or str(len(env.get("CUDA_VISIBLE_DEVICES", "").split(",")))
        ref, restart_count = current_run(env) or (env["SLURM_JOB_ID"], 0)
        return cls(job_id=env["SLURM_JOB_ID"], ref=ref, nodes=expand_nodelist(env["SLURM_JOB_NODELIST"]),
                   node_id=int(env["SLURM_NODEID"]), restart_count=restart_count,
                   gpus_on_node=int(gpus or 0))


def current_run(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The job this process runs in, as the run's spec names it (SlurmEnv.ref), and which
    run of it this is (SLURM_RESTART_COUNT: unset on the first, then 1, 2, ... after each
    requeue); None outside Slurm."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env:
        return None
    task, restarts = env.get("SLURM_ARRAY_TASK_ID"), int(env.get("SLURM_RESTART_COUNT", "0"))
    if task is not None and env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{task}", restarts
    return env["SLURM_JOB_ID"], restarts
