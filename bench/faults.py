"""Faults inside the allocation, 2x2 demo on the local backend: a rank SIGKILLed (a crash)
and a rank SIGSTOPped (a hang), alternately, REPEATS times each in one run. Per fault:
detection (injected -> declared for the job), kill (declared -> every node down), decide,
restart (decision -> the new ranks' interpreters), set-up (imports, rendezvous, model,
checkpoint load) and first step; recovery is declared -> the first step that advances
training. Targets: crash detected <= 1 s, hang <= max(3 x median step, 5 s), recovery
<= 10 s. Beside it, in the same run, the same faults under plain `torchrun --max-restarts`
with gloo's timeout lowered to 20 s, as a user would (the minimal FSDP2 loop, no
checkpoint to load): injected -> the first step of the restarted workers
(HPCSHARD_BENCH_TORCHRUN=0 leaves it out: it takes about 5 minutes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import PY, RESULTS, ROOT, Metric, env, median, records, save, show, wait
from hpcshard.rundir import ledger

NAME = "faults"
REPEATS = 5
TORCHRUN_REPEATS = 3



def _ranks(run_dir: Path) -> list[int]:
    from hpcshard.launch.procs import ranks_below
    from hpcshard.rundir.launchers import launchers

    return ranks_below(launchers(run_dir))


def _inject(run_dir: Path, kind: str) -> tuple[float, int]:
    """Fault one rank (not rank 0's process: its node hosts the rendezvous), once the
    current cycle has trained 13 steps; returns when and which cycle it hit."""
    cycle = sum(1 for r in ledger.read(run_dir) if r["event"] == "fault")
    since = wait(lambda: _resumed(run_dir, cycle), 300, f"cycle {cycle} to start")
    wait(lambda: sum(1 for r in records(run_dir) if "loss" in r and r["time"] > since) >= 13, 300,
          f"cycle {cycle} to train 13 steps")
    victim = _ranks(run_dir)[-1]
    os.kill(victim, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
    return time.time(), cycle


def _breakdown(run_dir: Path, injected: float, cycle: int) -> dict[str, float]:
    led = ledger.read(run_dir)
    fault = next(r for r in led if r["event"] == "fault" and r["cycle"] == cycle)
    downs = [json.loads(p.read_text()) for p in (run_dir / "launch").glob(f"down-0-{cycle}-*.json")]
    start = next(r for r in records(run_dir) if r.get("event") == "start" and r["time"] > fault["time"])
    first = next(r for r in records(run_dir) if "loss" in r and r["time"] > start["time"])
    boot = start["startup"]
    return {"detect": fault["declared"] - injected,
            "kill": max(d["time"] for d in downs) - fault["declared"],
            "decide": fault["time"] - max(d["time"] for d in downs),
            "restart": boot["entry"] - fault["time"],
            "setup": boot["loaded"] - boot["entry"],
            "first_step": first["time"] - boot["loaded"],
            "recovery": first["time"] - fault["declared"]}


def _stamps(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    return [(int(a), int(b), float(c)) for a, b, c in
            (line.split() for line in path.read_text().splitlines() if line.count(" ") == 2)]


def torchrun_faults(repeats: int = TORCHRUN_REPEATS) -> dict[str, list[float]]:
    """Injected -> first step of the restarted workers, under plain torchrun. Two things a
    user must do for torchrun to restart at all (torch 2.13): the mesh's subgroups get the
    timeout too (minimal_fsdp.py; else a hang waits 30 min), and the rendezvous store is not
    shared with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the shared store keeps the
    previous attempt's gloo addresses under the same keys, so every restart fails in
    connectFullMesh with "Connection refused"; pytorch/pytorch#135712)."""
    from hpcshard.launch.procs import alive, children, kill_tree

    def worker(rank: int) -> int:
        """torchrun's worker of global rank `rank`, by its environment (not by the order of
        torchrun's children, which are not necessarily all workers)."""
        for pid in children(proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and alive(pid):
                return pid
        raise RuntimeError(f"no worker of rank {rank} below torchrun")

    out: dict[str, list[float]] = {"crash": [], "hang": []}
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        stamps, log = Path(tmp) / "stamps", Path(tmp) / "torchrun.log"
        argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                f"--max-restarts={2 * repeats}", "bench/minimal_fsdp.py", "--steps", "1000000",
                "--nodes", "2", "--timeout", "20", "--stamps", str(stamps), "--log-every", "1000000"]
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                    stdout=sink, stderr=subprocess.STDOUT)
        try:
            for kind in ["crash", "hang"] * repeats:
                restart = max((r for r, _, _ in _stamps(stamps)), default=0)
                wait(lambda r=restart: sum(1 for x in _stamps(stamps) if x[0] == r) >= 10, 300,
                     "torchrun's workers to train 10 steps")
                victim = worker(3)  # not rank 0: it writes the stamps
                os.kill(victim, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
                injected = time.time()
                first = wait(lambda r=restart: next((t for x, _, t in _stamps(stamps) if x > r), None),
                             300, "torchrun to restart its workers")
                out[kind].append(first - injected)
                print(f"  torchrun: {kind} -> training again in {first - injected:.1f} s", flush=True)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; torchrun's output ends:\n{log.read_text()[-3000:]}") from e
        finally:
            kill_tree(proc)  # type: ignore[arg-type]
    return out


def main(repeats: int = REPEATS) -> list[Metric]:
    kinds = ["crash", "hang"] * repeats
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=RESULTS) as tmp:
        run_dir = Path(tmp) / "run"
        # Saves every 10 steps, faults 13 steps after a (re)start: every cycle commits before
        # its fault (else the no-progress rule stops the run), and a fault lands in a step,
        # where the learned limit applies (a save and the warm-up get watchdog_phase_s).
        sets = {"steps": 100000, "log_every": 1, "eval_every": 0, "ckpt_every": 10, "keep_last": 2}
        argv = [PY, "-m", "hpcshard", "submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py",
                "--run-dir", str(run_dir), "--max-restarts", str(len(kinds) + 1),
                *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
        proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        rows: dict[str, list[dict[str, float]]] = {"crash": [], "hang": []}
        steps: list[float] = []
        try:
            for kind in kinds:
                injected, cycle = _inject(run_dir, kind)
                print(f"  {kind} in cycle {cycle}", flush=True)
                since = wait(lambda c=cycle: _resumed(run_dir, c + 1), 300, "the restart")
                wait(lambda t=since: any("loss" in r and r["time"] > t for r in records(run_dir)),
                      120, "a step of the restarted ranks")
                rows[kind].append(_breakdown(run_dir, injected, cycle))
            times = [r["time"] for r in records(run_dir) if "loss" in r]
            steps = [b - a for a, b in zip(times, times[1:], strict=False) if b - a < 2]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    step = median(steps)
    metrics = [Metric(NAME, "median step (2x2, between faults)", step * 1e3, "ms")]
    for kind, limit in (("crash", 1.0), ("hang", max(3 * step, 5.0))):
        for part in ("detect", "kill", "decide", "restart", "setup", "first_step", "recovery"):
            value = median([r[part] for r in rows[kind]])
            target = {"detect": limit, "recovery": 10.0}.get(part)
            metrics.append(Metric(NAME, f"{kind}: {part} (median of {len(rows[kind])})", value, "s",
                                  f"<= {target:.1f} s" if target else "",
                                  value <= target if target else None))
    plain = torchrun_faults() if os.environ.get("HPCSHARD_BENCH_TORCHRUN") != "0" else {}
    for kind in plain:
        ours = median([r["detect"] + r["recovery"] for r in rows[kind]])
        theirs = median(plain[kind])
        metrics.append(Metric(NAME, f"{kind}: injected -> training again, hpcshard / torchrun "
                              f"--max-restarts (gloo timeout 20 s)", ours / theirs, "x",
                              note=f"{ours:.1f} s vs {theirs:.1f} s"))
    save(NAME, metrics, {"faults": rows, "step_s": step, "torchrun": plain})
    return metrics


def _resumed(run_dir: Path, cycle: int) -> float | None:
    """When cycle `cycle` started training (its ledger start record), once it has."""
    starts = [r for r in ledger.read(run_dir) if r["event"] == "start" and r.get("cycle") == cycle]
    return float(starts[0]["time"]) if starts else None


if __name__ == "__main__":
    show(main())
