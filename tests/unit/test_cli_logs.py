"""`hpcshard logs` on a run directory laid out as a requeued 2x1 run leaves it: two
attempts on other nodes, the stream, its filters, following into the next attempt, and
bad input as one line with exit 2."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import logs as logs_cli
from hpcshard.cli import main
from hpcshard.launch import backends
from hpcshard.rundir.runlogs import start_line
from hpcshard.rundir.spec import Resolved, RunSpec


def _start(rank: int, at: str, attempt: int, host: str) -> str:
    return f"{at} [rank {rank}] DEBUG {start_line(attempt, 0, 100 + rank, host, rank, '42')}\n"


ATTEMPT_1 = {0: _start(0, "12:01:00", 1, "n3") + "12:01:02 [rank 0] INFO resumed from step 2\n",
             1: _start(1, "12:01:00", 1, "n1") + "12:01:01 [rank 1] INFO rank 1 again\n"}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Attempt 0 on n1 (rank 0) and n2 (rank 1), preempted; attempt 1 on n3 and n1."""
    run_dir = tmp_path / "charlm-1"
    (run_dir / "logs").mkdir(parents=True)
    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=1, backend="local", name="charlm",
            resolved=Resolved(config={"steps": 4})).write(run_dir)
    ledger = [{"event": "start", "attempt": 0, "cycle": 0, "time": 1.0, "nodes": 2},
              {"event": "end", "attempt": 0, "cycle": 0, "time": 2.0, "reason": "stop"},
              {"event": "start", "attempt": 1, "cycle": 0, "time": 3.0, "nodes": 2}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    (run_dir / "logs" / "rank-0.log").write_text(
        _start(0, "12:00:00", 0, "n1") + "12:00:01 [rank 0] INFO step 1\n12:00:03 [rank 0] INFO step 2\n"
        + ATTEMPT_1[0])
    (run_dir / "logs" / "rank-1.log").write_text(
        _start(1, "12:00:00", 0, "n2") + "12:00:02 [rank 1] WARNING slow\nTraceback (most recent call last)\n"
        + ATTEMPT_1[1])
    return run_dir


HEAD_0 = "==> attempt 0 (restart 0): job 42, nodes n1,n2, ranks 0,1, started 12:00:00 <=="
HEAD_1 = "==> attempt 1 (restart 0): job 42, nodes n3,n1, ranks 0,1, started 12:01:00 <=="


def _logs(*args: str) -> tuple[int, list[str]]:
    out = CliRunner().invoke(main, ["logs", *args])
    return out.exit_code, out.output.splitlines()


def test_every_attempt_of_every_rank_in_one_stream(run: Path) -> None:
    assert _logs(str(run)) == (0, [
        HEAD_0, "12:00:01 [rank 0] INFO step 1", "12:00:02 [rank 1] WARNING slow",
        "[rank 1] Traceback (most recent call last)", "12:00:03 [rank 0] INFO step 2",
        HEAD_1, "12:01:01 [rank 1] INFO rank 1 again", "12:01:02 [rank 0] INFO resumed from step 2"])


@pytest.mark.parametrize(("args", "want"), [
    # one rank: its lines untagged as they are, its headers of its own start lines
    (["--rank", "1"], [HEAD_0.replace("nodes n1,n2, ranks 0,1", "node n2, rank 1"),
                       "12:00:02 [rank 1] WARNING slow", "Traceback (most recent call last)",
                       HEAD_1.replace("nodes n3,n1, ranks 0,1", "node n1, rank 1"),
                       "12:01:01 [rank 1] INFO rank 1 again"]),
    # n1 ran rank 0, then rank 1: a node's ranks, attempt by attempt
    (["--node", "n1"], [HEAD_0, "12:00:01 [rank 0] INFO step 1", "12:00:03 [rank 0] INFO step 2",
                        HEAD_1, "12:01:01 [rank 1] INFO rank 1 again"]),
    (["--attempt", "1"], [HEAD_1, "12:01:01 [rank 1] INFO rank 1 again",
                          "12:01:02 [rank 0] INFO resumed from step 2"]),
    (["--lines", "2"], [HEAD_1, "12:01:01 [rank 1] INFO rank 1 again",
                        "12:01:02 [rank 0] INFO resumed from step 2"]),
    (["--tail", "1", "--attempt", "0"], [HEAD_0, "12:00:03 [rank 0] INFO step 2"]),
])
def test_filters(run: Path, args: list[str], want: list[str]) -> None:
    assert _logs(str(run), *args) == (0, want)


@pytest.mark.parametrize(("args", "said"), [
    (["--rank", "5"], "no log for rank 5 in"),
    (["--rank", "5", "-f"], "no log for rank 5 in"),  # not a rank of a 2x1 run, even to follow
    (["--node", "n7"], "no rank of"),
    (["--node", "2", "-f"], "no rank of"),
    (["--attempt", "4"], "has no attempt 4; it had: 0, 1"),
])
def test_bad_input_is_one_line_and_exit_2(run: Path, args: list[str], said: str) -> None:
    code, out = _logs(str(run), *args)
    assert code == 2 and len(out) == 1 and said in out[0], out


def test_an_older_log_without_start_lines_reads_as_before(run: Path) -> None:
    for log in (run / "logs").glob("rank-*.log"):
        log.unlink()
    (run / "logs" / "rank-0.log").write_text("hello from rank 0\n")
    assert _logs(str(run)) == (0, ["hello from rank 0"])


@pytest.fixture
def polls(run: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Following without waiting: each poll's wait recorded; attempt 1 is written to the
    logs at the third poll, and the backend says the run ended at the sixth."""
    for rank in (0, 1):  # the logs as they were when attempt 0 stopped
        log = run / "logs" / f"rank-{rank}.log"
        log.write_text(log.read_text().replace(ATTEMPT_1[rank], ""))
    waits: list[float] = []
    asked = iter(range(100))

    def ended(self: backends.Backend, spec: RunSpec, run_dir: Path) -> bool:
        n = next(asked)
        if n == 2:
            for rank, text in ATTEMPT_1.items():
                with (run / "logs" / f"rank-{rank}.log").open("a") as f:
                    f.write(text)
        return n >= 5

    monkeypatch.setattr(backends.Backend, "ended", ended)
    monkeypatch.setattr(logs_cli.time, "sleep", waits.append)
    yield waits


def test_follow_continues_into_the_next_attempt_until_the_run_ends(run: Path, polls: list[float]) -> None:
    code, out = _logs(str(run), "-f")
    assert code == 0
    assert out == [HEAD_0, "12:00:01 [rank 0] INFO step 1", "12:00:02 [rank 1] WARNING slow",
                   "[rank 1] Traceback (most recent call last)", "12:00:03 [rank 0] INFO step 2",
                   HEAD_1, "12:01:01 [rank 1] INFO rank 1 again",
                   "12:01:02 [rank 0] INFO resumed from step 2"]
    assert polls == [0.5, 1.0, 0.5, 1.0, 2.0]  # idle polls back off; new lines reset the wait


def test_follow_an_attempt_still_to_come(run: Path, polls: list[float]) -> None:
    assert _logs(str(run), "-f", "--attempt", "1", "--rank", "0") == (0, [
        HEAD_1.replace("ranks 0,1", "rank 0").replace("nodes n3,n1", "node n3"),
        "12:01:02 [rank 0] INFO resumed from step 2"])


def test_a_run_with_no_log_yet(run: Path) -> None:
    for log in (run / "logs").glob("rank-*.log"):
        log.unlink()
    code, out = _logs(str(run))
    assert code == 2 and out == [f"Error: no rank has logged in {run / 'logs'} yet (-f waits for them)"]
