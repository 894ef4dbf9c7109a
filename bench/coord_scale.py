"""The store's own terms at scale: node 0's launcher (the launchers' store, `coord.Server`,
and the decider's `coord.Channel`, the code a real node 0 runs) against N launchers
emulated as connections speaking the store's protocol, for N = 2 to 4,096.

Why a second control-plane bench: `bench.control` runs N real launchers, each with a
rank, on this machine's 2 cores; at 128 nodes that is 256 processes, the host 98% busy
(load 30), and the decision latency grows 11.5x from 2 nodes, most of it each launcher
waiting for a core to kill its rank. On a cluster each launcher has its own node; what
all of them share is node 0's launcher: its store answers every heartbeat and down
record, pushes every fault and decision, and its decider scans the down records. That is
what this bench measures, with the rest made as cheap as it can be: the N launchers are
asyncio connections in two processes (one per core), each doing what a launcher does
through the store (a heartbeat exchange a second, watching the leader's; when a fault is
pushed, a down record of a launcher's size and the look for its decider, `Supervisor.decider`:
the two lowest launchers' heartbeats; nothing else: its rank's death, a local SIGKILL of
its own, does not grow with N on a cluster, though the slowest of N launchers does, a
little). Their work is still serialized on this host's 2 cores (a cluster does it in
parallel): an upper bound on what N adds.

Per N: every emulated launcher connected and beating, node 0's store thread's CPU over a
steady window (what its heartbeats cost it a second); then REPEATS faults, each declared by
node N//2 (a create of fault/A/C, as a launcher whose rank died): the store's own clock says
when the fault was set, each down record arrived and the decision was set; the emulators
say when each launcher heard the fault and the decision. One host, one monotonic clock.

    python -m bench.coord_scale --nodes 2,8,32,128,512,1024,4096 --repeats 5
    HPCSHARD_COORD_NODES=2,8 python -m bench coord
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PY, RESULTS, ROOT, Metric, env, save, show
from hpcshard.launch import ports

NAME = "coord"
NODES = (2, 8, 32, 128, 512, 1024, 4096)
REPEATS = 5
STEADY_S = 10.0
"""The steady window over which node 0's CPU is measured."""
GAP_S = 2.0
"""Between one decision and the next fault."""
EMULATORS = 2
KEY = "bench-coord-key"
ATTEMPT = 0


# -- node 0: the real store and the real decider -------------------------------------------
def node0(run_dir: Path, nodes: int, faults: int, out: Path, port_file: Path) -> None:
    """Serve the store, beat and watch every node as the leader does, and decide each fault
    the way `Supervisor.decide` waits for it (through `coord.Channel`)."""
    from hpcshard.launch import coord
    from hpcshard.launch.liveness import BEAT_S
    from hpcshard.launch.supervise import DOWN_LOOK_S, POLL_S

    class Timed(coord.Server):
        """The store, noting (its own clock) when each fault, down and decision was set."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.times: dict[str, float] = {}

        def _set(self, key: str, value: Any) -> None:
            if key.startswith(("fault/", "down/", "next/")):
                self.times.setdefault(key, time.monotonic())
            super()._set(key, value)

        def on_loop(self) -> tuple[float, dict[str, float], int]:
            """The store thread's CPU seconds, what it noted, its requests: read on its loop."""

            async def read() -> tuple[float, dict[str, float], int]:
                return time.thread_time(), dict(self.times), self.requests

            return asyncio.run_coroutine_threadsafe(read(), self.loop).result(30)

    ports.raise_fd_limit()
    server = Timed(KEY, 0, attempt=ATTEMPT, nodes=nodes)
    server.start()
    chan = coord.Channel(run_dir, 0)
    chan.server = server
    if not chan.open("127.0.0.1", server.port, KEY, ATTEMPT, serve=False):
        raise SystemExit(f"node 0 could not join its own store: {chan.lost_why}")
    port_file.with_suffix(".tmp").write_text(str(server.port))
    port_file.with_suffix(".tmp").rename(port_file)
    seq, beaten = 0, 0.0
    deadline = time.monotonic() + 60 + nodes * 0.05 + faults * 60

    def tick(seconds: float) -> None:
        """Wait, beating as the leader does from every wait (`Supervisor.beat`, `_look`):
        its heartbeat at most every BEAT_S, every node's watched."""
        nonlocal seq, beaten
        if time.monotonic() > deadline:
            raise SystemExit(f"node 0 at {nodes} nodes: not done within its deadline")
        if time.monotonic() - beaten >= BEAT_S:
            beaten, seq = time.monotonic(), seq + 1
            chan.beats(ATTEMPT, nodes)
            chan.beat(ATTEMPT, 0, {"node": 0, "host": "node0", "pid": os.getpid(), "seq": seq})
        chan.wait(seconds, on_store=seconds)

    def idle(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            tick(min(POLL_S, max(0.0, until - time.monotonic())))

    # Everyone connected, then the steady window.
    while len(chan.present() or set()) < nodes:
        idle(0.2)
    idle(2.0)
    (cpu0, _, asked0), load0 = server.on_loop(), os.getloadavg()
    wall0, proc0 = time.monotonic(), time.process_time()
    idle(STEADY_S)
    cpu1, _, asked1 = server.on_loop()
    steady = {"store_cpu_s": cpu1 - cpu0, "process_cpu_s": time.process_time() - proc0,
              "wall_s": time.monotonic() - wall0, "requests": asked1 - asked0, "load1": load0[0]}
    port_file.with_suffix(".steady").write_text("1")  # (the declarer may start)
    cycles = []
    for cycle in range(faults):
        while chan.fault(ATTEMPT, cycle) is None:
            tick(POLL_S)
        (cpu_before, _, _), seen, proc_before = server.on_loop(), time.monotonic(), time.process_time()
        chan.mark_down(ATTEMPT, cycle, 0, _down(0))
        while True:
            down = chan.nodes_down(ATTEMPT, cycle, nodes)
            missing = sorted(set(range(nodes)) - set(down))
            chan.beats(ATTEMPT, nodes, missing)  # (`Supervisor._look`: are the missing ones lost?)
            if not missing:
                break
            tick(DOWN_LOOK_S)
        all_down = time.monotonic()
        downs = chan.downs(ATTEMPT, cycle, nodes)
        chan.decide(ATTEMPT, cycle, {"restart": True, "cycle": cycle, "nodes": len(downs)})
        done = time.monotonic()
        idle(0.5)  # (the decision's pushes and the launchers' looks, on the store's CPU)
        (cpu_after, times, _), window = server.on_loop(), time.monotonic() - seen
        proc_cpu = time.process_time() - proc_before
        cycles.append({
            "declared": times[f"fault/{ATTEMPT}/{cycle}"], "seen": seen,
            "last_down": max(t for k, t in times.items() if k.startswith(f"down/{ATTEMPT}/{cycle}/")),
            "all_down": all_down, "decided": times[f"next/{ATTEMPT}/{cycle}"], "returned": done,
            "downs": len(downs), "store_cpu_s": cpu_after - cpu_before, "process_cpu_s": proc_cpu,
            "window_s": window,
            "load1": os.getloadavg()[0]})
    idle(1.0)
    out.write_text(json.dumps({"steady": steady, "cycles": cycles}))
    chan.close()
    server.close()


def _down(node: int) -> dict[str, Any]:
    """A down record of a launcher's size (`Supervisor.recover`): one rank, and its flight
    record as `flight.brief` keeps it (a hang's; a crash has none)."""
    brief = {"rank": node, "pg_config": {"0": {"ranks": list(range(8)), "desc": "default_pg"}},
             "pg_status": {"0": {"last_enqueued_collective": 5678, "last_completed_collective": 5677}},
             "entries": [{"process_group": ["0", "default_pg"], "collective_seq_id": 5678,
                          "profiling_name": "gloo:reduce_scatter", "input_sizes": [[1024]],
                          "state": "scheduled"}]}
    return {"host": f"node{node}", "dead": [node], "reached": 1234, "committed": 0,
            "ranks": {str(node): {"step": 1234, "where": "backward"}}, "flight": {str(node): brief}}


# -- the other launchers, emulated -------------------------------------------------------
async def _launcher(node: int, port: int, faults: int, declarer: bool, go: Path,
                    heard: dict[str, dict[int, float]]) -> None:
    from hpcshard.launch import coord
    from hpcshard.launch.supervise import DECIDER_LOOK

    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=coord.LINE_LIMIT)

    def send(message: dict[str, Any]) -> None:
        writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    send({"op": "hello", "id": 0, "node": node, "key": KEY, "attempt": ATTEMPT, "watch": list(coord.WATCHED)})
    json.loads(await reader.readline())
    seq, watched = 0, [0]

    async def beating() -> None:  # (`Channel.beat`: its own, and the heartbeats it watches)
        nonlocal seq
        await asyncio.sleep(random.random())  # (launchers start at different times)
        while True:
            seq += 1
            send({"op": "exchange", "id": seq, "get": [f"alive/{ATTEMPT}/{n}" for n in watched],
                  "set": {f"alive/{ATTEMPT}/{node}": {"node": node, "host": f"node{node}", "pid": 1000 + node,
                                                      "seq": seq}}})
            await asyncio.sleep(1.0)

    async def declaring() -> None:
        while not go.exists():
            await asyncio.sleep(0.1)
        for cycle in range(faults):
            await asyncio.sleep(GAP_S)
            send({"op": "create", "id": -1, "key": f"fault/{ATTEMPT}/{cycle}",
                  "value": {"time": time.time(), "node": node, "rank": node, "cause": "exit -9"}})
            while cycle not in heard["next"]:
                await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(beating())]
    if declarer:
        tasks.append(asyncio.create_task(declaring()))
    pushes = 0
    while pushes < 2 * faults and (line := await reader.readline()):
        message = json.loads(line)
        kind, _, rest = str(message.get("push", "")).partition("/")
        if kind not in ("fault", "next"):
            continue
        cycle, now = int(rest.rsplit("/", 1)[1]), time.monotonic()
        pushes += 1
        heard[kind].setdefault(cycle, now)
        heard.setdefault(f"{kind}/{cycle}", {})[node] = now
        if kind == "fault":
            send({"op": "exchange", "id": -2, "set": {f"down/{ATTEMPT}/{cycle}/{node}": {
                "time": time.time(), "node": node, **_down(node)}}})
            # Then it looks for its decider (`Supervisor.decider`): the lowest launchers'
            # heartbeats, asked at once and watched from then on.
            watched = list(range(min(node, DECIDER_LOOK)))
            if watched:
                send({"op": "exchange", "id": -3, "get": [f"alive/{ATTEMPT}/{n}" for n in watched]})
        else:
            watched = [0]
    for task in tasks:
        task.cancel()
    writer.close()


def emulate(port: int, first: int, last: int, nodes: int, faults: int, go: Path, out: Path) -> None:
    """Launchers `first`..`last` as connections; where each heard each fault and decision."""
    ports.raise_fd_limit()
    heard: dict[str, dict[int, float]] = {"fault": {}, "next": {}}

    async def main() -> None:
        start = time.process_time()
        await asyncio.wait_for(asyncio.gather(*(
            _launcher(n, port, faults, n == nodes // 2, go, heard) for n in range(first, last))),
            timeout=60 + nodes * 0.05 + faults * 60)
        heard["cpu"] = {0: time.process_time() - start}

    asyncio.run(main())
    out.write_text(json.dumps({k: {str(n): t for n, t in v.items()} for k, v in heard.items()}))


# -- the bench ------------------------------------------------------------------------
def one(nodes: int, faults: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hpcshard-coord-") as tmp:
        root = Path(tmp)
        run_dir, port_file, go = root / "run", root / "port", root / "port.steady"
        run_dir.mkdir()
        e = env(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        common = ["--nodes", str(nodes), "--repeats", str(faults)]
        procs: list[subprocess.Popen[bytes]] = []

        def spawn(*args: str) -> subprocess.Popen[bytes]:
            procs.append(subprocess.Popen([PY, "-m", "bench.coord_scale", *common, *args], cwd=ROOT, env=e))
            return procs[-1]

        try:
            leader = spawn("--node0", str(run_dir), "--out", str(root / "node0.json"),
                           "--port-file", str(port_file))
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if leader.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node 0's store did not start (exit {leader.poll()})")
                time.sleep(0.1)
            port = port_file.read_text()
            cut = [1 + (nodes - 1) * i // EMULATORS for i in range(EMULATORS + 1)]
            ranges = [(a, b) for a, b in zip(cut, cut[1:], strict=False) if b > a]
            for i, (a, b) in enumerate(ranges):
                spawn("--emulate", port, str(a), str(b), "--go", str(go), "--out", str(root / f"emu{i}.json"))
            for proc in procs:
                if proc.wait(120 + nodes * 0.05 + faults * 60) != 0:
                    what = "node 0" if proc is leader else "an emulator"
                    raise RuntimeError(f"bench.coord_scale at {nodes} nodes: {what} exited {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        found = json.loads((root / "node0.json").read_text())
        emus = [json.loads((root / f"emu{i}.json").read_text()) for i in range(len(ranges))]
    cycles = found["cycles"]
    for c, cycle in enumerate(cycles):
        fault_heard = [t for e in emus for t in e.get(f"fault/{c}", {}).values()]
        next_heard = [t for e in emus for t in e.get(f"next/{c}", {}).values()]
        cycle["every_heard_fault"] = max(fault_heard) if fault_heard else cycle["seen"]
        cycle["every_heard_decision"] = max(next_heard) if next_heard else cycle["returned"]
    emu_cpu = sum(float(e["cpu"]["0"]) for e in emus)
    return {"nodes": nodes, "cycles": cycles, "steady": found["steady"], "emulators_cpu_s": emu_cpu}

def _after(cycles: list[dict[str, Any]], field: str) -> float:
    return statistics.median(c[field] - c["declared"] for c in cycles)


def real_two(repeats: int) -> float:
    """declared -> decided with 2 real launchers, each with a rank (`bench.control`'s cluster,
    through the store), measured here beside the store alone: the term each launcher adds
    on its own node, whatever N."""
    from bench import control

    found = control.measure(2, control.Options(nodes=(2,), repeats=repeats, coord="store", strace_s=1.0,
                                               traced_fault=False))
    return statistics.median(f["decided"] for f in found["faults"] if f.get("decided") is not None)


def report(results: list[dict[str, Any]], command: str, real_2: float | None = None
           ) -> tuple[list[Metric], str]:
    """The metrics and the page (`results/coord-scale.md`)."""
    metrics: list[Metric] = []
    rows = []
    for r in results:
        n, cycles, steady = r["nodes"], r["cycles"], r["steady"]
        decided = _after(cycles, "decided")
        store_ms_s = 1000 * steady["store_cpu_s"] / steady["wall_s"]
        # (a fault's own: less what the heartbeats cost over its window at the steady rate)
        rate = steady["store_cpu_s"] / steady["wall_s"]
        fault_ms = 1000 * statistics.median(c["store_cpu_s"] - rate * c.get("window_s", 0.0) for c in cycles)
        proc_rate = steady["process_cpu_s"] / steady["wall_s"]
        node0_ms = 1000 * statistics.median(c.get("process_cpu_s", c["store_cpu_s"])
                                            - proc_rate * c.get("window_s", 0.0) for c in cycles)
        r.update(decided=decided, store_ms_s=store_ms_s, fault_ms=fault_ms, node0_ms=node0_ms)
        rows.append(f"| {n} | {len(cycles)} | {_after(cycles, 'every_heard_fault'):.3f} | "
                    f"{_after(cycles, 'last_down'):.3f} | {_after(cycles, 'all_down'):.3f} | {decided:.3f} | "
                    f"{_after(cycles, 'every_heard_decision'):.3f} | {fault_ms:.1f} | {store_ms_s:.1f} | "
                    f"{1000 * steady['process_cpu_s'] / steady['wall_s']:.1f} | "
                    f"{statistics.median(c.get('load1', 0.0) for c in cycles):.1f} |")
        metrics.append(Metric(NAME, f"N={n}: declared -> decided (store alone, median of {len(cycles)})",
                              decided, "s"))
        metrics.append(Metric(NAME, f"N={n}: node 0's store thread, steady (heartbeats)", store_ms_s, "ms/s"))
    by_n = {r["nodes"]: r for r in results}
    composed = ""
    if 2 in by_n and 128 in by_n:
        grown = by_n[128]["decided"] - by_n[2]["decided"]
        node0 = (by_n[128]["node0_ms"] - by_n[2]["node0_ms"]) / 1000
        metrics.append(Metric(NAME, "N=128 - N=2: declared -> decided here (upper bound of what N adds)",
                              grown, "s"))
        metrics.append(Metric(NAME, "N=128 - N=2: node 0's CPU per fault (what a cluster serializes)",
                              node0, "s"))
        if real_2:
            ratio, upper = (real_2 + node0) / real_2, (real_2 + grown) / real_2
            metrics.append(Metric(
                NAME, "decision latency N=128 / N=2 on a cluster (real launchers' N=2 + node 0's added CPU)",
                ratio, "x", "<= 2x", ratio <= 2.0, f"{real_2 + node0:.3f} s vs {real_2:.3f} s"))
            metrics.append(Metric(
                NAME, "decision latency N=128 / N=2, upper bound (real launchers' N=2 + this host's wall)",
                upper, "x", "", None, f"{real_2 + grown:.3f} s vs {real_2:.3f} s"))
            composed = (
                f"Decision latency as a cluster would see it. At 2 nodes, the real launchers' own "
                f"(measured in this run with `bench.control`'s cluster: each launcher told of the fault, "
                f"killing its rank and saying so, the decider deciding): {real_2:.3f} s. What 128 nodes "
                f"add to it is what they share, "
                f"node 0's launcher: its process's CPU for a fault, beyond its heartbeats, grows by "
                f"{node0 * 1000:.1f} ms from 2 to 128 nodes here, so {real_2 + node0:.3f} s at 128 nodes, "
                f"**{ratio:.2f}x** (target <= 2x). An upper bound from this host: the wall time from the "
                f"fault to the decision grows by {grown * 1000:.1f} ms, but that includes the 127 emulated "
                f"launchers' own work done one after another on its 2 cores (a cluster does it in "
                f"parallel), and the decider's look for the downs every 50 ms: {real_2 + grown:.3f} s, "
                f"{upper:.2f}x. Left out of both: the slowest of 128 launchers to kill its rank is a little "
                f"slower than the slower of 2 (a tail, not node 0's).\n")
    ns = [float(r["nodes"]) for r in results]
    lines = [
        "# The store at scale: node 0's launcher against N emulated launchers\n",
        f"`{command}`\n",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"Linux {platform.release()}.\n",
        "Node 0 runs the real store (`coord.Server`) and the real decider's calls (`coord.Channel`: "
        "its heartbeat watching every node each second; after a fault its down record, `nodes_down` "
        "and `beats` of the missing every 50 ms, `downs`, `decide` with its file); the other N-1 "
        "launchers are asyncio connections in two processes speaking the store's protocol (a heartbeat "
        "a second; when a fault is pushed, a down record and the look for the decider). Times are "
        "seconds after the store set the fault, medians over the faults; CPU is node 0's store thread "
        "(`time.thread_time` on its loop).\n",
        "| N | faults | every launcher heard the fault | last down record in | decider saw every down | "
        "decided | every launcher heard the decision | store CPU per fault, beyond its heartbeats (ms) | "
        "store CPU steady (ms/s) | "
        "node 0 process CPU steady (ms/s) | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if len(set(ns)) >= 3:  # (a line through two points fits their noise)
        b, a = statistics.linear_regression(ns, [r["decided"] for r in results])
        sb, sa = statistics.linear_regression(ns, [r["store_ms_s"] for r in results])
        fb, fa = statistics.linear_regression(ns, [r["fault_ms"] for r in results])
        lines += [
            f"Fitted over N (least squares): declared -> decided = {a:.3f} s + {b * 1000:.4f} ms x N; "
            f"the store's steady CPU = {sa:.2f} + {sb:.4f} x N ms a second; its CPU per fault = "
            f"{fa:.2f} + {fb:.4f} x N ms.\n",
            composed,
            "Projected from those terms (one store on node 0, each launcher on its own node):",
        ]
        for n in (1024, 10_000):
            share = (sa + sb * n) / 10
            metrics.append(Metric(NAME, f"projected {n:,} nodes: the store's heartbeats, share of a core",
                                  share, "%"))
            if share >= 100:  # (one thread: past a whole core the line means nothing)
                lines.append(f"- {n:,} nodes: the store's heartbeats alone would take {share:.0f}% of its "
                             f"one core: it saturates at about {(1000 - sa) / sb:,.0f} nodes, and no latency "
                             "is projected past that.")
                continue
            lines.append(f"- {n:,} nodes: declared -> decided {a + b * n:.2f} s; the store's heartbeats "
                         f"take {share:.1f}% of one core; a fault {fa + fb * n:.0f} ms of it.")
            metrics.append(Metric(NAME, f"projected {n:,} nodes: declared -> decided", a + b * n, "s"))
    return metrics, "\n".join(lines) + "\n"


def run(nodes: tuple[int, ...] = NODES, repeats: int = REPEATS, write: bool = True) -> list[Metric]:
    command = f"python -m bench.coord_scale --nodes {','.join(map(str, nodes))} --repeats {repeats}"
    results = []
    for n in nodes:
        print(f"coord: {n} nodes", file=sys.stderr, flush=True)
        results.append(one(n, repeats))
    print("coord: 2 real launchers", file=sys.stderr, flush=True)
    metrics, text = report(results, command, real_two(repeats))
    if write:
        (RESULTS / "coord-scale.md").write_text(text)
        (RESULTS / "coord-scale.json").write_text(json.dumps(results, indent=1) + "\n")
        save(NAME, metrics, {"command": command})
    print(text)
    return metrics


def main() -> list[Metric]:
    """`python -m bench coord` (HPCSHARD_COORD_NODES, HPCSHARD_COORD_REPEATS)."""
    nodes = os.environ.get("HPCSHARD_COORD_NODES", ",".join(map(str, NODES)))
    repeats = int(os.environ.get("HPCSHARD_COORD_REPEATS", REPEATS))
    return run(tuple(int(n) for n in nodes.split(",") if n), repeats)


def cli(argv: list[str]) -> None:
    """`python -m bench.coord_scale`, and its own node 0 and emulators."""
    parser = argparse.ArgumentParser(prog="python -m bench.coord_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=",".join(map(str, NODES)), help="node counts, e.g. 2,8,128")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="faults per N")
    parser.add_argument("--node0", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--emulate", nargs=3, metavar=("PORT", "FIRST", "END"), help=argparse.SUPPRESS)
    parser.add_argument("--go", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print, leave bench/results as it is")
    args = parser.parse_args(argv)
    try:
        nodes = tuple(int(n) for n in str(args.nodes).split(",") if n)
    except ValueError:
        parser.error(f"--nodes {args.nodes!r}: give node counts separated by commas, e.g. 2,8,128")
    if not nodes or any(n < 2 for n in nodes) or len(set(nodes)) < len(nodes) or args.repeats < 1:
        parser.error(f"--nodes {args.nodes!r}: each at least 2 (node 0 and a declarer), none twice; "
                     "--repeats: 1 or more")
    if args.node0:
        node0(args.node0, nodes[0], args.repeats, args.out, args.port_file)
    elif args.emulate:
        port, first, end = (int(v) for v in args.emulate)
        emulate(port, first, end, nodes[0], args.repeats, args.go, args.out)
    else:
        show(run(nodes, args.repeats, write=not args.no_write))


if __name__ == "__main__":
    cli(sys.argv[1:])
