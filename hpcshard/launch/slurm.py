"""Inside a Slurm allocation: the Slurm environment (read here and nowhere else), the
rendezvous, and what submitit runs on every node."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcshard import ledger
from hpcshard.checkpoints import write_atomic
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
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    except OSError as err:  # e.g. inside a container without Slurm's client commands
        return f"scontrol: {err.strerror}; the launcher's environment (its container) needs Slurm's client"
    return proc.stderr.strip() if proc.returncode else ""


POLICIES = ("requeue", "chain", "none")


def show_job(job_id: str, timeout: float | None = None) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict, times in ISO form whatever the site's
    SLURM_TIME_FORMAT; None when scontrol is missing, fails or hangs past `timeout`.
    Stdlib: the login node's `hpcshard.slurm.job_state` reads Slurm through it too."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode:
        return None
    return {key: value for key, sep, value in (t.partition("=") for t in proc.stdout.split()) if sep}


def requeued_by_other(job_id: str, restart_count: int) -> str:
    """Has something else in the job (the script's framework) requeued it already? Slurm
    counts requeues in Restarts before the steps are even killed; a second requeue would
    cost the run a whole extra attempt. Returns what Slurm says, or "" if not."""
    info = show_job(job_id, timeout=30) or {}
    restarts = int(info.get("Restarts", restart_count) or restart_count)
    state = info.get("JobState", "")
    if restarts > restart_count or state in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING"):
        return f"JobState={state} Restarts={restarts}"
    return ""


def end_time(job_id: str) -> int | None:
    """When the job's time limit ends (Unix time), for HPCSHARD_DEADLINE."""
    text = (show_job(job_id, timeout=30) or {}).get("EndTime", "")
    try:
        return int(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def chain(run_dir: Path, job_id: str, attempt: int) -> str:
    """Submit a continuation of this job that starts when it ends (`afterany`): the same
    script and submitit pickle under a new job id. Returns the new id."""
    folder = run_dir / "submitit"
    proc = subprocess.run(["sbatch", "--parsable", f"--dependency=afterany:{job_id}",
                           str(folder / f"{job_id}_submission.sh")], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip() or "sbatch failed")
    new = proc.stdout.strip().split(";")[0]
    shutil.copy(folder / f"{job_id}_submitted.pkl", folder / f"{new}_submitted.pkl")
    (run_dir / "launch").mkdir(exist_ok=True)
    (run_dir / "launch" / f"job-{new}.attempt").write_text(f"{attempt}\n")
    spec_path = run_dir / "spec.json"
    spec = json.loads(spec_path.read_text())
    spec["jobs"] = [*spec.get("jobs", []), new]
    write_atomic(spec_path, json.dumps(spec, indent=2) + "\n")
    return new


def superseded(run_dir: Path, job_id: str) -> bool:
    """Only the run's newest job may train: a stale requeue or a second continuation
    exits at once instead of racing it for the checkpoints."""
    jobs = json.loads((run_dir / "spec.json").read_text()).get("jobs", [])
    return bool(jobs) and jobs[-1] != job_id


def node_main(run_dir: str, per_node: int, first_attempt: int, max_requeues: int,
              resume: str = "auto", policy: str = "requeue") -> int:
    """What submitit runs in each task: one per node. Returns the node's exit code."""
    slurm = SlurmEnv.from_environ()
    run = Path(run_dir)
    if superseded(run, slurm.job_id):
        print(f"hpcshard: job {slurm.job_id} is not the run's newest job; exiting", file=sys.stderr)
        return 0
    chained = run / "launch" / f"job-{slurm.job_id}.attempt"
    attempt = (int(chained.read_text()) if chained.exists() else first_attempt) + slurm.restart_count
    os.environ["HPCSHARD_ATTEMPT"] = str(attempt)
    fresh = slurm.restart_count == 0 and not chained.exists()
    os.environ["HPCSHARD_RESUME"] = resume if fresh else "auto"
    # The profile's notice (--signal in the sbatch script): the ranks listen for it too.
    name = json.loads((run / "spec.json").read_text()).get("slurm", {}).get("signal", "USR2")
    notice = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    os.environ["HPCSHARD_STOP_SIGNAL"] = notice.name
    os.environ["HPCSHARD_RESTART_COUNT"] = str(slurm.restart_count)
    deadline = end_time(slurm.job_id)
    if deadline:
        os.environ["HPCSHARD_DEADLINE"] = str(deadline)
    # submitit installed its own SIGUSR2 handler (checkpoint, then requeue from global rank
    # 0 with its own timeout bookkeeping). run_node replaces it: the notice goes to the ranks.
    code = run_node(slurm.node_env(per_node), run, stop_signal=notice)
    if code == ledger.REQUEUE_EXIT and slurm.node_id == 0:
        _continue(run, slurm, attempt, first_attempt, max_requeues, policy)
    return code


def _continue(run: Path, slurm: SlurmEnv, attempt: int, first_attempt: int, max_requeues: int,
              policy: str) -> None:
    # Continuations since this submission: `hpcshard resume` starts a fresh count.
    done = sum(1 for r in ledger.read(run)
               if r["event"] in ("requeue", "chain") and r["attempt"] >= first_attempt)
    if policy == "none" or done >= max_requeues:
        why = "the requeue policy is none" if policy == "none" else f"the cap of {max_requeues} is reached"
        ledger.append(run, {"event": "gave_up", "attempt": attempt, "reason": why})
        print(f"hpcshard: not continued: {why}; continue with `hpcshard resume {run}`",
              file=sys.stderr, flush=True)
        return
    if policy == "chain":
        try:
            new = chain(run, slurm.job_id, attempt + 1)
        except (OSError, RuntimeError) as err:
            ledger.append(run, {"event": "gave_up", "attempt": attempt, "reason": f"chain failed: {err}"})
            return
        ledger.append(run, {"event": "chain", "attempt": attempt, "job": slurm.job_id, "next": new})
        print(f"hpcshard: continuation job {new} submitted (afterany:{slurm.job_id})",
              file=sys.stderr, flush=True)
        return
    by = requeued_by_other(slurm.job_id, slurm.restart_count)
    if by:  # e.g. Lightning's own SIGUSR1 handler runs `scontrol requeue`: never twice
        ledger.append(run, {"event": "requeue", "attempt": attempt, "job": slurm.job_id,
                            "by": "the job itself", "state": by})
        print(f"hpcshard: job {slurm.job_id} was already requeued ({by}); not requeued again",
              file=sys.stderr, flush=True)
        return
    refused = requeue(slurm.job_id)
    ledger.append(run, {"event": "requeue", "attempt": attempt, "job": slurm.job_id,
                        "error": refused or None})
    print(f"hpcshard: requeued job {slurm.job_id}" + (f" (scontrol: {refused})" if refused else ""),
          file=sys.stderr, flush=True)
