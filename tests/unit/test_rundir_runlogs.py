"""A run's rank logs as one stream (rundir.runlogs): start lines parsed (new and old),
pieces told apart, ranks merged by time, filters by rank, node and attempt, headers, and
reads that pick up where the last one stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcshard.rundir.runlogs import (
    Filter,
    Line,
    RunLogs,
    Start,
    Stream,
    Where,
    header,
    order,
    parse_start,
    start_line,
    started,
)


@pytest.mark.parametrize(("text", "want"), [
    ("12:00:00 [rank 3] DEBUG ==== start of attempt 1 cycle 2 (pid 9, host n2, node 1, job 42)",
     Start((1, 2), host="n2", node=1, job="42", at="12:00:00")),
    ("12:00:00 [rank 0] DEBUG ==== start of attempt 0 cycle 0 (pid 9)",  # before hosts were written
     Start((0, 0), at="12:00:00")),
    ("==== start of attempt 4 cycle 0 (pid 9, host a b, node 0)", Start((4, 0), host="a b", node=0)),
    ("==== start of attempt 0 cycle 0", Start((0, 0))),  # a script's, bare
    ("12:00:00 [rank 0] INFO step 3", None),
    ("==== start of attempt x cycle 0", None),
])
def test_start_lines_parse_new_and_old(text: str, want: Start | None) -> None:
    assert parse_start(text) == want


def test_start_line_round_trips() -> None:
    line = start_line(2, 1, 77, "gpu-n17", 3, "4242_5")
    assert parse_start(line) == Start((2, 1), host="gpu-n17", node=3, job="4242_5")
    assert parse_start(start_line(0, 0, 1, "h", 0, None)) == Start((0, 0), host="h", node=0)


def _l(rank: int, piece: tuple[int, int] | None, t: float | None, text: str = "") -> Line:
    return Line(rank, piece, t, text or f"r{rank}@{t}")


@pytest.mark.parametrize(("lines", "want"), [
    # two ranks of one piece: merged by time, a rank's own lines never reordered
    ([_l(0, (0, 0), 1), _l(0, (0, 0), 3), _l(1, (0, 0), 2)], ["r0@1", "r1@2", "r0@3"]),
    # one second: rank by rank
    ([_l(1, (0, 0), 5), _l(0, (0, 0), 5), _l(0, (0, 0), 5, "b")], ["r0@5", "b", "r1@5"]),
    # pieces in order, whatever the times say (a clock set back between attempts)
    ([_l(0, (1, 0), 1), _l(0, (0, 0), 9), _l(0, (0, 1), 5)], ["r0@9", "r0@5", "r0@1"]),
    # lines of no piece (an older log) first; lines without stamps come rank by rank
    ([_l(1, (0, 0), None), _l(0, (0, 0), None), _l(0, None, None, "old")], ["old", "r0@None", "r1@None"]),
])
def test_order_merges_ranks_by_time_piece_by_piece(lines: list[Line], want: list[str]) -> None:
    assert [line.text for line in order(lines)] == want


STARTS = {(0, (0, 0)): Start((0, 0), host="n1", node=0), (1, (0, 0)): Start((0, 0), host="n2", node=1),
          (0, (1, 0)): Start((1, 0), host="n3", node=0), (1, (1, 0)): Start((1, 0), host="n1", node=1)}


@pytest.mark.parametrize(("keep", "want"), [
    (Filter(), [(0, (0, 0)), (1, (0, 0)), (0, (1, 0)), (1, (1, 0)), (0, None)]),
    (Filter(ranks=frozenset({1})), [(1, (0, 0)), (1, (1, 0))]),
    # n1 ran rank 0 in attempt 0 and rank 1 in attempt 1: the ledger of nodes, piece by piece
    (Filter(node="n1"), [(0, (0, 0)), (1, (1, 0))]),
    (Filter(node="1"), [(1, (0, 0)), (1, (1, 0))]),  # a node number
    (Filter(node="n9"), []),
    (Filter(attempt=1), [(0, (1, 0)), (1, (1, 0))]),
    (Filter(ranks=frozenset({0}), attempt=0, node="n1"), [(0, (0, 0))]),
])
def test_filters(keep: Filter, want: list[tuple[int, tuple[int, int] | None]]) -> None:
    lines = [_l(r, p, 1) for r, p in [(0, (0, 0)), (1, (0, 0)), (0, (1, 0)), (1, (1, 0)), (0, None)]]
    assert [(line.rank, line.piece) for line in lines if keep.keeps(line, STARTS)] == want


@pytest.mark.parametrize(("piece", "where", "ledger", "want"), [
    ((1, 0), Where({0: "n1", 1: "n2"}, {0: 0, 1: 1}, job="42", at="12:03:04"), None,
     "==> attempt 1 (restart 0): job 42, nodes n1,n2, ranks 0,1, started 12:03:04 <=="),
    # emulated nodes of one host (the local backend); nodes in node order, not rank order
    ((0, 2), Where({0: "box", 1: "box", 2: "box", 3: "box"}, {0: 0, 1: 0, 2: 1, 3: 1}, at="09:00:00"), None,
     "==> attempt 0 (restart 2): 2 nodes on box, ranks 0-3, started 09:00:00 <=="),
    ((0, 0), Where({0: "n2", 1: "n1"}, {0: 1, 1: 0}), None,
     "==> attempt 0 (restart 0): nodes n1,n2, ranks 0,1 <=="),
    # an older log (no hosts): the ledger's word
    ((3, 0), Where({}, {}), {"slurm_job": "77", "nodes": 2, "time": 60.0},
     "==> attempt 3 (restart 0): job 77, 2 nodes, started {t} <=="),
    ((3, 0), Where({}, {}), None, "==> attempt 3 (restart 0): no start line <=="),
])
def test_headers(piece: tuple[int, int], where: Where, ledger: dict[str, object] | None, want: str) -> None:
    import time

    assert header(piece, where, ledger) == want.format(t=time.strftime("%H:%M:%S", time.localtime(60)))


def test_stream_heads_each_piece_and_tags_untagged_lines_of_several_ranks() -> None:
    lines = [_l(0, None, None, "old"), _l(0, (0, 0), 1, "12:00:01 [rank 0] INFO a"),
             _l(1, (0, 0), 2, "Traceback"), _l(0, (1, 0), 3, "12:00:03 [rank 0] INFO b")]
    stream = Stream(several=True)
    out = stream.render(lines, STARTS, {})
    assert out == ["[rank 0] old", "==> attempt 0 (restart 0): nodes n1,n2, ranks 0,1 <==",
                   "12:00:01 [rank 0] INFO a", "[rank 1] Traceback",
                   "==> attempt 1 (restart 0): nodes n3,n1, ranks 0,1 <==", "12:00:03 [rank 0] INFO b"]
    # following: more of the same piece, no header again; a late line of an older piece has one
    assert stream.render([_l(0, (1, 0), 4, "c")], STARTS, {}) == ["[rank 0] c"]
    assert stream.render([_l(1, (0, 0), 4, "d")], STARTS, {})[0].startswith("==> attempt 0 ")
    assert Stream(several=False).render([_l(0, None, None, "x")], {}, {}) == ["x"]


def test_ledger_starts_by_piece() -> None:
    records = [{"event": "start", "attempt": 0, "time": 1.0}, {"event": "end", "attempt": 0},
               {"event": "start", "attempt": 0, "cycle": 1, "time": 2.0},
               {"event": "start", "attempt": 1, "cycle": 0, "time": 3.0}]
    assert {k: v["time"] for k, v in started(records).items()} == {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 3.0}


def _write(path: Path, text: str | bytes) -> None:
    with path.open("ab") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def test_reads_pick_up_where_they_stopped(tmp_path: Path) -> None:
    """A growing log: lines come once each, an unfinished line (or character) waits for
    its end, a new rank's log is found, a time of day past midnight still sorts after."""
    logs = tmp_path / "logs"
    logs.mkdir()
    reader = RunLogs(logs)
    assert reader.read() == []
    _write(logs / "rank-0.log", "23:59:58 [rank 0] DEBUG " + start_line(0, 0, 1, "n1", 0, None) + "\n"
           "23:59:59 [rank 0] INFO one\n23:59:59 [rank 0] INFO tw")
    assert [line.text for line in reader.read()] == ["23:59:59 [rank 0] INFO one"]
    _write(logs / "rank-0.log", "o \xe2\x82".encode("latin-1"))  # half of a UTF-8 character
    assert reader.read() == []
    _write(logs / "rank-0.log", b"\xac\n00:00:01 [rank 0] INFO three\n")
    _write(logs / "rank-1.log", "23:59:58 [rank 1] DEBUG " + start_line(0, 0, 2, "n2", 1, None) + "\n"
           "00:00:00 [rank 1] INFO r1\n")
    got = reader.read()
    assert [line.text for line in got] == ["23:59:59 [rank 0] INFO two \u20ac", "00:00:00 [rank 1] INFO r1",
                                           "00:00:01 [rank 0] INFO three"]
    assert reader.nodes() == ["n1", "n2", "0", "1"]
    _write(logs / "rank-1.log", "no newline at the end")
    assert reader.read() == []
    assert [line.text for line in reader.read(final=True)] == ["no newline at the end"]


def test_a_rank_filter_reads_only_its_files(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_text("a\n")
    (tmp_path / "rank-1.log").write_text("b\n")
    (tmp_path / "slurm-7.out").write_text("c\n")
    reader = RunLogs(tmp_path, Filter(ranks=frozenset({1})))
    assert [line.text for line in reader.read(final=True)] == ["b"] and list(reader.ranks) == [1]
