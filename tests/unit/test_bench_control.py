"""The control-plane bench's pure parts (bench/opcount.py, bench/stamps.py,
bench/control_report.py): what strace lines count as operations on the run directory,
the fake ranks' stamps, the CPU from /proc/stat, the rows and the projection. The bench
itself is run by `python -m bench control`, never here (no timed assertions in tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import control_report, opcount, stamps

pytestmark = pytest.mark.unit

ROOT = "/r/run"
HOST = "vm"
SIDE = f"{ROOT}/launch/.alive-0-12.json.{HOST}.42.9f.tmp"
NONE = "= -1 ENOENT (No such file or directory)"
TRACE = f"""\
101 1000.000100 mkdir("{ROOT}/launch", 0777) = -1 EEXIST (File exists)
101 1000.000200 newfstatat(AT_FDCWD</w>, "{ROOT}/launch", {{st_mode=S_IFDIR|0755, ...}}, 0) = 0
101 1000.000300 openat(AT_FDCWD</w>, "{ROOT}/launch/fault-0-3.json", O_RDONLY|O_CLOEXEC) {NONE}
101 1000.000400 openat(AT_FDCWD</w>, "{SIDE}", O_WRONLY|O_CREAT, 0666 <unfinished ...>
102 1000.000450 read(7</proc/55/stat>, "55 (python) S", 1024) = 30
101 1000.000500 <... openat resumed>) = 3<{SIDE}>
101 1000.000600 newfstatat(3<{SIDE}>, "", {{...}}, AT_EMPTY_PATH) = 0
101 1000.000700 write(3<{SIDE}>, "{{}}", 2) = 2
101 1000.000800 fsync(3<{SIDE}>) = 0
101 1000.000900 close(3<{SIDE}>) = 0
101 1000.001000 rename("{SIDE}", "{ROOT}/launch/alive-0-12.json") = 0
101 1000.001100 openat(AT_FDCWD</w>, "/r/run2/launch/alive-0-1.json", O_RDONLY) {NONE}
101 1000.001200 getdents64(4<{ROOT}/logs>, 0x55 /* 3 entries */, 32768) = 72
101 1000.001300 --- SIGCHLD {{si_signo=SIGCHLD}} ---
101 1000.001400 +++ exited with 0 +++
101 1001.500000 openat(AT_FDCWD</w>, "{ROOT}/launch/fault-0-3.json", O_RDONLY|O_CLOEXEC) {NONE}
"""


def count(since: float | None = None, until: float | None = None) -> opcount.Counts:
    return opcount.count(TRACE.splitlines(), ROOT, since, until)


def test_every_call_that_names_the_run_directory_is_counted_once_by_its_kind() -> None:
    """A call split by another thread's is counted at its start; a stat of an open file by
    its descriptor (Python's fstat) is not a lookup; a sibling directory that shares the
    run directory's name as a prefix, /proc, signals and exits are not the run's."""
    c = count()
    assert c.calls == {"mkdir": 1, "newfstatat": 1, "openat": 3, "fstat": 1, "write": 1, "fsync": 1,
                       "close": 1, "rename": 1, "getdents64": 1}
    assert (c.of("metadata"), c.of("data"), c.of("other")) == (7, 2, 2)


def test_metadata_operations_are_named_by_file_with_numbers_and_side_names_folded() -> None:
    c = opcount.count(TRACE.splitlines(), ROOT)
    assert "launch/fault-N-N.json" in c.files and c.files["launch/fault-N-N.json"] == 2
    assert opcount.kind(SIDE, ROOT, HOST) == "launch/.alive-N-N.json.*.tmp"
    assert opcount.kind(f"{ROOT}/.owner.beat.{HOST}.17.0a.tmp", ROOT, HOST) == ".owner.beat.*.tmp"
    assert opcount.kind(ROOT, ROOT, HOST) == "."


def test_only_the_window_is_counted_and_the_rate_is_per_second_of_it() -> None:
    c = count(since=1000.0, until=1001.0)
    assert c.calls["openat"] == 2  # (the fault look at 1001.5 is after the window)
    assert c.rate("metadata") == pytest.approx(6.0)
    assert count(since=1001.0, until=1003.0).rate("metadata") == pytest.approx(0.5)


@pytest.mark.parametrize("call,kind", [("openat", "metadata"), ("unlinkat", "metadata"), ("link", "metadata"),
                                       ("getdents64", "metadata"), ("pread64", "data"), ("fdatasync", "data"),
                                       ("fstat", "other"), ("lseek", "other"), ("close", "other")])
def test_what_an_nfs_client_sends_as_a_metadata_rpc_is_metadata(call: str, kind: str) -> None:
    assert opcount.category(call) == kind


def test_stamps_keep_whole_lines_and_each_nodes_first() -> None:
    text = ("start 0 1 55 10.5\nfirst 0 1 55 11.0\nstart 0 2 56 10.7\nstart 0 1 57 12.0\n"
            "first 1 2 9\nstart x 1 1 1\n")
    found = stamps.parse_stamps(text)
    assert len(found) == 4
    starts = stamps.stamped(found, "start", 0)
    assert {n: (s.pid, s.time) for n, s in starts.items()} == {1: (55, 10.5), 2: (56, 10.7)}
    assert stamps.stamped(found, "first", 1) == {}


def test_the_machines_busy_share_leaves_idle_iowait_and_guest_time_out() -> None:
    before = stamps.parse_cpu("cpu  100 0 50 800 50 0 0 0 30 0\ncpu0 1 2 3\n")
    after = stamps.parse_cpu("cpu  160 0 70 900 70 0 0 0 90 0\n")
    assert before == (150, 1000)
    assert stamps.cpu_busy(before, after) == pytest.approx(80 / 200)
    assert stamps.cpu_busy(after, after) == 0.0


def result(nodes: int, leader: float, other: float, decided: list[float]) -> dict[str, object]:
    ops = {"leader": {"seconds": 10.0, "metadata_per_s": leader, "data_per_s": 1.0,
                      "files": {"launch/fault-N-N.json": 48}},
           **{f"node{n}": {"seconds": 10.0, "metadata_per_s": other, "files": {"launch": 1}} for n in (1, 7)}}
    faults = [{"detect": 0.1, "decided": d, "training_all": d + 1, "down_all": None, "busy": 0.5,
               "load1": 1.0} for d in decided]
    return {"nodes": nodes, "ops": ops, "faults": faults, "file_channel": True,
            "cpu": {"busy": 0.4, "load1": 1.0, "launcher_ms_per_node_s": 2.0},
            "traced_fault": {"training_all": 2.0,
                             "ops": {"leader": {"metadata": 90}, "other": {"metadata": 40}}}}


def test_a_row_weighs_the_leader_once_and_takes_medians_of_the_faults() -> None:
    row = control_report.summary(result(8, 30.0, 22.0, [1.0, 3.0, 1.5]))  # type: ignore[arg-type]
    assert row["ops_mean"] == pytest.approx((30 + 7 * 22) / 8)
    assert row["decided"] == 1.5 and row["down_all"] is None and row["repeats"] == 3
    assert row["fault_looks_per_s"] == pytest.approx(4.8)
    assert (row["recovery_ops_leader"], row["recovery_ops_other"]) == (90, 40)


def test_the_projection_fits_a_line_through_the_rows_and_the_page_shows_it() -> None:
    results = [result(n, 20.0 + n, 20.0 + n, [1.5]) for n in (2, 8, 32)]
    rows = [control_report.summary(r) for r in results]  # type: ignore[arg-type]
    a, b = control_report.project(rows) or (0, 0)
    assert (a, b) == (pytest.approx(20.0), pytest.approx(1.0))
    assert control_report.project(rows[:1]) is None
    page = control_report.markdown("python -m bench.control", "files", 20, results, rows, "today", "2 cores")
    assert "= 20.0 + 1.00 N" in page and "1,024 nodes: 1,044 per node" in page and "| 32 | 1 |" in page
    met = {m.name: m.ok for m in control_report.metrics(rows)}
    assert met["decision latency N=32 / N=2"] is True
    assert met["N=2: metadata ops per node per s (steady)"] is False


def test_the_bench_loads_without_torch() -> None:
    """128 launchers and fake ranks must fit this machine: nothing of it imports torch."""
    code = ("import sys, bench.control, bench.control_node, bench.control_rank, bench.__main__; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_store_run_whose_decisions_land_in_files_too_is_no_file_channel(tmp_path: Path) -> None:
    """Every decision is also created as launch/next-A-C.json (the arbiter of a job cut in
    two), through the store too: the bench's "file channel" is the fault and down files."""
    from bench.control import Cluster

    cluster = Cluster(tmp_path, 2, 1, None)  # type: ignore[arg-type]
    (cluster.run_dir / "launch").mkdir(parents=True)
    for name in ("next-0-0.json", "alive-0-0.json", "alive-0-1.json", ".next-0-1.json.vm.42.9f.tmp"):
        (cluster.run_dir / "launch" / name).write_text("{}\n")
    assert not cluster.file_channel()
    (cluster.run_dir / "launch" / "down-0-0-1.json").write_text("{}\n")
    assert cluster.file_channel()
