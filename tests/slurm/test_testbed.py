"""The test cluster is like a real one where it claims to be (scripts/local-slurm's
HPCSHARD_SLURM_SHARED and HPCSHARD_SLURM_SKEW, on the nfs partition): each nfs node caches
lookups of the shared storage as an NFS client does, and a job on a skewed node reads a
wall clock that far off, with a monotonic clock that runs as the host's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.slurm.conftest import DIR, NFS_CACHE_S, NFS_NODES, SHARED, SKEW, slurm

# Two tasks of one step, one on each node: the creator makes a file on the shared storage
# just after the other node's task looked for it and missed, then replaces it by a rename.
# They take turns through flag files on this host's own disk (coherent for every node),
# never through the storage under test; times are monotonic, which every node shares here.
NFS_STEP = '''
import json, os, sys, time
from pathlib import Path
shared, flags, creator = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
f, out = shared / "f", {"node": os.environ["SLURMD_NODENAME"]}
def flag(name): (flags / name).touch()
def wait(name):
    while not (flags / name).exists(): time.sleep(0.01)
if out["node"] == creator:
    wait("missed")
    f.write_text("first")
    out["created"] = time.monotonic()
    out["sees_its_own"] = f.exists()
    flag("created")
    wait("read")
    (shared / "f.tmp").write_text("second, longer")
    os.rename(shared / "f.tmp", f)
    out["replaced"] = time.monotonic()
    flag("replaced")
else:
    out["missing_at_first"] = not f.exists()
    out["missed"] = time.monotonic()
    flag("missed")
    while not f.exists(): time.sleep(0.05)
    out["seen"] = time.monotonic()
    out["first"] = f.read_text()
    flag("read")
    wait("replaced")
    out["second"] = f.read_text()
    out["second_at"] = time.monotonic()
print(json.dumps(out), flush=True)
'''

CLOCK_STEP = '''
import json, os, subprocess, threading, time
wall, mono = time.time(), time.monotonic()
date = int(subprocess.run(["date", "+%s"], capture_output=True, text=True).stdout)
wall_after = time.time()
t = time.monotonic(); time.sleep(1); slept = time.monotonic() - t
t = time.monotonic(); threading.Event().wait(1); waited = time.monotonic() - t
print(json.dumps({"node": os.environ["SLURMD_NODENAME"], "wall": wall, "mono": mono, "date": date,
                  "wall_after": wall_after, "slept": slept, "waited": waited}), flush=True)
'''


def step(cluster: dict[str, str], nodes: list[str], script: Path, *args: str,
         env: dict[str, str] | None = None) -> dict[str, dict[str, float | str | bool]]:
    """One srun step on the nfs partition, a task per node; each task's JSON line, by node."""
    proc = subprocess.run(["srun", "-p", "nfs", "-t", "2", "-N", str(len(nodes)), "-n", str(len(nodes)),
                           "--ntasks-per-node=1", "-w", ",".join(nodes), sys.executable, str(script), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **cluster, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["node"]: r for r in found}


@pytest.mark.nfs_partition
def test_a_file_one_nfs_node_creates_stays_invisible_to_another_for_its_negative_lookup_time(
        cluster: dict[str, str], tmp_path: Path) -> None:
    """As on NFS: the other node looked the name up and missed; its miss is cached, so the
    file appears there only when that entry expires, most of NFS_CACHE_S later (on this
    host, which never looked, at once). A file replaced by a rename is read fresh at once:
    an open looks the name up again (close-to-open)."""
    creator, reader = NFS_NODES[0], NFS_NODES[1]
    shared = SHARED / f"test-{uuid.uuid4().hex[:8]}"
    shared.mkdir()
    flags = tmp_path / "flags"
    flags.mkdir()
    script = tmp_path / "nfs_step.py"
    script.write_text(NFS_STEP)
    try:
        got = step(cluster, [creator, reader], script, str(shared), str(flags), creator)
        after = (shared / "f").read_text()  # this host's view: it never looked, so fresh
    finally:
        shutil.rmtree(shared, ignore_errors=True)  # the backing directory outlives the cluster
    made, read = got[creator], got[reader]
    assert made["sees_its_own"] and read["missing_at_first"], got
    hidden = float(read["seen"]) - float(made["created"])
    assert hidden >= 0.6 * NFS_CACHE_S, f"the other node saw the new file {hidden:.1f} s after it was made"
    # (at most twice the cache's time, not its time and 2 s: the reader polls on a loaded
    # machine; a lookup cached as on a real mount, 30 to 60 s, is far past either)
    assert float(read["seen"]) - float(read["missed"]) <= 2 * NFS_CACHE_S, got
    assert read["first"] == "first"
    assert read["second"] == "second, longer", "a file replaced by a rename was read stale"
    # (read once the flag is up: a read held stale would be for the cache's NFS_CACHE_S)
    assert float(read["second_at"]) - float(made["replaced"]) < NFS_CACHE_S / 2, got
    assert after == "second, longer"


@pytest.mark.nfs_partition
def test_a_job_on_a_skewed_node_reads_its_wall_clock_off_and_its_monotonic_clock_right(
        cluster: dict[str, str], tmp_path: Path) -> None:
    """Every nfs node in one step, submitted with a skewed node's clock in its environment (as
    a job submitted from one would be): each task reads its own node's wall clock (python
    and date), the unskewed node none; the monotonic clock is the host's, and sleeps and
    timed waits last what they should (libfaketime's hung or failed here). Slurm keeps the
    skewed nodes."""
    script = tmp_path / "clock_step.py"
    script.write_text(CLOCK_STEP)
    skewed = next(iter(SKEW))
    env = {"LD_PRELOAD": str(DIR / "lib" / "local-slurm-skew.so"), "LOCAL_SLURM_SKEW": str(SKEW[skewed])}
    mono_before, host = time.monotonic(), time.time() - time.monotonic()
    got = step(cluster, list(NFS_NODES), script, env=env)
    mono_after = time.monotonic()
    assert sorted(got) == sorted(NFS_NODES)
    for node, r in got.items():
        skew = SKEW.get(node, 0.0)
        # The offset, measured against the shared monotonic clock: exact but for the time
        # between two readings.
        offset = float(r["wall"]) - float(r["mono"]) - host
        # (two readings on one line: 2 s is room for a preemption between them, against a
        # skew of 30 s)
        assert abs(offset - skew) < 2, f"{node}: wall clock {offset:+.1f} s off the host's, not {skew:+g}"
        # date's second lies between python's readings before and after it (date truncates):
        # not within 2 s of the first, which a loaded machine's start of `date` could pass
        assert int(float(r["wall"])) <= int(r["date"]) <= float(r["wall_after"]), (
            f"{node}: date disagrees with python: {r}")
        assert mono_before <= float(r["mono"]) <= mono_after, f"{node}: monotonic clock off the host's: {r}"
        # A sleep of 1 s timed on the wrong clock is off by the skew (30 s): the upper bound
        # is half of that, not 1.5 s, which a loaded machine's late wake-up could pass.
        late = 1 + min(abs(v) for v in SKEW.values()) / 2
        assert 0.9 <= float(r["slept"]) < late and 0.9 <= float(r["waited"]) < late, f"{node}: {r}"
    states = slurm("sinfo", "-h", "-N", "-n", ",".join(SKEW), "-o", "%T").split()
    assert len(states) == len(SKEW), states  # neither down, drained nor silent
    assert not any(bad in s for s in states for bad in ("down", "drain", "fail", "*")), states
