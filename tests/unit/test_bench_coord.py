"""The store-at-scale bench's pure part (`bench.coord_scale.report`): medians after the
declaration, the fitted terms, the projection, and the decision latency composed from the
real launchers' own at 2 nodes and what node 0 adds. The bench itself runs with `python -m
bench coord`, never here (no timed assertions in tests)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from bench import coord_scale

pytestmark = pytest.mark.unit


def result(nodes: int, decided: list[float], store_cpu_s: float) -> dict[str, Any]:
    cycles = [{"declared": 100.0, "seen": 100.001, "every_heard_fault": 100.002, "last_down": 100.0 + d / 2,
               "all_down": 100.0 + d * 0.9, "decided": 100.0 + d, "returned": 100.0 + d,
               "every_heard_decision": 100.0 + d + 0.001, "store_cpu_s": d / 10} for d in decided]
    return {"nodes": nodes, "cycles": cycles, "emulators_cpu_s": 1.0,
            "steady": {"store_cpu_s": store_cpu_s, "process_cpu_s": 2 * store_cpu_s, "wall_s": 10.0}}


def test_the_page_takes_medians_after_the_declaration_and_fits_the_terms_over_n() -> None:
    # decided = 0.01 s + 0.1 ms x N; the store's steady CPU = 0.05 ms a node a second
    results = [result(n, [0.01 + 0.0001 * n + jitter for jitter in (0.05, 0.0, -0.001)], 0.0005 * n)
               for n in (2, 128, 1024)]
    metrics, page = coord_scale.report(results, "python -m bench.coord_scale", real_2=0.1)
    found = {m.name: m for m in metrics}
    assert found["N=2: declared -> decided (store alone, median of 3)"].value == pytest.approx(0.0102)
    assert found["N=1024: node 0's store thread, steady (heartbeats)"].value == pytest.approx(51.2)
    assert found["projected 10,000 nodes: declared -> decided"].value == pytest.approx(1.01, rel=1e-3)
    share = found["projected 10,000 nodes: the store's heartbeats, share of a core"]
    assert share.value == pytest.approx(50.0)
    # node 0's CPU per fault (here a tenth of each fault's time) grows 1.26 ms from 2 to 128
    # nodes, on the real launchers' 0.1 s: 1.0126x; the wall time here grows 12.6 ms: 1.126x
    ratio = found["decision latency N=128 / N=2 on a cluster (real launchers' N=2 + node 0's added CPU)"]
    assert ratio.value == pytest.approx(1.0126) and ratio.ok is True
    upper = found["decision latency N=128 / N=2, upper bound (real launchers' N=2 + this host's wall)"]
    assert upper.value == pytest.approx(1.126) and upper.ok is None
    assert "| 128 | 3 |" in page and "10,000 nodes: declared -> decided 1.01 s" in page


def test_past_one_core_of_heartbeats_the_store_saturates_and_no_latency_is_projected() -> None:
    results = [result(n, [0.01 + 0.0001 * n], 0.002 * n) for n in (2, 128, 1024)]  # 0.2 ms a node-second
    metrics, page = coord_scale.report(results, "cmd")
    names = {m.name for m in metrics}
    assert "projected 1,024 nodes: declared -> decided" in names
    assert "projected 10,000 nodes: declared -> decided" not in names
    assert "saturates at about 5,000 nodes" in page


def test_without_the_real_launchers_figure_no_ratio_is_claimed() -> None:
    results = [result(n, [0.01 * n], 0.001 * n) for n in (2, 128)]
    metrics, page = coord_scale.report(results, "cmd", real_2=None)
    assert not [m for m in metrics if m.target]
    assert "as a cluster would see it" not in page
    for r in results:  # node 0's process busy 1.26 s more a fault at 128 nodes than at 2
        r["cycles"][0]["process_cpu_s"] = 0.01 * r["nodes"]
    metrics, _ = coord_scale.report(results, "cmd", real_2=0.5)
    assert [m.ok for m in metrics if m.target] == [False]  # 0.5 + 1.26 s is 3.5x


def test_bad_node_counts_are_refused_in_one_line() -> None:
    for nodes in ("1", "2,x", "2,2"):
        proc = subprocess.run([sys.executable, "-m", "bench.coord_scale", "--nodes", nodes],
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 2 and "--nodes" in proc.stderr.splitlines()[-1]


def test_a_fault_s_store_cpu_is_what_it_took_beyond_the_heartbeats_over_its_window() -> None:
    results = [result(n, [0.01], 0.001 * n) for n in (2, 128, 1024)]  # steady: 0.1 ms a node a second
    for r in results:
        r["cycles"][0].update(store_cpu_s=0.5, window_s=2.0)  # 0.5 s over 2 s, of which heartbeats
    coord_scale.report(results, "cmd")
    assert [r["fault_ms"] for r in results] == [pytest.approx(500 - 2 * 0.2), pytest.approx(500 - 2 * 12.8),
                                                pytest.approx(500 - 2 * 102.4)]
