"""The control-plane bench's tables (`bench.control`): one row of medians per N, the
operations' projection to more nodes, the results page and the summary metrics. Pure:
everything comes in as the bench's result dicts."""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import Metric

NAME = "control"
TIMES = ("detect", "ranks_dead", "down_all", "decided_file", "decided", "restarting_first", "restarting_all",
         "training_first", "training_all", "busy", "load1")
"""Per fault (seconds after the declaration, but `detect`: injected -> declared), and the
machine's CPU over the fault."""
PROJECTED = (1024, 10000)


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _ops(traced: dict[str, Any] | None, who: str, what: str = "metadata") -> Any:
    return ((traced or {}).get("ops") or {}).get(who, {}).get(what)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """One N's row: medians over its faults, and the operations in steady training. The
    mean per node weighs the leader once and the others' mean N-1 times."""
    ops, n = result["ops"], result["nodes"]
    leader = ops.get("leader", {})
    others = [c["metadata_per_s"] for k, c in ops.items() if k != "leader"]
    other = statistics.mean(others) if others else None
    mean = (leader["metadata_per_s"] + (n - 1) * other) / n if leader and other is not None else None
    looks = leader.get("files", {}).get("launch/fault-N-N.json")
    return {"nodes": n, "repeats": len(result["faults"]), **{k: _median(result["faults"], k) for k in TIMES},
            "ops_leader": leader.get("metadata_per_s"), "ops_other": other, "ops_mean": mean,
            "data_leader": leader.get("data_per_s"),
            "fault_looks_per_s": looks / leader["seconds"] if looks and leader.get("seconds") else None,
            "spawn_floor": result.get("spawn_floor_s"), "steady_busy": result["cpu"]["busy"],
            "steady_load1": result["cpu"]["load1"],
            "launcher_ms_per_node_s": result["cpu"]["launcher_ms_per_node_s"],
            "recovery_ops_leader": _ops(result.get("traced_fault"), "leader"),
            "recovery_ops_other": _ops(result.get("traced_fault"), "other"),
            "recovery_s": (result.get("traced_fault") or {}).get("training_all")}


def project(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(a, b) of `ops per node per second = a + b N`, least squares over the measured rows
    (None with fewer than two)."""
    points = [(r["nodes"], r["ops_mean"]) for r in rows if r.get("ops_mean") is not None]
    if len({n for n, _ in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression([float(n) for n, _ in points], [v for _, v in points])
    return intercept, slope


def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _faults_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| N | faults | injected -> declared | old ranks dead | every node down | decision shared "
             "(next file) | decision recorded (ledger) | first node restarting | every node restarting | "
             "every node training | spawn floor | CPU busy | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        busy = None if r["busy"] is None else 100 * r["busy"]
        lines.append(f"| {r['nodes']} | {r['repeats']} | {_f(r['detect'])} | {_f(r['ranks_dead'])} | "
                     f"{_f(r['down_all'])} | {_f(r['decided_file'])} | {_f(r['decided'])} | "
                     f"{_f(r['restarting_first'])} | {_f(r['restarting_all'])} | {_f(r['training_all'])} | "
                     f"{_f(r.get('spawn_floor'))} | {_f(busy, 0)}% | {_f(r['load1'], 1)} |")
    return lines


def _ops_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| N | metadata/s leader | metadata/s other node | mean per node | whole run dir /s | data/s "
             "leader | fault-file looks/s (leader) | launcher CPU ms per node-s | CPU busy | load (1 min) | "
             "one recovery, metadata ops: leader / other |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["ops_mean"] * r["nodes"] if r["ops_mean"] is not None else None
        lines.append(f"| {r['nodes']} | {_f(r['ops_leader'], 1)} | {_f(r['ops_other'], 1)} | "
                     f"{_f(r['ops_mean'], 1)} | {_f(total, 0)} | {_f(r['data_leader'], 1)} | "
                     f"{_f(r['fault_looks_per_s'], 1)} | {_f(r['launcher_ms_per_node_s'], 1)} | "
                     f"{_f(100 * r['steady_busy'], 0)}% | {_f(r['steady_load1'], 1)} | "
                     f"{r['recovery_ops_leader'] or 'n/a'} / {r['recovery_ops_other'] or 'n/a'} |")
    return lines


def _projection(rows: list[dict[str, Any]]) -> list[str]:
    leader = [r["ops_leader"] for r in rows if r.get("ops_leader") is not None]
    other = [r["ops_other"] for r in rows if r.get("ops_other") is not None]
    if rows and leader and other and statistics.median(other) < 0.5:
        # The store: the leader's own (its lease) and nothing per other node, whatever N.
        lead, rest = statistics.median(leader), statistics.median(other)
        at = "; ".join(f"{n:,} nodes: {lead / n + rest * (n - 1) / n:.4f} per node, "
                       f"{lead + rest * (n - 1):,.1f} a second on the run directory" for n in PROJECTED)
        return ["", f"Projection: the leader makes {lead:.1f} metadata operations a second and every other "
                f"node {rest:.1f}, whatever N (nothing is polled); per node that is {lead:.1f} / N + "
                f"{rest:.1f}; {at}."]
    fit = project(rows)
    if fit is None:
        return []
    a, b = fit
    at = "; ".join(f"{n:,} nodes: {a + b * n:,.0f} per node, {(a + b * n) * n:,.0f} a second on the run "
                   "directory" for n in PROJECTED)
    return ["", f"Projection (least squares over the measured N): metadata operations per node per second "
            f"= {a:.1f} + {b:.2f} N; {at}."]


def markdown(command: str, label: str, strace_s: float, results: list[dict[str, Any]],
             rows: list[dict[str, Any]], when: str, machine: str) -> str:
    """The results page: the command, the machine, the two tables, what was counted."""
    files = ", ".join(f"N={r['nodes']}: {'yes' if r['file_channel'] else 'no'}" for r in results)
    lines = [f"# Control plane at scale (HPCSHARD_COORD={label})", "", f"`{command}`", "",
             f"{when}, {machine}; fault or down files in launch/ (the file channel): {files}.", "",
             "Fault: the rank of node N//2 SIGKILLed in steady training; medians over the faults; every "
             "time after `injected -> declared` is seconds after the declaration (this host's one "
             "clock). Old ranks dead: this bench's own look at their pids (every 50 ms, an upper bound). "
             "Spawn floor: N fake ranks started at once with no launcher (first start -> the last one's "
             "first step): what this one host adds to `every node training` that a cluster, each node on "
             "its own cores, would not. CPU busy and load are the whole machine's over the fault (its "
             "kernel is shared with other work); the launchers' own CPU is in the next table. Every "
             "latency here includes waiting for one of this host's cores: a loaded host inflates them "
             "(read them beside the CPU columns).", "",
             *_faults_table(rows), "",
             f"Steady training: operations on the run directory per node per second (strace, {strace_s:g} s "
             "on the leader and two others; `bench/opcount.py` says what counts), the launchers' CPU, and "
             "the metadata operations of one traced recovery (injected -> every node training).", "",
             *_ops_table(rows), *_projection(rows)]
    biggest = results[-1]
    for who, c in biggest["ops"].items():
        lines += ["", f"N={biggest['nodes']}, {who}: metadata operations by file in {c['seconds']} s: "
                  + ", ".join(f"{k} {v}" for k, v in c["files"].items())]
    return "\n".join(lines) + "\n"


def metrics(rows: list[dict[str, Any]]) -> list[Metric]:
    """The lines for results/latest: per N, and the issue's two targets."""
    out: list[Metric] = []
    for r in rows:
        ops = r["ops_mean"]
        out += [Metric(NAME, f"N={r['nodes']}: declared -> decided", r["decided"] or 0, "s"),
                Metric(NAME, f"N={r['nodes']}: declared -> every node training", r["training_all"] or 0, "s"),
                Metric(NAME, f"N={r['nodes']}: metadata ops per node per s (steady)", ops or 0, "/s",
                       "<= 0.5", ops <= 0.5 if ops is not None else None)]
    first, last = rows[0], rows[-1]
    if len(rows) > 1 and first["decided"] and last["decided"] is not None:
        ratio = last["decided"] / first["decided"]
        out.append(Metric(NAME, f"decision latency N={last['nodes']} / N={first['nodes']}", ratio, "x",
                          "<= 2x", ratio <= 2))
        # The protocol's own part: from the last old rank dead (each launcher saw the fault
        # and killed its ranks: on this host, N processes sharing 2 cores) to the decision.
        own = [max(0.0, (r["decided"] or 0) - (r["ranks_dead"] or 0)) for r in (first, last)]
        out.append(Metric(NAME, f"N={last['nodes']}: last old rank dead -> decided", own[1], "s"))
        out.append(Metric(NAME, f"N={first['nodes']}: last old rank dead -> decided", own[0], "s"))
    return out
