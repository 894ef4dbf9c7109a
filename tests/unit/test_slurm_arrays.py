"""A sweep larger than the cluster's job arrays take, planned as several arrays
(`slurm.arrays`): their sizes within the limit, the throttle across all of them, and the
limit read from the cluster's configuration. The submission itself: tests/unit/test_sweep.py;
on a real Slurm: tests/slurm/test_sweep_split.py."""

from __future__ import annotations

import functools
import itertools

import pytest

from hpcshard.slurm.arrays import Part, array_limit, dependency, plan


@pytest.mark.parametrize("count,limit,parallel,expected", [
    # within the limit, or the limit unknown: one array, as before
    (4, 1001, 0, [(0, "0-3", ())]),
    (4, 4, 2, [(0, "0-3%2", ())]),
    (3, None, 2, [(0, "0-2%2", ())]),
    (1, 5, 0, [(0, "0-0", ())]),
    # past it, no throttle: arrays of `limit` tasks (the last the rest), all at once
    (5, 2, 0, [(0, "0-1", ()), (2, "0-1", ()), (4, "0-0", ())]),
    (2500, 1001, 0, [(0, "0-1000", ()), (1001, "0-1000", ()), (2002, "0-497", ())]),
    # past it, throttled below an array's size: a chain, each `%M`
    (7, 6, 3, [(0, "0-5%3", ()), (6, "0-0%3", (0,))]),
    (5, 2, 1, [(0, "0-1%1", ()), (2, "0-1%1", (0,)), (4, "0-0%1", (1,))]),
    (3000, 1001, 64, [(0, "0-1000%64", ()), (1001, "0-1000%64", (0,)), (2002, "0-997%64", (1,))]),
    # a throttle of two arrays or more: that many side by side, each after the ones
    # `width` before it and every one between (so all before those are over too)
    (9, 2, 4, [(0, "0-1%2", ()), (2, "0-1%2", ()), (4, "0-1%2", (0,)), (6, "0-1%2", (0, 1)),
               (8, "0-0%2", (1, 2))]),
    (7, 2, 5, [(0, "0-1%2", ()), (2, "0-1%2", ()), (4, "0-1%2", (0,)), (6, "0-0%2", (0, 1))]),
    # a throttle between one array's size and two: two arrays side by side of half of it
    # each (not one array of `size`, the rest of the throttle idle all along)
    (2500, 1001, 1500, [(0, "0-1000%750", ()), (1001, "0-1000%750", ()), (2002, "0-497%750", (0,))]),
    (10, 3, 4, [(0, "0-2%2", ()), (3, "0-2%2", ()), (6, "0-2%2", (0,)), (9, "0-0%2", (0, 1))]),
    # a throttle of the sweep's tasks or more: nothing waits (they are all within it)
    (1500, 1001, 2000, [(0, "0-1000%2000", ()), (1001, "0-498%2000", ())]),
    (7, 6, 7, [(0, "0-5%7", ()), (6, "0-0%7", ())]),
])
def test_the_plan(count: int, limit: int | None, parallel: int,
                  expected: list[tuple[int, str, tuple[int, ...]]]) -> None:
    parts = plan(count, limit, parallel)
    assert [(p.first, p.spec, p.after) for p in parts] == expected
    assert [t for p in parts for t in p.tasks] == list(range(count))  # each task once, in order
    assert all(p.count <= (limit or count) for p in parts)


def most_at_once(parts: list[Part]) -> int:
    """The most tasks that can run at once under the plan's dependencies, whatever order
    Slurm ends the arrays in (every order tried): an array runs once those it waits for
    are over, each with at most its throttle (and its tasks) running."""
    @functools.cache  # (what runs depends only on which arrays are over)
    def worst(over: frozenset[int]) -> int:
        running = [k for k, p in enumerate(parts) if k not in over and set(p.after) <= over]
        now = sum(min(parts[k].count, parts[k].throttle or parts[k].count) for k in running)
        return max([now, *(worst(over | {k}) for k in running)])

    return worst(frozenset())


@pytest.mark.parametrize("count,limit,parallel", [
    (c, lim, m) for c, lim, m in itertools.product((3, 5, 8, 11), (1, 2, 3), (1, 2, 3, 4, 5, 7))])
def test_the_throttle_holds_across_every_array_in_any_order_they_end(count: int, limit: int,
                                                                     parallel: int) -> None:
    parts = plan(count, limit, parallel)
    assert most_at_once(parts) <= parallel
    assert all(all(j < k for j in p.after) for k, p in enumerate(parts))  # on arrays submitted before


@pytest.mark.parametrize("count,limit,parallel", [
    (c, lim, m) for c, lim, m in itertools.product((3, 5, 8, 11), (1, 2, 3, 4), range(1, 13))])
def test_as_many_run_at_once_as_the_throttle_lets_an_array_of_them(count: int, limit: int,
                                                                 parallel: int) -> None:
    """No throttle left idle beyond what whole arrays cost: at least as many tasks at once as
    the larger of one array's share and half the throttle, and all of them where it allows."""
    most = most_at_once(plan(count, limit, parallel))
    assert most == count if parallel >= count else most >= max(min(limit, parallel), parallel // 2)


def test_without_a_throttle_nothing_waits() -> None:
    assert all(not p.after and not p.throttle for p in plan(11, 3, 0))
    assert most_at_once(plan(11, 3, 0)) == 11


def test_nothing_to_run_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to run"):
        plan(0, 5)


def test_the_dependency_waits_for_every_task_however_it_ended() -> None:
    assert dependency(["12", "13"]) == "afterany:12:13" and dependency([]) == ""


@pytest.mark.parametrize("config,limit", [
    ("MaxArraySize            = 1001\nMaxJobCount = 10000\n", 1001),
    ("MaxArraySize = 5\n", 5),
    ("MaxArraySize = 1001\nSchedulerParameters = sched_interval=2,max_array_tasks=300,bf_interval=5\n", 300),
    ("MaxArraySize = 100\nSchedulerParameters = max_array_tasks=300\n", 100),
    ("SchedulerParameters = bf_interval=5\n", None),
    ("", None),
])
def test_the_limit_from_the_clusters_config(config: str, limit: int | None) -> None:
    assert array_limit(config) == limit
