"""The chaos soak: the 2x2 demo on the local Slurm cluster (2 nodes and a spare), with faults
injected at random (seeded) until FAULTS have landed, INTERVAL apart on average (0.5 to 1.5
times it); then the run trains to its end without anyone's help.

Faults, each as it happens on a real cluster:
    rank_kill    SIGKILL of one rank (a crash, an OOM kill)
    rank_hang    SIGSTOP of one rank (a hang: the watchdog must see it)
    node_kill    SIGKILL of every process of a node, slurmd included (a dead node)
    node_freeze  SIGSTOP of every process of a node (a node off the network)
    node_down    `scontrol update State=DOWN` of a node in use (an admin, a health daemon)
    drain        `scontrol update State=DRAIN` of a node in use (the job may finish there)
    preempt      a job in partition `high` on one of the run's nodes (Slurm's preemption)
    disk_full    the run directory's filesystem filled just before a save, freed once it failed

Measured, not computed: the effective training time of the whole soak from the ledger and
the metrics (`hpcshard status --goodput`), each fault's cost (the wall time from it to the
next, less what that window spent training new steps, saving and evaluating: the same
accounting cut at the faults), the figure at one fault per 15 minutes from those costs and
the measured save stall (saves are async, as a run that saves often should), that no node
declared bad is used again, and that every step trained again after a fault gives the loss
it gave the first time, bit for bit (the state and the data order resumed exactly; a run on
a spare keeps the shape, the mesh is not re-planned).

The local cluster's settings that make this faster than a default Slurm (said in the
output): cred_expire=10 (a requeued job waits 10 s, not 120), sched_interval=2.

On NFS-like storage (HPCSHARD_CHAOS_NFS: the views' bindfs cache options, NFS's defaults
`entry_timeout=30,negative_timeout=30,attr_timeout=3`): every node of the cluster and this
host see the run directory through a view of their own with those caches
(scripts/local-slurm's HPCSHARD_SLURM_SHARED, its backing directory the soak's small
tmpfs); the results are saved as `chaos-nfs`, beside the plain soak's, and say whether a
node that no fault touched was ever declared bad.

Environment: HPCSHARD_CHAOS_SEED, HPCSHARD_CHAOS_INTERVAL (s), HPCSHARD_CHAOS_FAULTS,
HPCSHARD_CHAOS_KINDS (comma-separated subset), HPCSHARD_CHAOS_NFS."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, Metric, env, hpcshard, records, run, save, show, wait
from hpcshard.rundir import launchers, ledger
from hpcshard.rundir.goodput import account, between, timeline

NFS = os.environ.get("HPCSHARD_CHAOS_NFS", "")
NAME = "chaos-nfs" if NFS else "chaos"
SCRIPT = ROOT / "scripts" / "local-slurm"
SLURM_DIR = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm"))
CONF = SLURM_DIR / "etc" / "slurm.conf"
KINDS = ("rank_kill", "rank_hang", "node_kill", "node_freeze", "node_down", "drain", "preempt", "disk_full")
NODE_KINDS = ("node_kill", "node_freeze", "node_down", "drain")
"""Faults that take a node out of the partition for good (the run never uses it again)."""
CLUSTER = 9
"""Nodes in partitions low/high: the run's 3 and room for every node fault of a soak."""
SEED = int(os.environ.get("HPCSHARD_CHAOS_SEED", "15"))
INTERVAL = float(os.environ.get("HPCSHARD_CHAOS_INTERVAL", "120"))
FAULTS = int(os.environ.get("HPCSHARD_CHAOS_FAULTS", "12"))
STEP_S = 0.39
"""The 2x2 demo's step here (measured): the run's length is sized from it."""
DISK_MB = 256
PER_15 = 900.0


class Soak:
    """One run under faults: where it is, and the faults done to it."""

    def __init__(self, run_dir: Path, e: dict[str, str], rng: random.Random) -> None:
        self.run_dir, self.e, self.rng = run_dir, e, rng
        self.faults: list[dict[str, Any]] = []
        self.frozen: list[str] = []
        self.out: set[str] = set()
        """Slurm nodes taken out of the partition (killed, frozen, down, drained)."""

    def slurm(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.e, capture_output=True, text=True)

    def where(self) -> dict[str, Any] | None:
        """The attempt and cycle training now, their active nodes and which Slurm node each
        is; None while the run is not training."""
        led = ledger.read(self.run_dir)
        starts = [r for r in led if r["event"] == "start"]
        if not starts:
            return None
        start = starts[-1]
        attempt, cycle = start["attempt"], start["cycle"]
        if any(r["event"] in ("fault", "end") and r["attempt"] == attempt and r.get("cycle", 0) >= cycle
               for r in led):
            return None  # between a fault (or a stop) and the next start
        if not any("loss" in r and r["time"] > start["time"] for r in records(self.run_dir)[-5:]):
            return None  # not training yet
        slurm = trained_on(self.run_dir, led, start)
        if slurm is None:
            return None
        return {"attempt": attempt, "cycle": cycle, "active": sorted(slurm), "slurm": slurm}

    def step(self) -> tuple[int, float]:
        """The newest step trained, and when."""
        last = next(r for r in reversed(records(self.run_dir)) if "loss" in r)
        return int(last["step"]), float(last["time"])

    def inject(self, kind: str, at: dict[str, Any]) -> dict[str, Any]:
        """Do one fault of `kind` to the run at `at` (see `where`); what was done."""
        fresh = [n for n in at["active"] if at["slurm"][n] not in self.out]
        node = self.rng.choice(fresh if kind in NODE_KINDS and fresh else at["active"])
        host = at["slurm"][node]
        done: dict[str, Any] = {"kind": kind, "node": node, "slurm_node": host}
        if kind in ("rank_kill", "rank_hang"):
            from hpcshard.launch.procs import ranks_below

            # (on NFS-like views this host may see a new attempt's pid file late: its
            # lookup cache)
            launcher = wait(lambda: launchers.read_pid(launchers.pid_file(self.run_dir, node)), 90,
                            f"node {node}'s launcher's pid file", every=1)
            ranks = ranks_below([launcher])
            victim = self.rng.choice(ranks)
            os.kill(victim, signal.SIGKILL if kind == "rank_kill" else signal.SIGSTOP)
            done["pid"] = victim
        elif kind in ("node_kill", "node_freeze"):
            run([str(SCRIPT), "kill" if kind == "node_kill" else "freeze", host])
            if kind == "node_freeze":
                self.frozen.append(host)
            self.out.add(host)
        elif kind in ("node_down", "drain"):
            self.slurm("scontrol", "update", f"NodeName={host}", f"State={kind.split('_')[-1].upper()}",
                       "Reason=chaos soak")
            self.out.add(host)
        elif kind == "preempt":
            got = self.slurm("sbatch", "--parsable", "-p", "high", "-N", "1", "-w", host, "--gpus-per-node=2",
                             "-o", "/dev/null", "--wrap", "sleep 5")
            done["job"] = got.stdout.strip() or got.stderr.strip()
        elif kind == "disk_full":
            done.update(self.fill_disk())
        return done

    def fill_disk(self) -> dict[str, Any]:
        """Fill the run directory's filesystem right after a commit (the next save then
        fails), and free it once rank 0 logged that failure (or after 60 s)."""
        ckpts = self.run_dir / "checkpoints"
        before = {p.name for p in ckpts.iterdir()}
        wait(lambda: {p.name for p in ckpts.iterdir()} - before, 120, "a commit before filling the disk")
        log = self.run_dir / "logs" / "rank-0.log"
        failed = log.read_text().count("FAILED")
        filler = self.run_dir.parent / "filler"
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
        try:
            free = os.statvfs(filler).f_bavail * os.statvfs(filler).f_frsize
            os.posix_fallocate(fd, 0, free)
        except OSError:
            pass
        finally:
            os.close(fd)
        full = time.time()
        try:
            wait(lambda: log.read_text().count("FAILED") > failed, 60, "a save to fail", every=0.2)
            seen = True
        except RuntimeError:
            seen = False
        filler.unlink()
        return {"full_s": time.time() - full, "save_failed": seen}


def main() -> list[Metric]:
    kinds = [k for k in os.environ.get("HPCSHARD_CHAOS_KINDS", ",".join(KINDS)).split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"HPCSHARD_CHAOS_KINDS: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")
    rng = random.Random(SEED)
    run([str(SCRIPT), "down"], timeout=600)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-chaos-", dir=RESULTS))
    disk = tmp / "disk"
    disk.mkdir()
    run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)])
    # (NFS-like: the small disk is the backing directory of every node's view)
    shared = SLURM_DIR / "shared"
    testbed = env(HPCSHARD_SLURM_SHARED=str(shared), HPCSHARD_SLURM_SHARED_BACK=str(disk),
                  HPCSHARD_SLURM_NFS=NFS) if NFS else None
    run([str(SCRIPT), "up", str(CLUSTER)], timeout=600, env=testbed)
    e = env(SLURM_CONF=str(CONF))
    steps = int((FAULTS + 4) * INTERVAL / STEP_S)
    run_dir = (shared if NFS else disk) / "run"
    # What the bench itself looks at (where the run trains, when it committed, the ledger
    # for the accounting) it reads from the disk, not through this host's NFS-like view:
    # the run's own processes and commands see the views, the observer the truth. Through
    # the view, the metrics this host read were a minute behind the ranks (the first soak
    # on NFS-like storage gave up waiting for a commit the run had made).
    truth = disk / "run"
    soak = Soak(truth, e, rng)
    try:
        hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "--spares", "1",
                 "jobs/charlm.py", "--run-dir", str(run_dir), "--time", "3:00:00",
                 "--max-requeues", "100", "--max-restarts", "100",
                 "--set", f"steps={steps}", "--set", "log_every=1", "--set", "eval_every=0",
                 "--set", "ckpt_every=16", "--set", "async_save=true", "--set", "keep_last=2",
                 # (disk_full frees the disk once the save failed: the run trains on past it)
                 "--set", "straggler_every=0", "--set", "on_storage_full=train", env=e)
        created = json.loads((truth / "spec.json").read_text())["created"]
        wait(lambda: soak.where(), 600, "training")
        print(f"  soak: seed {SEED}, a fault every {INTERVAL:.0f} s on average, {FAULTS} faults, "
              f"{steps} steps; kinds {', '.join(kinds)}", flush=True)
        next_at = time.time() + gap(rng)
        while len(soak.faults) < FAULTS:
            at = wait(lambda: soak.where(), 900, "the run to train again", every=0.5)
            if soak.step()[0] > 0.9 * steps:
                print("  soak: the run is nearly done; no more faults", flush=True)
                break
            if time.time() < next_at:
                time.sleep(min(1.0, next_at - time.time()))
                continue
            usable = CLUSTER - len(soak.out) - 3
            fresh = any(host not in soak.out for host in at["slurm"].values())
            kind = rng.choice([k for k in kinds if k not in NODE_KINDS or (usable > 0 and fresh)])
            step, _ = soak.step()
            fault = {"time": time.time(), "step": step, **soak.inject(kind, at)}
            soak.faults.append(fault)
            print(f"  {time.strftime('%H:%M:%S')} fault {len(soak.faults)}: {kind} on node "
                  f"{fault['node']} ({fault['slurm_node']}) at step {step}", flush=True)
            next_at = time.time() + gap(rng)
        end = wait(lambda: next((r for r in ledger.read(truth) if r["event"] == "end"
                                 and r["reason"] == "done"), None), 3600, "the run's end", every=2)
        finished = end["time"]
        good = account(truth, created, finished)
        led = ledger.read(truth)
        costs(soak.faults, truth, created, finished)
        details = {"seed": SEED, "interval_s": INTERVAL, "steps": steps, "ckpt_every": 16,
                   "created": created, "end": finished,
                   "finished": end["reason"] == "done",
                   "faults": soak.faults, "goodput": good.seconds, "wall": good.wall,
                   "ledger_events": [r["event"] for r in led], "replays": replays(truth),
                   "reused": reused(truth, led), "frozen": soak.frozen, "nfs": NFS,
                   "healthy_declared_bad": healthy_declared_bad(soak.faults, led)}
        (RESULTS / ".chaos-details.json").write_text(json.dumps(details, indent=1) + "\n")
    finally:
        for host in soak.frozen:
            subprocess.run([str(SCRIPT), "thaw", host], capture_output=True)
        spec = truth / "spec.json"
        jobs = json.loads(spec.read_text())["jobs"] if spec.exists() else []
        for job in jobs:
            subprocess.run(["scancel", job], env=e, capture_output=True)
        subprocess.run(["rm", "-rf", str(RESULTS / ".chaos-run")])  # kept for a look
        subprocess.run(["cp", "-r", str(truth), str(RESULTS / ".chaos-run")], capture_output=True)
        run([str(SCRIPT), "down"], timeout=600, check=False)  # (first: the views sit on the disk)
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        subprocess.run(["rm", "-rf", str(tmp)])
    return report(details, RESULTS / ".chaos-run")


def healthy_declared_bad(faults: list[dict[str, Any]], led: list[dict[str, Any]]) -> list[str]:
    """Slurm nodes declared bad that no node fault touched (a false loss: a node whose
    heartbeats, or whose files, were late)."""
    touched = {f["slurm_node"] for f in faults if f["kind"] in NODE_KINDS}
    bad = {r["slurm_node"] for r in led if r["event"] == "bad_node" and r.get("slurm_node")}
    return sorted(bad - touched)


def gap(rng: random.Random) -> float:
    """Seconds to the next fault: uniform within half the mean either side (a Poisson
    stream's long gaps would leave a soak of fixed length with too few faults)."""
    return rng.uniform(0.5 * INTERVAL, 1.5 * INTERVAL)


def costs(faults: list[dict[str, Any]], run_dir: Path, created: float, finished: float) -> None:
    """Each fault's cost: the wall time from it to the next fault (or the run's end), less
    the time that window spent training steps for the first time, saving and evaluating
    (the goodput accounting's own pieces, cut at the faults). It holds detection,
    recovery, the queue, start-up and the steps trained again (`recomputed`, its share);
    a save that fails on a full disk and a preemption's stop save count as saves."""
    pieces, _, _ = timeline(run_dir, created, finished)
    ends = [f["time"] for f in faults[1:]] + [finished]
    for fault, end in zip(faults, ends, strict=True):
        spent = between(pieces, fault["time"], end)
        useful = sum(spent.get(k, 0.0) for k in ("training", "checkpoint", "evaluation"))
        fault["cost"] = max(0.0, end - fault["time"] - useful)
        fault["recomputed"] = spent.get("recomputed", 0.0)


def replays(run_dir: Path) -> dict[str, int]:
    """Steps trained more than once (after a fault): how many, and how many gave a loss
    different from their first time (0: resumed exactly)."""
    first: dict[int, float] = {}
    again = differ = 0
    for r in records(run_dir):
        if "loss" not in r:
            continue
        if r["step"] in first:
            again += 1
            differ += r["loss"] != first[r["step"]]
        else:
            first[r["step"]] = r["loss"]
    return {"steps_trained_again": again, "with_a_different_loss": differ}


def trained_on(run_dir: Path, led: list[dict[str, Any]], start: dict[str, Any]) -> dict[int, str] | None:
    """The Slurm node of each active node of the cycle `start` began (its launchers'
    heartbeats say where they run), or None while one of them has not said."""
    attempt, cycle = start["attempt"], start["cycle"]
    before = [r for r in led if r["event"] == "fault" and r["attempt"] == attempt and r["cycle"] == cycle - 1]
    active = before[-1]["active"] if before else list(range(start["nodes"]))
    beats = launchers.beats(run_dir, attempt, 16)
    if not all(beats.get(n, {}).get("slurm_node") for n in active):
        return None
    return {n: beats[n]["slurm_node"] for n in active}


def reused(run_dir: Path, led: list[dict[str, Any]]) -> list[str]:
    """Bad Slurm nodes that trained again after they were declared bad."""
    found = []
    for bad in (r for r in led if r["event"] == "bad_node" and r.get("slurm_node")):
        for start in (r for r in led if r["event"] == "start" and r["time"] > bad["time"]):
            if bad["slurm_node"] in (trained_on(run_dir, led, start) or {}).values():
                found.append(bad["slurm_node"])
    return sorted(set(found))


def report(d: dict[str, Any], run_dir: Path) -> list[Metric]:
    """The soak's table, from its details and its run directory (`python -m bench.chaos
    --report` makes it again from the last soak's)."""
    good, wall = d["goodput"], d["wall"]
    effective = good["training"] / wall
    if (run_dir / "spec.json").exists():  # the costs from the run itself (an older soak's too)
        created = d.get("created") or json.loads((run_dir / "spec.json").read_text())["created"]
        costs(d["faults"], run_dir, created, d.get("end") or created + wall)
    spent = [f["cost"] for f in d["faults"]]
    per_fault = statistics.mean(spent) if spent else 0.0
    # One fault per 15 minutes, from what was measured. With the soak's checkpoint interval:
    # the periodic saves' share stays, each fault costs what it cost here.
    free = good["training"] / (good["training"] + good["checkpoint"])
    at_15 = free * (1 - per_fault / PER_15)
    # A run that expects a fault per 15 min saves less often (Young's interval for its save
    # stall s: sqrt(2 s T)); a fault then costs its fixed part (detection, recovery, queue,
    # start-up: the cost less the steps trained again) and half an interval recomputed.
    stalls = [r["save_s"] for r in records(run_dir) if r.get("save_s")]
    stall = statistics.median(stalls) if stalls else 0.0
    fixed = (statistics.mean(max(0.0, f["cost"] - f.get("recomputed", 0.0)) for f in d["faults"])
             if spent else 0.0)
    tau = math.sqrt(2 * stall * PER_15) if stall else 0.0
    young = 1 - (stall / tau if tau else 0.0) - (fixed + tau / 2) / PER_15
    by_kind: dict[str, list[float]] = {}
    for f in d["faults"]:
        by_kind.setdefault(f["kind"], []).append(f["cost"])
    rep = d["replays"]
    metrics = [
        Metric(NAME, f"faults injected (seed {d['seed']}, mean interval {d['interval_s']:.0f} s)",
               len(d["faults"]), "", ">= 10", len(d["faults"]) >= 10),
        Metric(NAME, "effective training time over the soak", 100 * effective, "%", ">= 90",
               effective >= 0.90, note=f"{wall:.0f} s wall from submission to the end, measured from "
               "the ledger and metrics"),
        Metric(NAME, "cost of a fault (mean: wall time to the next less training, saves, evaluation)",
               per_fault, "s", note=f"of which {fixed:.1f} s not recomputing lost steps"),
        Metric(NAME, "effective at one fault per 15 min, the soak's checkpoint interval",
               100 * at_15, "%", ">= 98", at_15 >= 0.98,
               note=f"{100 * free:.1f}% without faults: a save every {d.get('ckpt_every', 16)} steps"),
        Metric(NAME, "effective at one fault per 15 min, saving at Young's interval",
               100 * young, "%", ">= 98", young >= 0.98,
               note=f"a {1000 * stall:.1f} ms save stall every {tau:.1f} s; from the measured costs"),
        Metric(NAME, "steps trained again with a different loss", rep["with_a_different_loss"], "steps",
               "0", rep["with_a_different_loss"] == 0, note=f"of {rep['steps_trained_again']} trained again"),
        Metric(NAME, "bad nodes used again", len(d["reused"]), "", "0", not d["reused"]),
        Metric(NAME, "healthy nodes declared bad (no node fault touched them)",
               len(d.get("healthy_declared_bad", [])), "", "0", not d.get("healthy_declared_bad")),
        Metric(NAME, "the run finished without anyone's help", float(d.get("finished", True)), "", "1",
               bool(d.get("finished", True))),
    ]
    metrics += [Metric(NAME, f"cost of {kind} (median of {len(c)})", statistics.median(c), "s")
                for kind, c in sorted(by_kind.items())]
    save(NAME, metrics, {k: v for k, v in d.items() if k != "ledger_events"})
    return metrics


if __name__ == "__main__":
    if sys.argv[1:] == ["--report"]:
        show(report(json.loads((RESULTS / ".chaos-details.json").read_text()), RESULTS / ".chaos-run"))
    else:
        show(main())
