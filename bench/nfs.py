"""Recovery on NFS-like shared storage, side by side with a plain disk: the 2x2 demo on the
local Slurm cluster, restarted by the bench as `scripts/local-slurm up 3 0 3` (partition
low: 3 plain nodes; partition nfs: 3 nodes, each with its own NFS-like view of the shared
storage, NFS's default cache times: 30 s lookups, negative ones too, 3 s attributes).
Each case runs on low with the run directory on this host's disk, and on nfs with it on
the shared storage, alternately:

    crash   a rank of the second node SIGKILLed 13 steps into a cycle, REPEATS times in one
            run: fault declared -> decided (the ledger's fault record: `time` less
            `declared`) and declared -> training again (its `recovered` record's seconds)
    freeze  2 nodes and a spare; every process of the second node's Slurm node SIGSTOPped
            (`scripts/local-slurm freeze`: slurmd, the job's processes and, on nfs, the
            node's own bindfs) 13 steps in, one run per repeat: frozen -> declared lost (its
            bad_node record), frozen -> fault declared, declared -> training again on the
            spare

Medians. The issue's figures before the coordination left the file system: a crash trained
again 6.6 s after its declaration on a plain directory, 66 s on the NFS-like one.

Environment: HPCSHARD_NFS_REPEATS (2), HPCSHARD_NFS_CASES (crash,freeze), HPCSHARD_SLURM_NFS
(the views' cache times, as bindfs options; NFS's by default), HPCSHARD_NFS_SKEW (wall-clock
offsets of the nfs nodes in order, e.g. "+30,-30": n4 and n5), HPCSHARD_SLURM_DIR and
HPCSHARD_SLURM_PORT (which local cluster: it is restarted, and taken down at the end).

Clocks: `declared` is the declaring node's wall clock, the fault's `time`, `recovered` and
`bad_node` the leader's, `frozen` this host's. With HPCSHARD_NFS_SKEW the differences across
nodes hold the skew: the figures say so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, Metric, env, hpcshard, median, records, run, save, show, wait
from hpcshard.rundir import ledger

NAME = "nfs"
SCRIPT = ROOT / "scripts" / "local-slurm"
DIR = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm"))
CONF = DIR / "etc" / "slurm.conf"
SHARED = DIR / "shared"
NFS_DEFAULT = "entry_timeout=30,negative_timeout=30,attr_timeout=3"
"""Linux NFS clients' defaults: directories' attributes (and so new names) 30-60 s
(acdirmin), files' 3-60 s (acregmin)."""
PLAIN_NODES = 3
NFS_NODES = 3
REPEATS = int(os.environ.get("HPCSHARD_NFS_REPEATS", "2"))
CASES = [c for c in os.environ.get("HPCSHARD_NFS_CASES", "crash,freeze").split(",") if c]
STORAGES = {"plain": "low", "nfs": "nfs"}
"""Storage -> the partition whose nodes see it so."""
TRAINED = 13
"""Steps a cycle trains before its fault (past a commit: ckpt_every is 10)."""
WAIT_S = 900.0
"""The longest any phase may take (a cycle's start behind 30 s lookups is slow)."""
SETS = {"steps": 100000, "log_every": 1, "eval_every": 0, "ckpt_every": 10, "keep_last": 2,
        "straggler_every": 0}


def cluster_env() -> dict[str, str]:
    """The script's environment for the cluster: shared storage, its cache times, skews."""
    skews = [s for s in os.environ.get("HPCSHARD_NFS_SKEW", "").split(",") if s]
    if len(skews) > NFS_NODES:
        raise SystemExit(f"HPCSHARD_NFS_SKEW: at most {NFS_NODES} offsets (one per nfs node), not {skews}")
    return {**os.environ, "HPCSHARD_SLURM_SHARED": str(SHARED),
            "HPCSHARD_SLURM_NFS": os.environ.get("HPCSHARD_SLURM_NFS", NFS_DEFAULT),
            "HPCSHARD_SLURM_SKEW": ",".join(f"n{PLAIN_NODES + 1 + i}={s}" for i, s in enumerate(skews))}


def submit(run_dir: Path, storage: str, e: dict[str, str], *extra: str) -> None:
    hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "--partition", STORAGES[storage],
             "jobs/charlm.py", "--run-dir", str(run_dir), "--time", "30:00", *extra,
             *(a for k, v in SETS.items() for a in ("--set", f"{k}={v}")), env=e)


def started(run_dir: Path, cycle: int) -> float | None:
    """When cycle `cycle` of the first attempt started training (its ledger start record)."""
    return next((float(r["time"]) for r in ledger.read(run_dir)
                 if r["event"] == "start" and r.get("attempt") == 0 and r.get("cycle") == cycle), None)


def trained(run_dir: Path, cycle: int, what: str) -> None:
    """Wait until cycle `cycle` has trained TRAINED steps."""
    since = wait(lambda: started(run_dir, cycle), WAIT_S, f"{what}: cycle {cycle} to start", every=0.5)
    wait(lambda: sum(1 for r in records(run_dir) if "loss" in r and r["time"] > since) >= TRAINED,
         WAIT_S, f"{what}: cycle {cycle} to train {TRAINED} steps", every=0.5)


def recovered(run_dir: Path, cycle: int, what: str) -> dict[str, Any]:
    """The ledger's record of cycle `cycle` training again."""
    found: dict[str, Any] = wait(lambda: next((r for r in ledger.read(run_dir) if r["event"] == "recovered"
                                               and r["cycle"] == cycle), None),
                                 WAIT_S, f"{what}: cycle {cycle} to train again", every=0.5)
    return found


def stop(run_dir: Path, e: dict[str, str]) -> None:
    """Cancel the run's jobs and wait until Slurm has ended them (the next run needs the
    nodes)."""
    spec = run_dir / "spec.json"
    jobs = [str(j) for j in json.loads(spec.read_text())["jobs"]] if spec.exists() else []
    for job in jobs:
        subprocess.run(["scancel", job], env=e, capture_output=True)
    if jobs:
        wait(lambda: not subprocess.run(["squeue", "-h", "-j", ",".join(jobs)], env=e, capture_output=True,
                                        text=True).stdout.strip(), 120, "the run's jobs to end", every=0.5)


def crash(run_dir: Path, storage: str, e: dict[str, str]) -> list[dict[str, float]]:
    """REPEATS crashes in one run: a rank of the second launcher's node SIGKILLed."""
    from hpcshard.launch.procs import ranks_below
    from hpcshard.rundir.launchers import launchers

    submit(run_dir, storage, e, "--max-restarts", str(REPEATS + 1))
    rows = []
    try:
        for cycle in range(REPEATS):
            trained(run_dir, cycle, f"crash on {storage}")
            victim = ranks_below([launchers(run_dir)[1]])[-1]
            os.kill(victim, signal.SIGKILL)
            killed = time.time()
            back = recovered(run_dir, cycle + 1, f"crash on {storage}")
            fault = next(r for r in ledger.read(run_dir) if r["event"] == "fault" and r["cycle"] == cycle)
            rows.append({"detect": fault["declared"] - killed, "decided": fault["time"] - fault["declared"],
                         "again": back["seconds"]})
            print(f"  crash on {storage}: decided {rows[-1]['decided']:.1f} s, training again "
                  f"{rows[-1]['again']:.1f} s after the declaration", flush=True)
    finally:
        stop(run_dir, e)
    return rows


def freeze(run_dir: Path, storage: str, e: dict[str, str]) -> dict[str, float]:
    """One run with a spare: the second launcher's Slurm node frozen whole."""
    from hpcshard.rundir.launchers import beats

    submit(run_dir, storage, e, "--spares", "1", "--max-restarts", "2")
    victim = ""
    try:
        trained(run_dir, 0, f"freeze on {storage}")
        victim = str(beats(run_dir, 0, 3)[1]["slurm_node"])
        run([str(SCRIPT), "freeze", victim], env=cluster_env())
        frozen = time.time()
        back = recovered(run_dir, 1, f"freeze on {storage}")
        led = ledger.read(run_dir)
        fault = next(r for r in led if r["event"] == "fault" and r["cycle"] == 0)
        bad = next(r for r in led if r["event"] == "bad_node" and r["node"] == 1)
        row = {"declared": fault["declared"] - frozen, "lost": bad["time"] - frozen, "again": back["seconds"]}
        print(f"  freeze {victim} on {storage}: declared lost {row['lost']:.1f} s after, training again "
              f"{row['again']:.1f} s after the declaration", flush=True)
        return row
    finally:
        if victim:
            subprocess.run([str(SCRIPT), "thaw", victim], env=cluster_env(), capture_output=True)
        stop(run_dir, e)
        if victim:
            subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"], env=e,
                           capture_output=True)


def main() -> list[Metric]:
    unknown = set(CASES) - {"crash", "freeze"}
    if unknown:
        raise SystemExit(f"HPCSHARD_NFS_CASES: unknown {sorted(unknown)}; choose from crash, freeze")
    ce = cluster_env()
    run([str(SCRIPT), "down"], env=ce, timeout=600)
    run([str(SCRIPT), "up", str(PLAIN_NODES), "0", str(NFS_NODES)], env=ce, timeout=600)
    e = env(SLURM_CONF=str(CONF))
    rows: dict[str, dict[str, list[dict[str, float]]]] = {c: {s: [] for s in STORAGES} for c in CASES}
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-nfs-", dir=RESULTS))
    try:
        for case in CASES:
            for i in range(1 if case == "crash" else REPEATS):
                for storage in STORAGES:
                    base = SHARED if storage == "nfs" else tmp
                    run_dir = base / f"{case}-{storage}-{i}-{uuid.uuid4().hex[:6]}"
                    if case == "crash":
                        rows[case][storage] += crash(run_dir, storage, e)
                    else:
                        rows[case][storage].append(freeze(run_dir, storage, e))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        run([str(SCRIPT), "down"], env=ce, timeout=600, check=False)
    return report(rows, ce)


def report(rows: dict[str, dict[str, list[dict[str, float]]]], ce: dict[str, str]) -> list[Metric]:
    skew = ce["HPCSHARD_SLURM_SKEW"]
    note = f"nfs nodes' clocks {skew}: across nodes the figure holds the skew" if skew else ""
    label = {"plain": "plain disk", "nfs": "NFS-like"}
    metrics = []
    for case, parts in (("crash", (("decided", "declared -> decided", None),
                                   ("again", "declared -> training again", 10.0))),
                        ("freeze", (("lost", "frozen -> declared lost", 10.0),
                                    ("declared", "frozen -> fault declared", None),
                                    ("again", "declared -> training again on the spare", 20.0)))):
        if case not in rows:
            continue
        for storage in STORAGES:
            got = rows[case][storage]
            for key, what, target in parts:
                value = median([r[key] for r in got])
                metrics.append(Metric(NAME, f"{case}, {label[storage]}: {what} (median of {len(got)})", value,
                                      "s", f"<= {target:.0f} s" if target and storage == "nfs" else "",
                                      value <= target if target and storage == "nfs" else None,
                                      note if storage == "nfs" else ""))
        again = [median([r["again"] for r in rows[case][s]]) for s in STORAGES]
        metrics.append(Metric(NAME, f"{case}: training again, NFS-like / plain disk", again[1] / again[0],
                              "x", note=f"{again[1]:.1f} s vs {again[0]:.1f} s"))
    save(NAME, metrics, {"rows": rows, "nfs_options": ce["HPCSHARD_SLURM_NFS"], "skew": skew,
                         "repeats": REPEATS})
    return metrics


if __name__ == "__main__":
    show(main())
