"""How launchers tell each other about a fault: one declaration per cycle, whoever is first."""

from __future__ import annotations

from pathlib import Path

from hpcshard.rundir import launchers


def test_the_first_declaration_wins_and_every_launcher_reads_it(tmp_path: Path) -> None:
    assert launchers.fault(tmp_path, 0, 0) is None
    assert launchers.declare_fault(tmp_path, 0, 0, {"cause": "rank 3 died", "node": 1})
    assert not launchers.declare_fault(tmp_path, 0, 0, {"cause": "exit 1", "node": 0})
    found = launchers.fault(tmp_path, 0, 0)
    assert found is not None and found["cause"] == "rank 3 died" and found["time"] > 0
    assert launchers.fault(tmp_path, 0, 1) is None and launchers.fault(tmp_path, 1, 0) is None


def test_nodes_report_down_and_node_0_decides(tmp_path: Path) -> None:
    launchers.mark_down(tmp_path, 2, 1, 1, {"dead": [{"rank": 3}], "reached": 7})
    assert launchers.nodes_down(tmp_path, 2, 1, 2) == [1]
    launchers.mark_down(tmp_path, 2, 1, 0, {"dead": [], "reached": 7})
    assert launchers.nodes_down(tmp_path, 2, 1, 2) == [0, 1]
    assert launchers.downs(tmp_path, 2, 1, 2)[1]["dead"] == [{"rank": 3}]
    assert launchers.decision(tmp_path, 2, 1) is None
    launchers.decide(tmp_path, 2, 1, {"restart": True, "port": 29500})
    assert launchers.decision(tmp_path, 2, 1) == {"restart": True, "port": 29500}
