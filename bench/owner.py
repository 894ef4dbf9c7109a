"""What one owner per run directory costs (issue 26): the ledger append under its NFS-safe
lock against a plain O_APPEND write, a spec.json read-modify-write under the lock against a
plain rewrite, a lease renewal, and appends from N writers at once (a fault's rank_failed
records from every failing rank), all side by side on this machine's local disk.

The lease adds no per-node load: one process per job renews it every RENEW_S (5 s), rank 0
reads it once before each commit, and a launcher that is not the cycle's leader never
touches it (its peers learn of a take-over from the leader's last heartbeat). What grows
with nodes is the ledger's lock under a fault that every rank reports: measured here for
1 to 32 writers."""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path

from bench.common import Metric, median, save, show
from hpcshard.rundir import events, lease, ledger
from hpcshard.rundir.files import append_line
from hpcshard.rundir.spec import RunSpec

NAME = "owner"
REPEATS = 200


def _timed(fn: object, repeats: int = REPEATS) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - start)
    return out


def _writer(run: str, count: int, start: float) -> None:
    while time.time() < start:  # every writer begins at once
        time.sleep(0.001)
    for i in range(count):
        ledger.append(Path(run), events.GaveUp(attempt=0, reason=f"record {i}"))


def _many(root: Path, writers: int, each: int = 20) -> float:
    """Seconds per record when `writers` processes append `each` records at once."""
    run = Path(tempfile.mkdtemp(prefix=f"many-{writers}-", dir=root))
    ctx = multiprocessing.get_context("fork")
    begin = time.time() + 0.5
    procs = [ctx.Process(target=_writer, args=(str(run), each, begin)) for _ in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    took = time.time() - begin
    lines = (run / ledger.LEDGER).read_text().splitlines()
    assert len(lines) == writers * each, f"{len(lines)} of {writers * each} records kept"
    return took / (writers * each)


def main() -> list[Metric]:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        RunSpec(job="j.py", sets={}, nodes=1, gpus=1, backend="local", name="b").write(root)
        plain, locked, update, rewrite = [], [], [], []
        line = '{"event": "gave_up", "attempt": 0, "reason": "x"}\n'
        record = events.GaveUp(attempt=0, reason="x")
        spec = RunSpec.read(root)
        for _ in range(5):  # interleaved blocks: load changes hit every case alike
            plain += _timed(lambda: append_line(root / "plain.jsonl", line), REPEATS // 5)
            locked += _timed(lambda: ledger.append(root, record), REPEATS // 5)
            rewrite += _timed(lambda: spec.write(root), REPEATS // 5)
            update += _timed(lambda: RunSpec.update(root, lambda s: None), REPEATS // 5)
        owner = lease.take(root, lease.Owner.of_job("1"), lambda job: None)
        renew = _timed(lambda: lease.renew(root, owner.token))
        check = _timed(lambda: lease.owns(root, owner.token))
        per_record = {n: median([_many(root, n) for _ in range(3)]) for n in (1, 8, 32)}
    ratio = median(locked) / median(plain)
    metrics = [
        Metric(NAME, "ledger append under its lock", median(locked) * 1e3, "ms"),
        Metric(NAME, "ledger append / a plain O_APPEND write", ratio, "x",
               note="appends are events (a start, a fault), not steps: tens per run"),
        Metric(NAME, "spec.json update under its lock / a plain rewrite", median(update) / median(rewrite),
               "x"),
        Metric(NAME, "lease renewal (one process per job, every 5 s)", median(renew) * 1e3, "ms"),
        Metric(NAME, "lease check before a commit (rank 0)", median(check) * 1e3, "ms"),
        *(Metric(NAME, f"ledger append, {n} writers at once (per record, median of 3)", v * 1e3, "ms")
          for n, v in per_record.items()),
        Metric(NAME, "32 writers at once / 1 writer, per record", per_record[32] / per_record[1], "x",
               note="the lock serialises appends: a fault's records from every rank"),
    ]
    save(NAME, metrics, {"plain_s": plain, "locked_s": locked, "update_s": update, "rewrite_s": rewrite,
                         "renew_s": renew, "check_s": check, "per_record_s": per_record})
    return metrics


if __name__ == "__main__":
    show(main())
