"""Which rank is missing from which collective, from flight records shaped as torch 2.13
writes them with gloo (`_dump_fr_trace_json`, plus the groups' members)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcshard.rundir import flight

pytestmark = pytest.mark.unit


def record(rank: int, enqueued: int, completed: int, groups: dict[str, list[int]] | None = None,
           ) -> dict[str, Any]:
    groups = groups or {"0": [0, 1, 2, 3]}
    return {"rank": rank,
            "pg_config": {name: {"name": name, "desc": "default_pg" if name == "0" else "shard",
                                 "ranks": ranks} for name, ranks in groups.items()},
            "pg_status": {name: {"last_enqueued_collective": str(enqueued),
                                 "last_completed_collective": str(completed),
                                 "last_started_collective": "-1"} for name in groups},
            "entries": [{"process_group": [name, "x"], "collective_seq_id": seq,
                         "profiling_name": "gloo:all_reduce", "input_sizes": [[1000]],
                         "state": "scheduled", "retired": seq <= completed}
                        for name in groups for seq in range(max(1, enqueued - 2), enqueued + 1)]}


def test_a_rank_without_a_record_is_missing_from_the_collective_its_peers_wait_in() -> None:
    # Rank 1 stopped (it cannot answer); the others entered all_reduce #11 and wait.
    found = flight.missing({r: record(r, 11, 10) for r in (0, 2, 3)})
    assert found == [{"group": "0", "desc": "default_pg", "seq": 11, "op": "gloo:all_reduce",
                      "sizes": [[1000]], "inside": [0, 2, 3], "missing": [1]}]
    assert flight.summary(found) == ("rank 1 missing from gloo:all_reduce #11 of group 0 (default_pg), "
                                     "where rank 0, 2, 3 wait")


def test_a_rank_that_answers_but_is_behind_is_missing_too() -> None:
    records = {0: record(0, 11, 10), 1: record(1, 10, 10)}
    records[0]["pg_config"]["0"]["ranks"] = records[1]["pg_config"]["0"]["ranks"] = [0, 1]
    (found,) = flight.missing(records)
    assert found["missing"] == [1] and found["inside"] == [0] and found["seq"] == 11


def test_groups_are_judged_apart_and_idle_ones_are_left_out() -> None:
    groups = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3]}
    records = {r: record(r, 7, 7, groups) for r in (0, 1, 2, 3)}  # all done in every group
    assert flight.missing(records) == []
    records[0]["pg_status"]["1"] = {"last_enqueued_collective": "8", "last_completed_collective": "7"}
    records[0]["entries"].append({"process_group": ["1", "x"], "collective_seq_id": 8,
                                  "profiling_name": "gloo:_allgather_base", "input_sizes": [[64]]})
    (found,) = flight.missing(records)
    assert (found["group"], found["op"], found["missing"]) == ("1", "gloo:_allgather_base", [1])


def test_records_are_read_back_by_rank_and_a_torn_one_is_skipped(tmp_path: Path) -> None:
    where = flight.folder(tmp_path, 2, 1)
    where.mkdir(parents=True)
    (where / "rank-3.json").write_text(json.dumps(record(3, 5, 4)))
    (where / "rank-1.json").write_text('{"rank": 1, "pg_')
    assert list(flight.read(tmp_path, 2, 1)) == [3]
    assert flight.read(tmp_path, 0, 0) == {} and flight.missing({}) == []


def test_the_rank_where_a_chain_of_waits_begins_is_named_not_those_waiting_on_it() -> None:
    """As measured with HSDP 2x2 and rank 1 stopped mid-step: rank 0 waits for rank 1 in
    their shard group, so rank 0 is missing from the replicate all-reduce rank 2 waits in."""
    world = [0, 1, 2, 3]
    groups = {0: {"0": world, "1": [0, 2], "3": [0, 1]}, 1: {"0": world, "2": [1, 3], "3": [0, 1]},
              2: {"0": world, "1": [0, 2], "4": [2, 3]}, 3: {"0": world, "2": [1, 3], "4": [2, 3]}}
    status = {0: {"0": (26, 26), "1": (35, 35), "3": (110, 109)},
              1: {"0": (26, 26), "2": (35, 35), "3": (109, 109)},
              2: {"0": (26, 26), "1": (36, 35), "4": (113, 113)},
              3: {"0": (26, 26), "2": (36, 35), "4": (113, 113)}}
    records = {}
    for r in range(4):
        records[r] = record(r, 0, 0, groups[r])
        records[r]["pg_status"] = {g: {"last_enqueued_collective": str(e),
                                       "last_completed_collective": str(c)}
                                   for g, (e, c) in status[r].items()}
        records[r]["entries"] = [{"process_group": [g, "x"], "collective_seq_id": e, "profiling_name":
                                  "gloo:all_gather" if g in "34" else "gloo:all_reduce"}
                                 for g, (e, _) in status[r].items()]
    found = flight.missing(records)
    assert [(g["group"], g["inside"], g["missing"]) for g in found] == [
        ("1", [2], [0]), ("2", [3], [1]), ("3", [0], [1])]
    assert flight.roots(found) == [1]
    text = flight.summary(found)
    assert "rank 1 missing from gloo:all_gather #110 of group 3" in text and "rank 0 missing" not in text
