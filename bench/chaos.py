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
    eacces       every write under the run directory refused with EACCES for 20-40 s (an
                 expired Kerberos ticket, a root-squash change), then taken again
    eio          the same with EIO (a soft NFS mount whose server fails over, an evicted
                 Lustre client)
    quota        the checkpoint directory over a quota until a save failed for it, then
                 lifted: DCP's writer fails without an errno ("unexpected pos", as torch.save
                 says it), the write probe beside the checkpoints gets EDQUOT
    time_limit   an admin shortens the job's time limit, on a node whose wall clock is 45 s
                 behind (chosen only while that node trains; the first fault once it does)

The storage faults other than disk_full are the errno alone: the jobs run as root, which no
mode bits refuse, and a tmpfs quota (kernel 6.6 and later) does not bind root either
(CAP_SYS_RESOURCE passes its hard limits). So every Python process of the run (launchers
and ranks on every node: PYTHONPATH comes with the submitting environment, which sbatch
exports to the job by default and hpcshard's script does not narrow) imports a
sitecustomize (`HOOK`) that refuses, while a flag file beside it exists, what the mount
would refuse: for eacces and eio every open for writing, create, mkdir, rename, link and
removal under the run directory, and an fsync there (eio); for quota the opens for writing
under its checkpoints. Writes to files opened before the outage (Slurm's own logs of the
launchers, the ranks' log streams) are not refused: the whole mount refusing is the case
meant, short of what a process holds open. Each refusal is counted beside the flag. The
soak saves often (every 16 steps: a few seconds) with on_storage_full=train, so an outage
fails several saves in a row: at SAVE_FAILURES_STOP (3) the ranks take the storage for one
that takes no checkpoint and, as told, train on without one until a save commits again.

time_limit, as an admin does it and what follows: `scontrol update TimeLimit` leaves the
running job 90-150 s, under the notice's lead (120 s) plus the controller's 30 s between
its looks, so the notice comes within 30 s. The launchers asked Slurm for the time left as
the attempt began (3 hours): a notice that far from the deadline they know is taken for a
preemption's, and the ranks save and stop at the next step; the run is sent on (the
soak's requeue policy is hpcshard's default, chain: a continuation job, submitted before
the old one ends). While the next job waits, its limit becomes LIMIT_MIN minutes: its
launchers ask it as they start, the notice comes within the lead of the end they know, and
the ranks train on and stop in time, planned from durations (Slurm's time left counted on
the boot clock, bounded by the notice's arrival plus its lead; the skewed node's scontrol
says 45 s more than there is). Sent on again, the next job gets its 3 hours. Each stop is
checked: saved and sent on (a job that reaches its limit ends TIMEOUT, never sent on) and
no step trained before it trained again (`limit_stops`).

The skewed node and the accounting: the fault times are this host's clock; the goodput
pieces are cut at rank 0's records (metrics, the ledger's starts and ends) and the decider's
(the ledger's faults), each on the clock of the node that wrote it. n2 is node 1 of the
run's first allocation (n1-n3), so rank 0 is on it only once n1 is out of the run. The
accounting reads a copy of those records taken back to this host's clock (`one_clock`):
each record of a cycle by the skew of the node rank 0 trained on in it (the node that wrote
it: rank 0, and node 0's launcher beside it, which declares the cycle's fault). Cut on the
records' own clocks, a fault whose window began on the skewed node and ended on another (a
requeue that moved rank 0) cost 45 s more than it did (the first full soak with time_limit
faults: two of its twelve, its figure at one fault per 15 min 97.2% instead of 98.4%). Left
on its own clock: a fault declared by a decider other than rank 0's node's launcher (node
0 lost with its store), a few seconds of one window.

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
HPCSHARD_CHAOS_KINDS (comma-separated subset of KINDS, e.g. eacces,eio,quota,time_limit),
HPCSHARD_CHAOS_NFS."""

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
KINDS = ("rank_kill", "rank_hang", "node_kill", "node_freeze", "node_down", "drain", "preempt", "disk_full",
         "eacces", "eio", "quota", "time_limit")
NODE_KINDS = ("node_kill", "node_freeze", "node_down", "drain")
"""Faults that take a node out of the partition for good (the run never uses it again)."""
SKEW = {"n2": -45.0}
"""The skewed node of a soak with time_limit faults (HPCSHARD_SLURM_SKEW): its jobs' wall
clock 45 s behind this host's. Node 1 of the first allocation, so it trains from the start."""
OUTAGE_S = (20.0, 40.0)
"""How long the run directory refuses writes (eacces, eio): drawn from the soak's rng."""
LIMIT_MIN = 4
"""The time limit (minutes) of the attempt after an admin's shortening: the notice comes 90-
120 s after its start, room for a start-up and a measured save before it."""
LIMIT = "3:00:00"
ENDED = ("COMPLETED", "TIMEOUT", "FAILED", "CANCELLED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "DEADLINE",
         "PREEMPTED")
"""A job's states once it has ended (scontrol's JobState)."""
"""The soak's time limit, given back once a time_limit fault is over."""
HOOK = '''"""The chaos soak's storage faults (bench/chaos.py), in every Python process of its run.
While FLAG exists its text says what the storage does: EACCES or EIO, every write under
the run directory is refused with it; QUOTA, its checkpoint directory is over a quota.
Each refusal is counted in FLAG.refused."""
import builtins, errno, io, os, sys

RUNS = {runs!r}
FLAG = {flag!r}
WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_open, _os = io.open, {{name: getattr(os, name) for name in
                      ("open", "mkdir", "rmdir", "unlink", "remove", "rename", "replace", "link",
                       "symlink", "truncate", "fsync")}}


def _under(path, sub):
    if isinstance(path, int):
        return False
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:
        return False
    roots = [os.path.join(r, sub).rstrip("/") for r in RUNS]
    return any(path == root or path.startswith(root + "/") for root in roots)


def _refuse(op, path):
    """Raise what the storage says of `op` on `path` now, if anything."""
    if not _under(path, ""):
        return
    try:
        with _open(FLAG) as f:
            how = f.read().strip()
    except OSError:
        return
    if how == "QUOTA":
        # (a quota refuses blocks: mkdir, rename and removals go through; the data files'
        # writes fail in torch.save, which says it without an errno)
        if op != "open" or not _under(path, "checkpoints"):
            return
        if os.fsdecode(path).endswith(".distcp"):
            _count(op, "no-errno", path)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 2048")
        code = errno.EDQUOT
    elif how == "EACCES" and op == "fsync":
        return  # (permission is judged at the open)
    else:
        code = getattr(errno, how)
    _count(op, how, path)
    raise OSError(code, os.strerror(code), os.fsdecode(path))


def _count(op, how, path):
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "?"
    line = f"{{os.getpid()}} {{program}} {{op}} {{how}} {{os.fsdecode(path)}}\\n"
    fd = _os["open"](FLAG + ".refused", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _open_hook(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+"):
        _refuse("open", file)
    return _open(file, mode, *args, **kwargs)


def _os_open(path, flags, *args, **kwargs):
    if flags & WRITING and "dir_fd" not in kwargs:
        _refuse("open", path)
    return _os["open"](path, flags, *args, **kwargs)


def _paths(name, last):
    def hook(*args, **kwargs):
        if not any(k.endswith("dir_fd") for k in kwargs):  # (relative to a directory's fd: let be)
            for path in args[last:2]:
                _refuse(name, path)
        return _os[name](*args, **kwargs)
    return hook


def _fsync(fd):
    fd = fd if isinstance(fd, int) else fd.fileno()
    try:
        path = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:
        path = ""
    if path:
        _refuse("fsync", path)
    return _os["fsync"](fd)


builtins.open = io.open = _open_hook
os.open, os.fsync = _os_open, _fsync
for _name in ("mkdir", "rmdir", "unlink", "remove", "truncate", "rename", "replace", "link"):
    setattr(os, _name, _paths(_name, 0))  # (the paths among the first two arguments)
os.symlink = _paths("symlink", 1)
'''
"""The sitecustomize of a soak's run (see the module's text): `runs` the run directory as
its processes name it and as this host does, `flag` the flag file."""
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

    def __init__(self, run_dir: Path, e: dict[str, str], rng: random.Random, flag: Path,
                 skew: dict[str, float]) -> None:
        self.run_dir, self.e, self.rng, self.flag, self.skew = run_dir, e, rng, flag, skew
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
        skewed = [n for n in at["active"] if at["slurm"][n] in self.skew]
        node = skewed[0] if kind == "time_limit" else self.rng.choice(
            fresh if kind in NODE_KINDS and fresh else at["active"])
        host = at["slurm"][node]
        # (rank 0's node: the clock of the records the fault's cost is cut at)
        done: dict[str, Any] = {"kind": kind, "node": node, "slurm_node": host,
                                "clock_s": self.skew.get(at["slurm"][min(at["active"])], 0.0)}
        # (`clock_s`: the skew of rank 0's node, whose records the fault's window begins with;
        # the accounting takes them back to this host's clock, `one_clock`)
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
        elif kind in ("eacces", "eio"):
            done.update(self.refuse_writes(kind.upper()))
        elif kind == "quota":
            done.update(self.over_quota())
        elif kind == "time_limit":
            done.update(self.shorten_limit(at["attempt"]))
        return done

    def refusals(self) -> list[str]:
        """The hook's refusals so far (pid, program, operation, errno, path), one a line."""
        refused = self.flag.with_name(self.flag.name + ".refused")
        return refused.read_text().splitlines() if refused.exists() else []

    def refuse_writes(self, errno_name: str) -> dict[str, Any]:
        """The run directory refuses every write with `errno_name` for OUTAGE_S, then takes
        them again; what the outage refused (by operation and program) and what the ranks
        made of it (their failed saves, from the ledger)."""
        seconds = self.rng.uniform(*OUTAGE_S)
        before, failed = len(self.refusals()), len(saves_failed(self.run_dir))
        self.flag.write_text(errno_name)
        began = time.time()
        time.sleep(seconds)
        self.flag.unlink()
        refused = [line.split(maxsplit=4) for line in self.refusals()[before:]]
        by: dict[str, int] = {}
        for _, program, op, _, _ in refused:
            by[f"{program} {op}"] = by.get(f"{program} {op}", 0) + 1
        return {"outage_s": time.time() - began, "refused": by, "processes": len({r[0] for r in refused}),
                "saves_failed": saves_failed(self.run_dir)[failed:]}

    def over_quota(self) -> dict[str, Any]:
        """The checkpoint directory over a quota until a save failed for it (the ledger's
        save_failed record, or 60 s), then lifted: one failed save, under
        SAVE_FAILURES_STOP's three in a row."""
        failed = len(saves_failed(self.run_dir))
        self.flag.write_text("QUOTA")
        began = time.time()
        try:
            wait(lambda: len(saves_failed(self.run_dir)) > failed, 60, "a save to fail", every=0.2)
        except RuntimeError:
            pass
        finally:
            self.flag.unlink()
        return {"quota_s": time.time() - began, "saves_failed": saves_failed(self.run_dir)[failed:]}

    def job(self, job: str = "") -> tuple[str, dict[str, str]]:
        """`job` (the run's newest job by default) and scontrol's fields of it."""
        job = job or str(json.loads((self.run_dir / "spec.json").read_text())["jobs"][-1])
        out = self.slurm("scontrol", "show", "job", "-o", job).stdout
        return job, dict(f.split("=", 1) for f in out.split() if "=" in f)

    def shorten_limit(self, attempt: int) -> dict[str, Any]:
        """An admin shortens the running job's limit to leave it 90-150 s (the notice
        within the controller's next look, 30 s); once the run is sent on (a continuation
        job, the soak's policy, or the job requeued) the next job gets LIMIT_MIN minutes
        while it waits (a time-limit stop its launchers know of from its start); sent on
        again, the next gets LIMIT back. Raises where a stop's job ended otherwise (TIMEOUT:
        never sent on; the run is over)."""
        job, info = self.job()
        lead = json.loads((self.run_dir / "spec.json").read_text())["slurm"]["signal_lead_s"]
        ran = duration(info["RunTime"])
        minutes = int((ran + lead + 30) // 60)
        self.slurm("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
        done: dict[str, Any] = {"job": job, "ran_s": ran, "limit_min": minutes,
                                "left_s": 60 * minutes - ran, "attempts": [attempt, attempt + 1]}
        log = self.run_dir / "logs" / "rank-0.log"
        planned = log.read_text().count("time-limit notice") if log.exists() else 0
        short = self.sent_on(job, int(info["Restarts"]), 120 + lead)
        self.slurm("scontrol", "update", f"JobId={short}", f"TimeLimit={LIMIT_MIN}")
        wait(lambda: self.job(short)[1].get("JobState") == "RUNNING", 300, f"job {short} to run", every=0.5)
        # The notice comes 90-120 s after the start; should Slurm send none, the limit is
        # given back before it is reached (the run is not the soak's to lose).
        try:
            wait(lambda: log.read_text().count("time-limit notice") > planned, 60 * LIMIT_MIN - 40,
                 "the ranks' plan after the notice", every=0.5)
        except RuntimeError:
            self.slurm("scontrol", "update", f"JobId={short}", f"TimeLimit={LIMIT}")
            return {**done, "jobs": [job, short], "trained_on": False}
        _, info = self.job(short)
        after = self.sent_on(short, int(info["Restarts"]), 60 * LIMIT_MIN)
        self.slurm("scontrol", "update", f"JobId={after}", f"TimeLimit={LIMIT}")
        return {**done, "jobs": [job, short, after], "trained_on": True}

    def sent_on(self, job: str, restarts: int, within: float) -> str:
        """Wait until the run that runs in `job` is sent on past a stop: the job requeued
        (PENDING again, Restarts past `restarts`), or a continuation job submitted (the
        run's newest, waiting for `job` to end: its limit can still be set), then for `job`
        to end COMPLETED; the job that runs next. Raises where `job` ended otherwise (a stop
        past the limit: TIMEOUT, never sent on)."""
        def on() -> str:
            newest, _ = self.job()
            _, info = self.job(job)
            state = info.get("JobState", "")
            if newest != job or (state == "PENDING" and int(info.get("Restarts", 0)) > restarts):
                return newest
            if state in ENDED:
                raise RuntimeError(f"time_limit: job {job} ended {state}, not sent on")
            return ""  # (RUNNING, SIGNALING while the notice goes out, COMPLETING...)
        nxt = str(wait(on, within, f"job {job}'s run sent on", every=0.2))
        if nxt != job:
            state = wait(lambda: (lambda st: st if st in ENDED else "")(self.job(job)[1].get("JobState", "")),
                         120, f"job {job}'s end", every=0.5)
            if state != "COMPLETED":
                raise RuntimeError(f"time_limit: job {job} ended {state}, not COMPLETED")
        return nxt

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
                  HPCSHARD_SLURM_NFS=NFS) if NFS else env()
    if "time_limit" in kinds:  # (only then: the other soaks' clocks stay as they were)
        testbed["HPCSHARD_SLURM_SKEW"] = ",".join(f"{n}={s:+g}" for n, s in SKEW.items())
    run([str(SCRIPT), "up", str(CLUSTER)], timeout=600, env=testbed)
    steps = int((FAULTS + 4) * INTERVAL / STEP_S)
    run_dir = (shared if NFS else disk) / "run"
    # The storage faults' hook, in every Python process of the run (see the module's text);
    # out of the workspace, which the run copies
    hook = Path(tempfile.mkdtemp(prefix="hpcshard-chaos-hook-"))
    flag = hook / "storage"
    (hook / "sitecustomize.py").write_text(HOOK.format(runs=sorted({str(run_dir), str(disk / "run")}),
                                                       flag=str(flag)))
    e = env(SLURM_CONF=str(CONF), PYTHONPATH=os.pathsep.join(
        [str(hook), *filter(None, os.environ.get("PYTHONPATH", str(ROOT)).split(os.pathsep))]))
    # What the bench itself looks at (where the run trains, when it committed, the ledger
    # for the accounting) it reads from the disk, not through this host's NFS-like view:
    # the run's own processes and commands see the views, the observer the truth. Through
    # the view, the metrics this host read were a minute behind the ranks (the first soak
    # on NFS-like storage gave up waiting for a commit the run had made).
    truth = disk / "run"
    soak = Soak(truth, e, rng, flag, SKEW if "time_limit" in kinds else {})
    try:
        hpcshard("submit", "--backend", "slurm", "--nodes", "2", "--gpus", "2", "--spares", "1",
                 "jobs/charlm.py", "--run-dir", str(run_dir), "--time", LIMIT,
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
            skewed = any(host in soak.skew for host in at["slurm"].values())
            kind = rng.choice([k for k in kinds if (k not in NODE_KINDS or (usable > 0 and fresh))
                               and (k != "time_limit" or skewed)])
            if skewed and "time_limit" in kinds and not any(f["kind"] == "time_limit" for f in soak.faults):
                kind = "time_limit"  # (at least one: a skewed node may not train again)
            step, _ = soak.step()
            fault = {"time": time.time(), "step": step, **soak.inject(kind, at)}
            soak.faults.append(fault)
            print(f"  {time.strftime('%H:%M:%S')} fault {len(soak.faults)}: {kind} on node "
                  f"{fault['node']} ({fault['slurm_node']}) at step {step}", flush=True)
            next_at = time.time() + gap(rng)
        end = wait(lambda: next((r for r in ledger.read(truth) if r["event"] == "end"
                                 and r["reason"] == "done"), None), 3600, "the run's end", every=2)
        led = ledger.read(truth)
        clocked = one_clock(truth, soak.skew, tmp / "clocked")
        finished = next(r["time"] for r in ledger.read(clocked)
                        if r["event"] == "end" and r["reason"] == "done")
        good = account(clocked, created, finished)
        costs(soak.faults, clocked, created, finished)
        details = {"seed": SEED, "interval_s": INTERVAL, "steps": steps, "ckpt_every": 16,
                   "created": created, "end": finished,
                   "finished": end["reason"] == "done",
                   "faults": soak.faults, "goodput": good.seconds, "wall": good.wall,
                   "ledger_events": [r["event"] for r in led], "replays": replays(truth),
                   "reused": reused(truth, led), "frozen": soak.frozen, "nfs": NFS,
                   "healthy_declared_bad": healthy_declared_bad(soak.faults, led),
                   "skew": soak.skew,
                   "time_limit_stops": limit_stops(soak.faults, led)}
        (RESULTS / ".chaos-details.json").write_text(json.dumps(details, indent=1) + "\n")
    finally:
        flag.unlink(missing_ok=True)  # (a storage fault cut short)
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
        subprocess.run(["cp", str(flag) + ".refused", str(RESULTS / ".chaos-refused")], capture_output=True)
        subprocess.run(["rm", "-rf", str(hook)])
    return report(details, RESULTS / ".chaos-run")


def healthy_declared_bad(faults: list[dict[str, Any]], led: list[dict[str, Any]]) -> list[str]:
    """Slurm nodes declared bad that no node fault touched (a false loss: a node whose
    heartbeats, or whose files, were late)."""
    touched = {f["slurm_node"] for f in faults if f["kind"] in NODE_KINDS}
    bad = {r["slurm_node"] for r in led if r["event"] == "bad_node" and r.get("slurm_node")}
    return sorted(bad - touched)


def saves_failed(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger's failed saves (rank 0's save_failed records): step, error, probe."""
    return [{k: r[k] for k in ("step", "error", "probe")} for r in ledger.read(run_dir)
            if r["event"] == "save_failed"]


def duration(text: str) -> float:
    """Seconds of a Slurm duration as scontrol prints it ([D-]HH:MM:SS)."""
    days, _, clock = text.rpartition("-")
    h, m, sec = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def one_clock(run_dir: Path, skew: dict[str, float], into: Path) -> Path:
    """A copy of the run's records that the accounting reads (metrics.jsonl, the ledger) in
    `into`, each record's times taken back to this host's clock by the skew of the Slurm node
    rank 0 trained on in its cycle (see the module's text); `into`. The metrics hold no
    attempt: each of their start events begins the next start of the ledger's."""
    into.mkdir(parents=True, exist_ok=True)
    led = ledger.read(run_dir)
    starts = [r for r in led if r["event"] == "start"]
    offset: dict[tuple[int, int], float] = {}
    for start in starts:
        slurm = trained_on(run_dir, led, start) or {}
        offset[start["attempt"], start.get("cycle", 0)] = skew.get(slurm[min(slurm)], 0.0) if slurm else 0.0

    def shifted(r: dict[str, Any], by: float) -> dict[str, Any]:
        out = {**r, **{k: r[k] - by for k in ("time", "declared") if isinstance(r.get(k), float | int)}}
        if isinstance(r.get("startup"), dict):
            out["startup"] = {k: v - by if isinstance(v, float | int) else v for k, v in r["startup"].items()}
        return out

    by, seen = 0.0, iter([(s["attempt"], s.get("cycle", 0)) for s in starts])
    metrics = []
    for r in records(run_dir):
        if r.get("event") == "start":
            by = offset.get(next(seen, (-1, 0)), by)
        metrics.append(shifted(r, by))
    (into / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (into / ledger.LEDGER).write_text("".join(
        json.dumps(shifted(r, offset.get((r.get("attempt", -1), r.get("cycle", 0)), 0.0))) + "\n"
        for r in led))
    return into


def limit_stops(faults: list[dict[str, Any]], led: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each time_limit fault's two stops: how the attempt ended (a stop, its step and saved
    step), whether the job was requeued, and the steps the next start trained again (its
    resumed step short of the stop's step: 0, nothing lost)."""
    out = []
    for fault in (f for f in faults if f["kind"] == "time_limit"):
        for attempt in fault["attempts"]:
            end = next((r for r in reversed(led) if r["event"] == "end" and r["attempt"] == attempt), None)
            nxt = next((r for r in led if r["event"] == "start" and r["attempt"] == attempt + 1), None)
            requeued = any(r["event"] in ("requeue", "chain") and r["attempt"] == attempt for r in led)
            stop = {"attempt": attempt, "reason": end and end["reason"], "step": end and end.get("step"),
                    "saved_step": end and end.get("saved_step"), "requeued": requeued,
                    "resumed_step": nxt and nxt.get("resumed_step")}
            both = isinstance(stop["step"], int) and isinstance(stop["resumed_step"], int)
            stop["lost"] = stop["step"] - stop["resumed_step"] if both else None
            out.append(stop)
    return out


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
    starts = [f["time"] for f in faults]  # (this host's clock, as `run_dir`'s records: `one_clock`)
    for fault, start, end in zip(faults, starts, [*starts[1:], finished], strict=True):
        spent = between(pieces, start, end)
        useful = sum(spent.get(k, 0.0) for k in ("training", "checkpoint", "evaluation"))
        fault["cost"] = max(0.0, end - start - useful)
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
    if (run_dir / "spec.json").exists():  # the accounting from the run itself (an older soak's too)
        created = d.get("created") or json.loads((run_dir / "spec.json").read_text())["created"]
        with tempfile.TemporaryDirectory() as tmp:
            clocked = one_clock(run_dir, d.get("skew", {}), Path(tmp))
            ends = [r["time"] for r in ledger.read(clocked) if r["event"] == "end" and r["reason"] == "done"]
            finished = ends[-1] if ends else d.get("end") or created + wall
            measured = account(clocked, created, finished)
            good, wall = measured.seconds, measured.wall
            d.update(goodput=good, wall=wall, end=finished)
            costs(d["faults"], clocked, created, finished)
    effective = good["training"] / wall
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
    stops = d.get("time_limit_stops", [])
    if stops:  # (a soak with time_limit faults: each of its stops requeued, nothing trained lost)
        kept = [s for s in stops if s["requeued"] and s["reason"] == "stop"]
        lost = sum(s["lost"] or 0 for s in stops)
        metrics += [
            Metric(NAME, "time-limit faults' stops saved and sent on (not TIMEOUT)", len(kept), "",
                   f"{len(stops)}", len(kept) == len(stops),
                   note=f"{sum(f.get('trained_on', False) for f in d['faults'])} trained on after a "
                   "notice they planned from durations"),
            Metric(NAME, "steps trained again after the time-limit stops", lost, "steps", "0", lost == 0),
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
