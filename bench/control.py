"""The control plane at scale: N emulated nodes on this machine (N = 2, 8, 32, 128), each a
real launcher process (`bench.control_node`: `launch.node.run_node` and its `Supervisor`)
over one shared run directory, whose one rank is a tiny stdlib process stepping 5 times a
second on the node's progress board (`bench/control_rank.py`; no torch: 128 torch ranks do
not fit this machine).

Per N, in one run: once every rank steps, the machine's CPU over a steady window, then
the run directory's operations per node per second in steady training, counted with
strace on the leader (node 0) and two others (`bench.opcount`: what counts as a metadata
operation is written there). Then, REPEATS times: one rank of a middle node SIGKILLed,
and from this host's one clock: the fault declared (the declaration's time, injected ->
declared), every old rank dead (this bench watches their pids), every node down (the down
records, where the launchers still write them as files), the decision (the ledger's fault
record), every node restarting (each new rank's first instruction) and training again
(each new rank's first step). Last, one more fault with strace on the leader and a
non-leader: the operations one recovery costs. The committed step stays 0 (no
checkpoints); max_restarts and no_progress_restarts are set above the faults injected.

HPCSHARD_COORD (files | store) is passed to the launchers as given: the results file is
named by it (control-files.md, control-store.md). Options:

    python -m bench.control --nodes 2,8,32 --repeats 3 --coord files
    HPCSHARD_CONTROL_NODES=2,8 HPCSHARD_CONTROL_REPEATS=1 python -m bench control

The machine has 2 cores: at 128 nodes the launchers' polling loads it, and every latency
here then includes waiting for a core. The CPU figures say how loaded it was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import control_report as report
from bench.common import PY, RESULTS, ROOT, Metric, env, save, show
from bench.control_node import RANK
from bench.opcount import Counts, Tracer
from bench.stamps import Stamp, cpu_busy, machine_cpu, process_cpu, read_stamps, stamped

NAME = "control"
NODES = (2, 8, 32, 128)
RATE = 5.0
"""Fake steps a second (a rank's board moves a few times a second)."""
STEADY = 5
"""The step at which a fake rank says it is steady (past the watchdog's 3-step warm-up)."""
WINDOW_S = 10.0
"""The steady window over which the CPU is measured."""
STRACE_S = 20.0
"""How long the operations are counted in steady training."""


@dataclass(frozen=True)
class Options:
    nodes: tuple[int, ...] = NODES
    repeats: int = 0
    """Faults per N (0: 3 up to 32 nodes, 1 beyond)."""
    coord: str = ""
    """HPCSHARD_COORD for the launchers ("": not set, the launchers' default)."""
    strace_s: float = STRACE_S
    traced_fault: bool = True

    def repeats_for(self, nodes: int) -> int:
        return self.repeats or (3 if nodes <= 32 else 1)

    @property
    def label(self) -> str:
        return self.coord or "default"

    def command(self) -> str:
        coord = f" --coord {self.coord}" if self.coord else ""
        return (f"python -m bench.control --nodes {','.join(map(str, self.nodes))} --repeats {self.repeats}"
                f"{coord} --strace-s {self.strace_s:g}{'' if self.traced_fault else ' --no-traced-fault'}")


class Cluster:
    """N launchers over one run directory, with a fake rank each."""

    def __init__(self, root: Path, nodes: int, faults: int, opts: Options) -> None:
        self.root, self.n, self.opts = root, nodes, opts
        self.run_dir = root / "run"
        self.stamps = root / "stamps"
        self.logs = root / "logs"
        self.faults = faults
        self.procs: list[subprocess.Popen[bytes]] = []
        self.owner: Any = None

    # -- start and stop ---------------------------------------------------------------
    def start(self) -> None:
        from hpcshard.launch.local import free_ports
        from hpcshard.launch.node import NodeEnv
        from hpcshard.rundir import lease
        from hpcshard.rundir.rankenv import RankEnv
        from hpcshard.rundir.spec import Resolved, RunSpec, create_run_dir

        create_run_dir(self.run_dir)
        self.logs.mkdir()
        # No checkpoints: every restart resumes from step 0, so the budgets must outlast the
        # faults injected (else the no-progress rule stops the run).
        RunSpec(job=str(ROOT / "bench" / "control_rank.py"), sets={}, nodes=self.n, gpus=1, backend="local",
                name=f"control-{self.n}", max_restarts=self.faults + 2, no_progress_restarts=self.faults + 2,
                # (a crash is measured: a rank starved of a core for 5 s must not pass for a hang)
                resolved=Resolved(config={"watchdog_floor_s": 60.0})).write(self.run_dir)
        self.owner = lease.take(self.run_dir, lease.Owner.of_process("bench control"), lambda job: False)
        (port, coord_port), run_id = free_ports(2), f"ctl{uuid.uuid4().hex[:8]}"
        base = env(HPCSHARD_WARM_START="0", BENCH_CONTROL_STAMPS=str(self.stamps),
                   BENCH_CONTROL_RATE=str(RATE), BENCH_CONTROL_STEADY=str(STEADY),
                   BENCH_CONTROL_STEPS=str(int(RATE * 3600)),
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        if self.opts.coord:
            base["HPCSHARD_COORD"] = self.opts.coord
        for rank in range(self.n):
            node = NodeEnv(node_rank=rank, nnodes=self.n, per_node=1, rdzv_host="127.0.0.1", rdzv_port=port,
                           run_id=run_id, coord_port=coord_port)
            ranks = RankEnv(attempt=0, owner=self.owner.token)
            with (self.logs / f"node-{rank}.log").open("wb") as log:
                self.procs.append(subprocess.Popen(
                    [PY, "-m", "bench.control_node", str(self.run_dir)], cwd=ROOT,
                    env={**base, **node.to_environ(), **ranks.to_environ()}, stdout=log,
                    stderr=subprocess.STDOUT))

    def stop(self) -> None:
        from hpcshard.launch.procs import descendants, send
        from hpcshard.rundir import lease

        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                send([*descendants(p.pid), p.pid], signal.SIGKILL)
                p.wait()
        if self.owner is not None:
            lease.release(self.run_dir, self.owner)

    # -- waiting ----------------------------------------------------------------------
    def check(self) -> None:
        """RuntimeError when a launcher has ended (the bench has not asked it to)."""
        ended = [(n, p.returncode) for n, p in enumerate(self.procs) if p.poll() is not None]
        if ended:
            n, code = ended[0]
            tail = (self.logs / f"node-{n}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{len(ended)} launcher(s) ended; node {n} exited {code}:\n{tail}")

    def read(self) -> list[Stamp]:
        return read_stamps(self.stamps)

    def wait_for(self, event: str, cycle: int, timeout: float) -> dict[int, Stamp]:
        """Every node's stamp `event` of `cycle`."""
        deadline = time.monotonic() + timeout
        while len(found := stamped(self.read(), event, cycle)) < self.n:
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(found)} of {self.n} ranks reached {event!r} in cycle {cycle} "
                                   f"after {timeout:.0f} s")
            time.sleep(0.1)
        return found

    # -- what is measured ---------------------------------------------------------------
    def steady_cpu(self, cycle: int) -> dict[str, float]:
        """The machine and this bench's processes over WINDOW_S of steady training."""
        ranks = [s.pid for s in stamped(self.read(), "start", cycle).values()]
        launchers = [p.pid for p in self.procs]
        m0, l0, r0 = machine_cpu(), process_cpu(launchers), process_cpu(ranks)
        time.sleep(WINDOW_S)
        m1, l1, r1 = machine_cpu(), process_cpu(launchers), process_cpu(ranks)
        return {"busy": cpu_busy(m0, m1), "load1": os.getloadavg()[0],
                "launcher_cores": (l1 - l0) / WINDOW_S, "rank_cores": (r1 - r0) / WINDOW_S,
                "launcher_ms_per_node_s": 1000 * (l1 - l0) / WINDOW_S / self.n}

    def sampled(self) -> dict[str, int]:
        """Which launchers strace watches: the leader and up to two others."""
        others = sorted({1, self.n - 1} - {0})
        return {"leader": self.procs[0].pid, **{f"node{n}": self.procs[n].pid for n in others}}

    def steady_ops(self) -> dict[str, Counts]:
        tracer = Tracer(self.sampled(), self.root, self.run_dir)
        time.sleep(self.opts.strace_s)
        return tracer.stop()

    def fault(self, cycle: int, traced: bool = False) -> dict[str, Any]:
        """Kill the rank of the middle node; time the recovery (every time from this
        host's clock; relative to the declaration, but `detect`)."""
        from hpcshard.launch.procs import alive

        victim = self.n // 2
        old = {n: s.pid for n, s in self.wait_for("steady", cycle, 120 + self.n).items()}
        tracer = (Tracer({"leader": self.procs[0].pid, "other": self.procs[self.n - 1].pid}, self.root,
                         self.run_dir) if traced else None)
        m0 = machine_cpu()
        injected = time.time()
        os.kill(old[victim], signal.SIGKILL)
        dead: dict[int, float] = {}
        deadline = time.monotonic() + 120 + self.n
        while len(stamped(self.read(), "first", cycle + 1)) < self.n or len(dead) < self.n:
            now = time.time()
            dead.update({n: now for n, pid in old.items() if n not in dead and not alive(pid)})
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"cycle {cycle + 1}: {len(stamped(self.read(), 'first', cycle + 1))} of "
                                   f"{self.n} ranks stepped after {120 + self.n} s")
            time.sleep(0.05)
        ops = tracer.stop() if tracer else {}
        busy, load1 = cpu_busy(m0, machine_cpu()), os.getloadavg()[0]
        return {**self.timeline(cycle, injected, dead), "busy": busy, "load1": load1,
                **({"ops": {k: _counts(c) for k, c in ops.items()}} if ops else {})}

    def timeline(self, cycle: int, injected: float, dead: dict[int, float]) -> dict[str, Any]:
        from hpcshard.rundir import ledger

        fault = next(r for r in ledger.read(self.run_dir)
                     if r.get("event") == "fault" and r.get("cycle") == cycle)
        declared = float(fault["declared"])
        stamps = self.read()
        starts = [s.time for s in stamped(stamps, "start", cycle + 1).values()]
        firsts = [s.time for s in stamped(stamps, "first", cycle + 1).values()]
        downs = self.downs(cycle)
        shared = self.run_dir / "launch" / f"next-0-{cycle}.json"  # (the decision's file, either channel)
        row: dict[str, Any] = {
            "cycle": cycle, "detect": declared - injected, "ranks_dead": max(dead.values()) - declared,
            "down_first": min(downs) - declared if downs else None,
            "down_all": max(downs) - declared if len(downs) == self.n else None,
            "decided": float(fault["time"]) - declared,
            "decided_file": shared.stat().st_mtime - declared if shared.exists() else None,
            "restarting_first": min(starts) - declared, "restarting_all": max(starts) - declared,
            "training_first": min(firsts) - declared, "training_all": max(firsts) - declared}
        return row

    def downs(self, cycle: int) -> list[float]:
        """When each node said it was down (the file channel's down records; none where the
        launchers no longer write them as files)."""
        found = []
        for path in (self.run_dir / "launch").glob(f"down-0-{cycle}-*.json"):
            try:
                found.append(float(json.loads(path.read_text())["time"]))
            except (OSError, ValueError, KeyError):
                continue
        return found

    def file_channel(self) -> bool:
        """Did the launchers coordinate through files (fault or down files in launch/; with
        the store each launcher writes its heartbeat file only at its start and end, and
        each decision is also created as a file, the arbiter of a job cut in two)?"""
        names = [p.name for p in (self.run_dir / "launch").iterdir()]
        return any(name.startswith(("fault-", "down-")) for name in names)


def spawn_floor(root: Path, nodes: int) -> float:
    """This host's floor under "every node training": `nodes` fake ranks started at once by
    one process, without launchers or a control plane; seconds from the first start to the
    last rank's first step (on a cluster each node starts its own, on its own cores)."""
    from hpcshard.rundir.progress import Board, board_path

    stamps = root / "floor-stamps"
    boards = [Board.create(board_path("ctlfloor", n), 1) for n in range(nodes)]
    base = env(BENCH_CONTROL_STAMPS=str(stamps),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    try:
        began = time.time()
        procs = [subprocess.Popen([PY, str(RANK), str(n), "1", str(RATE), "1"], cwd=ROOT,
                                  env={**base, "HPCSHARD_BOARD": str(b.path), "HPCSHARD_NODE_RANK": str(n)})
                 for n, b in enumerate(boards)]
        for p in procs:
            p.wait()
        return max(s.time for s in stamped(read_stamps(stamps), "first", 0).values()) - began
    finally:
        for b in boards:
            b.close(remove=True)


def _counts(c: Counts) -> dict[str, Any]:
    return {"seconds": round(c.seconds, 2), "metadata_per_s": round(c.rate("metadata"), 2),
            "data_per_s": round(c.rate("data"), 2), "metadata": c.of("metadata"), "data": c.of("data"),
            "calls": dict(c.calls.most_common()), "files": dict(c.files.most_common())}


def measure(nodes: int, opts: Options) -> dict[str, Any]:
    """One N: steady CPU, steady operations, then the faults."""
    repeats = opts.repeats_for(nodes)
    with tempfile.TemporaryDirectory(prefix=".tmp-control-", dir=RESULTS) as tmp:
        floor = spawn_floor(Path(tmp), nodes)
        cluster = Cluster(Path(tmp), nodes, repeats + 1, opts)
        began = time.monotonic()
        try:
            cluster.start()
            cluster.wait_for("steady", 0, 120 + 2 * nodes)
            up = time.monotonic() - began
            print(f"  N={nodes}: every rank steady after {up:.0f} s", flush=True)
            cpu = cluster.steady_cpu(0)
            ops = cluster.steady_ops() if Tracer.available() else {}
            faults = []
            for cycle in range(repeats):
                faults.append(cluster.fault(cycle))
                print(f"  N={nodes}: fault {cycle}: decided {faults[-1]['decided']:.2f} s, training again "
                      f"{faults[-1]['training_all']:.2f} s after the declaration", flush=True)
            traced = cluster.fault(repeats, traced=True) if opts.traced_fault and Tracer.available() else None
            files = cluster.file_channel()
        finally:
            cluster.stop()
    return {"nodes": nodes, "spawn_floor_s": floor, "startup_s": up, "cpu": cpu,
            "ops": {k: _counts(c) for k, c in ops.items()}, "faults": faults, "traced_fault": traced,
            "file_channel": files}


def main(opts: Options | None = None) -> list[Metric]:
    """Every N of `opts` (default: from the environment, see the module's text); the results
    page and its data in results/control-LABEL.md and .json, the summary in results/latest."""
    opts = opts or Options(
        nodes=tuple(int(n) for n in os.environ.get("HPCSHARD_CONTROL_NODES", "2,8,32,128").split(",")),
        repeats=int(os.environ.get("HPCSHARD_CONTROL_REPEATS", "0")),
        coord=os.environ.get("HPCSHARD_COORD", ""),
        strace_s=float(os.environ.get("HPCSHARD_CONTROL_STRACE_S", str(STRACE_S))))
    results = [measure(n, opts) for n in opts.nodes]
    rows = [report.summary(r) for r in results]
    stem = RESULTS / f"control-{opts.label}"
    stem.with_suffix(".json").write_text(json.dumps({"command": opts.command(), "results": results,
                                                     "summary": rows}, indent=2) + "\n")
    machine = (f"{os.cpu_count()} cores, Python {platform.python_version()}, "
               f"{platform.system()} {platform.release()}")
    page = report.markdown(opts.command(), opts.label, opts.strace_s, results, rows,
                           time.strftime("%Y-%m-%d %H:%M"), machine)
    stem.with_suffix(".md").write_text(page)
    found = report.metrics(rows)
    save(f"{NAME}-{opts.label}", found, {"summary": rows, "command": opts.command()})
    return found


def cli(argv: list[str]) -> Options:
    """`python -m bench.control`'s options (bad values: argparse's message, exit 2)."""
    parser = argparse.ArgumentParser(prog="python -m bench.control", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=",".join(map(str, NODES)),
                        help="emulated node counts, e.g. 2,8,32")
    parser.add_argument("--repeats", type=int, default=0, help="faults per N (0: 3 up to 32 nodes, 1 beyond)")
    parser.add_argument("--coord", default=os.environ.get("HPCSHARD_COORD", ""),
                        choices=["", "files", "store"],
                        help="HPCSHARD_COORD for the launchers (default: as in this environment)")
    parser.add_argument("--strace-s", type=float, default=STRACE_S, help="seconds the operations are counted")
    parser.add_argument("--no-traced-fault", action="store_true", help="leave out the traced recovery")
    args = parser.parse_args(argv)
    try:
        nodes = tuple(int(n) for n in args.nodes.split(","))
    except ValueError:
        parser.error(f"--nodes {args.nodes!r}: give node counts separated by commas, e.g. 2,8,32")
    if any(n < 2 for n in nodes) or args.repeats < 0:
        parser.error("--nodes: each at least 2 (one leader, one other); --repeats: 0 or more")
    return Options(nodes=nodes, repeats=args.repeats, coord=args.coord, strace_s=args.strace_s,
                   traced_fault=not args.no_traced_fault)


if __name__ == "__main__":
    show(main(cli(sys.argv[1:])))
