"""Which ranks are stragglers, from successive looks at every rank's probe time."""

from __future__ import annotations

import pytest

from hpcshard.runtime.straggler import Stragglers


def test_a_rank_slower_than_the_others_at_patience_looks_in_a_row_is_named_once() -> None:
    s = Stragglers(margin=1.4, patience=3)
    fast, slow = 0.010, 0.020
    assert s.look([fast, fast, slow, fast]) == []
    assert s.look([fast, fast, slow, fast]) == []
    (found,) = s.look([fast, fast, slow, fast])
    assert found[0] == 2 and found[1] == pytest.approx(2.0)
    assert s.look([fast, fast, slow, fast]) == []  # named once


def test_a_look_within_the_margin_resets_the_streak() -> None:
    s = Stragglers(margin=1.4, patience=2)
    assert s.look([0.01, 0.02]) == []
    assert s.look([0.01, 0.012]) == []  # within 1.4x: the streak starts again
    assert s.look([0.01, 0.02]) == []
    assert [r for r, _ in s.look([0.01, 0.02])] == [1]


def test_two_ranks_compare_with_each_other_and_noise_is_not_a_straggler() -> None:
    s = Stragglers(margin=1.4, patience=1)
    assert s.look([0.010, 0.013]) == []  # 1.3x
    assert [r for r, _ in s.look([0.030, 0.010])] == [0]


def test_the_node_whose_every_link_is_slow_is_the_culprit_from_three_nodes_on() -> None:
    from hpcshard.runtime.links import Link, culprit

    def ring(nodes: int, slow: int | None) -> list[Link]:
        return [Link(source=(n - step) % nodes, target=n,
                     gbps=1.0 if slow in (n, (n - step) % nodes) else 10.0)
                for step in (1, -1) for n in range(nodes)]

    assert culprit(ring(4, slow=2), floor_gbps=5, nodes=4) == 2
    assert culprit(ring(3, slow=0), floor_gbps=5, nodes=3) == 0
    assert culprit(ring(4, slow=None), floor_gbps=5, nodes=4) is None  # nothing slow
    assert culprit(ring(2, slow=1), floor_gbps=5, nodes=2) is None  # either end may be at fault
    everything = [Link(source=(n + 1) % 4, target=n, gbps=1.0) for n in range(4)]
    assert culprit(everything, floor_gbps=5, nodes=4) is None  # no single node behind them all
    # Node 1 slow everywhere, and one healthy link slow for a moment (a loaded machine, a
    # cable): node 1 is still the one, as nodes 0 and 2 each have a fast link.
    busy = [Link(link.source, link.target, 2.0) if (link.source, link.target) == (2, 0) else link
            for link in ring(3, slow=1)]
    assert culprit(busy, floor_gbps=5, nodes=3) == 1
    cable = [Link(link.source, link.target, 2.0) if {link.source, link.target} == {0, 2} else link
             for link in ring(4, slow=None)]
    assert culprit(cable, floor_gbps=5, nodes=4) is None  # one slow link between fast nodes


def test_cpu_ranks_that_share_cores_are_not_compared_and_gpus_always_are() -> None:
    import torch

    from hpcshard.runtime.straggler import crowded

    laptop = [("vm", 2, 1)] * 4  # the local backend's 2x2 on 2 cores
    assert "4 ranks x 1 thread(s) on vm's 2 cores" in crowded(laptop, torch.device("cpu"))
    assert crowded([("a", 8, 2), ("a", 8, 2), ("b", 8, 4)], torch.device("cpu")) == ""
    assert crowded(laptop, torch.device("cuda", 0)) == ""


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 8])
def test_links_are_timed_in_phases_where_a_node_is_on_one_link(nodes: int) -> None:
    from hpcshard.runtime.links import ring_phases

    phases = ring_phases(nodes)
    links = [link for phase in phases for link in phase]
    ring = {(n, (n + step) % nodes) for step in (1, -1) for n in range(nodes)}
    assert sorted(links) == sorted(ring)  # every ring link both ways, once
    for phase in phases:
        ends = [end for link in phase for end in link]
        assert len(ends) == len(set(ends))  # no node sends and receives in one phase
    assert len(phases) <= 6
