"""What the benchmarks share: running things, timing them, medians, and the results file.

This machine is shared and noisy: every comparison is taken side by side in one run
(interleaved A/B where it matters) and reported as a median and a ratio."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcshard.rundir.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = sys.executable


@dataclass
class Metric:
    """One line of the results table."""

    bench: str
    name: str
    value: float
    unit: str
    target: str = ""
    ok: bool | None = None
    note: str = ""


def env(**extra: str) -> dict[str, str]:
    """One thread per rank (2 cores, up to 4 ranks), no site or user configuration, no
    Slurm unless a benchmark asks for it."""
    base = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HPCSHARD_SITE": "",
            "XDG_CONFIG_HOME": str(RESULTS / ".no-config"), **extra}


def run(argv: list[str], *, check: bool = True, timeout: float = 1200, **kw: Any
        ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=ROOT, env=kw.pop("env", env()), capture_output=True,
                          text=True, timeout=timeout, **kw)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(argv[:6])}... exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def hpcshard(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run([PY, "-m", "hpcshard", *args], **kw)


def wall(argv: list[str], **kw: Any) -> float:
    start = time.perf_counter()
    run(argv, **kw)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(run_dir)


def save(bench: str, metrics: list[Metric], details: dict[str, Any]) -> None:
    """Merge one benchmark's results into latest.json and rewrite latest.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "latest.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[bench] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "metrics": [asdict(m) for m in metrics],
                   "details": details}
    path.write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / "latest.md").write_text(markdown(data))


def markdown(data: dict[str, Any]) -> str:
    lines = ["| benchmark | metric | value | target | met |", "|---|---|---|---|---|"]
    for bench, result in data.items():
        for m in result["metrics"]:
            value = f"{m['value']:.3g} {m['unit']}".strip()
            met = {True: "yes", False: "**no**", None: ""}[m["ok"]]
            note = f" ({m['note']})" if m["note"] else ""
            lines.append(f"| {bench} | {m['name']}{note} | {value} | {m['target']} | {met} |")
    return "\n".join(lines) + "\n"


def show(metrics: list[Metric]) -> None:
    for m in metrics:
        met = {True: "ok", False: "MISSED", None: ""}[m.ok]
        print(f"  {m.name:<52} {m.value:>10.4g} {m.unit:<8} {m.target:<10} {met}", flush=True)


def wait(cond: Any, timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll `cond()` until it returns something true (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(every)
    return value
