"""A run's `--then` steps (`rundir.chain`), and the followers a continuation carries.

A `--then` step is a one-node Slurm job rendered from the run's own template and settings
(its modules, environment, container: what exports its checkpoints needs what trained
them), with no GPU (one for an evaluation), no requeue, and `--dependency=afterany` on the
run's newest job: it starts once that job has ended, however it ended, and then asks the
ledger (`chain.decide_then`): a run that ended done is exported (or evaluated on its
held-out data, `runtime.evaluate`) from the checkpoint of the very step it finished at;
one that is still going (requeued, continued, taken over by a guard) is waited for again,
by a new job of the same script; one that ended otherwise is skipped, with why. On the
local backend the same step runs in the submitting command once the run has ended here
(`run_step`).

Login node and job: stdlib and `hpcshard.slurm`; the export itself is `hpcshard ckpt
export` or `runtime.evaluate`, in a process of its own (torch is never imported here)."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from hpcshard.rundir import ledger, store
from hpcshard.rundir.chain import Chain, Then, check_fresh, decide_then, done_step, verdict
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.spec import RunSpec
from hpcshard.slurm import cluster
from hpcshard.slurm.arrays import dependency
from hpcshard.slurm.sbatch import SbatchRequest, render


def script(spec: RunSpec, run_dir: Path, index: int, step: Then) -> Path:
    """Write step `index`'s sbatch script (RUN_DIR/then/then-INDEX.sh) from the run's
    recorded request: one node, no GPU, never requeued, the run's template and settings."""
    old = SbatchRequest.recorded(spec.slurm)
    if old is None:
        raise ValueError(f"{run_dir}'s spec.json records no sbatch request: --then needs a Slurm run")
    per_gpu = old.cpus_per_task // max(1, old.gpus_per_node)
    # An export reads the shards on the CPU; an evaluation runs the model's forwards: a GPU.
    gpus = min(1, old.gpus_per_node) if step.what == "eval" else 0
    req = replace(old, job_name=f"{spec.name}-{step.what}"[:100], nodes=1, gpus_per_node=gpus,
                  cpus_per_task=per_gpu, requeue=False, no_kill=False, array="", dependency="",
                  run_dir=run_dir.resolve(), exclude=ledger.bad_slurm_nodes(run_dir))
    folder = RunPaths(run_dir.resolve()).then
    folder.mkdir(exist_ok=True)
    python = shlex.quote(req.python or sys.executable)
    command = f"{python} -u -m hpcshard.launch.then {shlex.quote(str(run_dir.resolve()))} {index}"
    path = folder / f"then-{index}.sh"
    path.write_text(render(req, command, folder))
    return path


def submit_steps(run_dir: Path, job: str) -> list[str]:
    """Submit every `--then` step recorded in the run's chain (by `submit`), each after job
    `job` (the run's first); recorded as the run's followers. Their job ids ("": that step
    was refused, recorded failed with why: the run's job is queued whatever its steps do)."""
    spec = RunSpec.read(run_dir)
    ids = []
    for i, step in enumerate(Chain.read(run_dir).then):
        try:
            new = cluster.sbatch(f"--dependency={dependency([job])}", str(script(spec, run_dir, i, step)))
        except (OSError, ValueError) as err:
            ids.append("")
            _record(run_dir, i, "", "failed", f"not submitted: {err}")
            continue
        ids.append(new)
        _record(run_dir, i, new, "waiting", f"for job {job}")
    return ids


def _record(run_dir: Path, index: int, job: str, state: str, said: str) -> None:
    def change(chain: Chain) -> None:
        step = chain.then[index]
        step.state, step.said = state, said
        if job and job not in step.jobs:
            step.jobs.append(job)
            chain.followers.append({"job": job, "kind": "afterany", "run": ""})
    Chain.update(run_dir, change)


def carry(run_dir: Path, old: str, new: str) -> list[str]:
    """The run goes on under job `new` (a continuation, a guard's take-over): every job
    still waiting on `old` waits on `new` instead, so that "after this run" stays after
    its end. What could not be moved, one line each (a follower that started or ended
    meanwhile has nothing to move; a `--then` step that started checks the ledger)."""
    return [f"follower {follower['job']} still waits on {old}: {err}" for follower, err in move(run_dir, new)]


def move(run_dir: Path, new: str) -> list[tuple[dict[str, str], ValueError]]:
    """Every follower of the run made to wait on job `new` (its own kind of dependency);
    those Slurm refused, with why."""
    refused = []
    for follower in Chain.read(run_dir).followers:
        try:
            cluster.depend(follower["job"], f"{follower['kind']}:{new}")
        except ValueError as err:
            refused.append((follower, err))
    return refused


def carriers(spec: RunSpec, run_dir: Path) -> list[str] | None:
    """The run's jobs that may still carry it: its newest job and the guards of it, those
    pending or running. None: Slurm did not answer about one of them."""
    from hpcshard.rundir.launchers import guarded_job, guards

    newest = spec.jobs[-1] if spec.jobs else None
    if newest is None:
        return []
    asked = [newest, *(g for g in guards(run_dir) if guarded_job(run_dir, g) == newest)]
    out = []
    for job in asked:
        over = cluster.query_job(job).over
        if over is None:
            return None
        if not over:
            out.append(job)
    return out


def run_step(run_dir: Path, index: int, *, slurm: bool = True, job: str = "") -> int:
    """Step `index`, now that the job it waited for has ended: go, wait again, or skip
    (`chain.decide_then`); its exit code (0: done or waiting again)."""
    spec = RunSpec.read(run_dir)
    records = ledger.read(run_dir)
    ended = verdict(records)
    found = carriers(spec, run_dir) if slurm and ended is None else []
    action, what = decide_then(ended, found, spec.jobs[-1] if spec.jobs else None)
    step = Chain.read(run_dir).then[index]
    if action == "wait":
        return _wait(spec, run_dir, index, step, list(what))
    if action == "skip":
        return _end(run_dir, index, job, "skipped", what)
    newest = store.committed(run_dir / store.CHECKPOINTS)
    done = done_step(records)
    stale = check_fresh(done, newest[-1].step if newest else None)
    if stale:
        return _end(run_dir, index, job, "skipped", stale)
    _record(run_dir, index, job, "running", f"step {done}")
    if step.what == "export-hf":  # taken empty at submit; `ckpt export` writes only a new directory
        with contextlib.suppress(OSError):
            Path(step.dir).rmdir()  # (only while still empty: anything written there meanwhile stays)
    python = [sys.executable, "-m"]
    argv = ([*python, "hpcshard.runtime.evaluate", str(run_dir), str(done)] if step.what == "eval"
            else [*python, "hpcshard", "ckpt", "export", str(run_dir), "--step", str(done), "--hf", step.dir])
    proc = subprocess.run(argv, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode:
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
        return _end(run_dir, index, job, "failed", last, proc.returncode)
    if step.what == "eval":  # (its last line: {"step", "eval_loss"}; the metrics have the record)
        loss = json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"]
        return _end(run_dir, index, job, "done", f"eval loss {loss:.4f} at step {done}")
    return _end(run_dir, index, job, "done", f"step {done} written to {step.dir}")


def _wait(spec: RunSpec, run_dir: Path, index: int, step: Then, jobs: list[str]) -> int:
    """The run goes on: this step waits again, as a new job of its script, after `jobs`."""
    path = RunPaths(run_dir).then / f"then-{index}.sh"
    if not path.exists():
        script(spec, run_dir, index, step)
    try:
        new = cluster.sbatch(f"--dependency={dependency(jobs)}", str(path))
    except ValueError as err:
        return _end(run_dir, index, "", "failed", f"the run goes on under job {jobs[0]}, and waiting "
                    f"for it failed: {err}")
    _record(run_dir, index, new, "waiting", f"the run goes on: for job {':'.join(jobs)}")
    print(f"hpcshard: the run goes on (job {', '.join(jobs)}): {step.label} waits for it as job {new}",
          flush=True)
    return 0


def _end(run_dir: Path, index: int, job: str, state: str, said: str, code: int = 1) -> int:
    _record(run_dir, index, job, state, said)
    print(f"hpcshard: then {Chain.read(run_dir).then[index].label}: {state}: {said}",
          file=sys.stderr if state != "done" else sys.stdout, flush=True)
    return 0 if state == "done" else code


def main(argv: list[str] | None = None) -> int:
    """`python -m hpcshard.launch.then RUN_DIR INDEX` (a `--then` job's one task)."""
    from hpcshard.slurm.env import current_run

    args = sys.argv[1:] if argv is None else argv
    run_dir, index = Path(args[0]), int(args[1])
    here = current_run()
    return run_step(run_dir, index, job=here[0] if here else "")


if __name__ == "__main__":
    sys.exit(main())
