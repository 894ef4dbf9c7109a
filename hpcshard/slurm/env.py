"""Inside an allocation: the one object that reads Slurm's SLURM_* variables (stdlib)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field


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
    step_id: str = ""
    """This task's job step (SLURM_STEP_ID; "" outside a step)."""
    step_nodes: list[str] = field(default_factory=list)
    """The step's own nodes (SLURM_STEP_NODELIST), which a step in an allocation you hold
    may take fewer of than the job has (`hpcshard run`)."""
    node_name: str = ""
    """This node's name as Slurm knows it (SLURMD_NODENAME)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmEnv:
        env = os.environ if environ is None else environ
        gpus = env.get("SLURM_GPUS_ON_NODE") or str(len(env.get("CUDA_VISIBLE_DEVICES", "").split(",")))
        ref, restart_count = current_run(env) or (env["SLURM_JOB_ID"], 0)
        return cls(job_id=env["SLURM_JOB_ID"], ref=ref, nodes=expand_nodelist(env["SLURM_JOB_NODELIST"]),
                   node_id=int(env["SLURM_NODEID"]), restart_count=restart_count,
                   gpus_on_node=int(gpus or 0), step_id=env.get("SLURM_STEP_ID", ""),
                   step_nodes=expand_nodelist(env.get("SLURM_STEP_NODELIST", "")),
                   node_name=env.get("SLURMD_NODENAME", ""))

    @property
    def step_rank(self) -> int:
        """This node's place among the step's nodes (the job's SLURM_NODEID where the step
        spans the whole job, or Slurm did not say which nodes the step has)."""
        if self.node_name in self.step_nodes:
            return self.step_nodes.index(self.node_name)
        return self.node_id


@dataclass(frozen=True, kw_only=True)
class Held:
    """An allocation the user holds (`salloc`), as its shell sees it: what `hpcshard run`
    may start its launchers on with `srun`, no new job."""

    job_id: str
    nodes: list[str]
    gpus_per_node: int | None
    """GPUs on each node, where salloc's options say (`--gpus-per-node`, `--gres=gpu:N`);
    None: not said (a site that gives whole nodes)."""
    step_id: str = ""
    """Set where the shell itself runs in a step (LaunchParameters=use_interactive_step):
    the launchers' step then overlaps it."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Held | None:
        """The allocation this shell holds; None outside one. A batch script's environment
        (SLURM_JOB_ID too) counts: its steps are launched the same way."""
        env = os.environ if environ is None else environ
        if not env.get("SLURM_JOB_ID"):
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        return cls(job_id=env["SLURM_JOB_ID"], nodes=expand_nodelist(nodelist),
                   gpus_per_node=_gpus_per_node(env), step_id=env.get("SLURM_STEP_ID", ""))


def _gpus_per_node(env: Mapping[str, str]) -> int | None:
    """salloc's GPUs per node: `--gpus-per-node=[type:]N` (SLURM_GPUS_PER_NODE) or
    `--gres=gpu[:type]:N` (SLURM_JOB_GRES / SLURM_GRES, e.g. "gpu:a100:4"); None when
    neither says."""
    per_node = env.get("SLURM_GPUS_PER_NODE", "")
    if per_node:
        count = per_node.rsplit(":", 1)[-1].split("(")[0]
        return int(count) if count.isdigit() else None
    for gres in (env.get("SLURM_JOB_GRES", ""), env.get("SLURM_GRES", "")):
        if (found := parse_gpus_per_node(gres)) is not None:
            return found
    return None


def parse_gpus_per_node(tres: str) -> int | None:
    """GPUs per node in a gres or TRES text: squeue's `%b` ("gres:gpu:4", "gres/gpu:a100:4"),
    salloc's SLURM_JOB_GRES ("gpu:a100:4"); several types comma-separated are summed; None
    when it names no GPU count. One reading for the environment and for Slurm's answer."""
    total, found = 0, False
    for item in tres.split(","):
        parts = item.strip().replace("/", ":").split("(")[0].split(":")
        if parts and parts[0] == "gres":
            parts = parts[1:]
        if parts and parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total, found = total + int(parts[-1]), True
    return total if found else None


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
