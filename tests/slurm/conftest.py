"""One real local Slurm cluster (2 nodes x 2 fake GPUs, partitions low and high, 3 more
nodes in partition debug and 3 in partition nfs; accounting by slurmdbd and MariaDB) for
the whole session, started through the project's own script. The nfs nodes are the ones
like a real cluster's: each has its own NFS-like view of the shared storage (SHARED), and
two of them a skewed wall clock (SKEW). It fails loudly, never skips: CI installs Slurm
and must run these tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

from tests.conftest import ROOT, hpcshard

SCRIPT = ROOT / "scripts" / "local-slurm"
DIR = Path(os.environ.get("HPCSHARD_SLURM_DIR", "/tmp/hpcshard-slurm"))
CONF = DIR / "etc" / "slurm.conf"
SHARED = DIR / "shared"
"""The cluster's NFS-like shared storage (HPCSHARD_SLURM_SHARED): this host and each nfs node
see it through a view with caches of its own. Runs and files that must meet NFS's caches
go here; each test in a directory of its own."""
NFS_NODES = ("n6", "n7", "n8")
NFS_CACHE_S = 5
"""The views' entry and negative-lookup cache times (NFS's defaults are 30 s; 5 keeps the
tests short), attributes 1 s (NFS: 3 s)."""
NFS_OPTIONS = f"entry_timeout={NFS_CACHE_S},negative_timeout={NFS_CACHE_S},attr_timeout=1"
SKEW = {"n7": 30.0, "n8": -30.0}
"""Wall-clock offsets (seconds) of the jobs on these nfs nodes (HPCSHARD_SLURM_SKEW)."""
MAX_ARRAY_SIZE = 6
"""The cluster's MaxArraySize (Slurm's default is 1001), so that a sweep of a few tasks is
more than one array takes (test_sweep_split). Every other sweep or array of these tests
fits in one (the largest: test_polling's 6 tasks); a test that needs a larger one is split."""


FAILED = pytest.StashKey[bool]()
GROUP_PARTITIONS = {"debug_partition": ("debug",), "nfs_partition": ("nfs",)}
"""The partitions a test of each group submits to (`tests/conftest.GROUPS`: one worker runs a
group's tests one after another); low and high for the others. One exception: test_owner
(low/high) runs a short second job on debug beside its first, and cancels it itself; a
debug test's failure in that minute cancels it too, and test_owner fails (once)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when in ("setup", "call"):  # (a setup that failed has no call)
        item.stash[FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def clear_a_failed_tests_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that failed may leave its jobs running or pending (it stopped at an assert
    while they went on). Its rerun (`tests/conftest.RERUNS`), and the next test of its
    group, would queue behind them on the same few nodes and fail for want of them: its
    group's partitions are emptied (scancel) and waited for, up to a minute and a half,
    before either starts. Nothing is done after a test that passed."""
    yield
    if not request.node.stash.get(FAILED, False):
        return
    parts = next((p for mark, p in GROUP_PARTITIONS.items() if request.node.get_closest_marker(mark)),
                 ("low", "high"))
    env = {**os.environ, "SLURM_CONF": str(CONF)}
    deadline = time.monotonic() + 90
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # (no cluster: nothing to clear)
        for part in parts:
            subprocess.run(["scancel", "--partition", part], env=env, capture_output=True, timeout=60)
        while time.monotonic() < deadline:
            queued = subprocess.run(["squeue", "-h", "-p", ",".join(parts)], env=env, capture_output=True,
                                    text=True, timeout=60)
            if queued.returncode == 0 and not queued.stdout.strip():  # (a failed squeue says nothing)
                break
            time.sleep(2)


@pytest.fixture(scope="session")
def cluster(shared_tmp: Path) -> Iterator[dict[str, str]]:
    """Up once for every pytest-xdist worker that runs Slurm tests (a lock and a count in
    their common temporary directory); the last one to finish takes it down. 2 nodes for
    low/high, 3 more for the debug partition and 3 for the nfs one (2 nodes and a spare
    each)."""
    users, lock = shared_tmp / "slurm.users", FileLock(str(shared_tmp / "slurm.lock"))
    with lock:
        count = int(users.read_text()) if users.exists() else 0
        if count == 0:
            # With accounting (slurmdbd + MariaDB), and finished jobs forgotten by the
            # controller 10 s after they end (about 15 s, measured) instead of 300 s: the
            # accounting test reads them back from sacct.
            up = subprocess.run([str(SCRIPT), "up", "2", "3", str(len(NFS_NODES))], capture_output=True,
                                text=True, timeout=600,
                                env={**os.environ, "HPCSHARD_SLURM_ACCOUNTING": "1",
                                     "HPCSHARD_SLURM_MIN_JOB_AGE": "10", "HPCSHARD_SLURM_SHARED": str(SHARED),
                                     "HPCSHARD_SLURM_MAX_ARRAY_SIZE": str(MAX_ARRAY_SIZE),
                                     "HPCSHARD_SLURM_NFS": NFS_OPTIONS,
                                     "HPCSHARD_SLURM_SKEW": ",".join(f"{n}={s:+g}" for n, s in SKEW.items())})
            if up.returncode:
                pytest.fail(f"the local Slurm cluster did not start:\n{up.stdout}\n{up.stderr}")
        users.write_text(str(count + 1))
    yield {"SLURM_CONF": str(CONF)}
    with lock:
        count = int(users.read_text()) - 1
        users.write_text(str(count))
        if count == 0:
            subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=120)


def slurm(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True,
                          env={**os.environ, "SLURM_CONF": str(CONF)}).stdout


def job_info(job: str) -> dict[str, str]:
    """scontrol's JobState and Restarts of a job; once it has forgotten the job (MinJobAge
    is short on the test cluster), accounting's (a requeued job has a run per requeue)."""
    try:
        out = slurm("scontrol", "show", "job", "-o", job)
    except subprocess.CalledProcessError:
        from hpcshard.slurm.cluster import SACCT_FIELDS, parse_history

        runs = parse_history(slurm("sacct", "-j", job, "--duplicates", "-X", "-n", "-P", "-o",
                                   SACCT_FIELDS), [job])
        assert runs, f"neither scontrol nor sacct knows job {job}"
        return {"JobState": runs[-1].state, "Restarts": str(len(runs) - 1)}
    return {key: value for key, sep, value in (t.partition("=") for t in out.split()) if sep}


def state(job: str) -> str:
    return job_info(job)["JobState"]


def restarts(job: str) -> int:
    return int(job_info(job)["Restarts"])


def wait_state(job: str, states: set[str], timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while (now := state(job)) not in states:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} still {now} after {timeout}s (wanted {states})")
        time.sleep(1)
    return now


def story(run: Path, lines: int = 30) -> str:
    """What a run and its jobs did, for a failing assertion's message: the ledger's records
    (their deciding fields), each job's accounting, the controller's log lines about it
    (who cancelled it shows there: `_slurm_rpc_kill_job ... uid`), and the tail of each of
    its launchers' logs."""
    import json

    from hpcshard.rundir import ledger

    keys = ("event", "attempt", "reason", "how", "cause", "job", "next", "slurm_node", "slurm_job", "at_once")
    out = ["ledger:"] + [str({k: r[k] for k in keys if k in r}) for r in ledger.read(run)]
    spec = run / "spec.json"
    jobs = json.loads(spec.read_text()).get("jobs", []) if spec.exists() else []
    ctld = (DIR / "log" / "slurmctld.log")
    log = ctld.read_text(errors="replace").splitlines() if ctld.exists() else []
    for job in jobs:
        out.append(f"job {job}:")
        fields = "JobID,State,ExitCode,NodeList,Reason"
        out += subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", fields], capture_output=True,
                              text=True, env={**os.environ, "SLURM_CONF": str(CONF)}).stdout.splitlines()
        out += [line for line in log if f"JobId={job} " in line or f"JobId={job}." in line][-lines:]
        for err in sorted((run / "submitit").glob(f"{job}_*_log.err")):
            out += [f"  {err.name}: {line}" for line in err.read_text(errors="replace").splitlines()[-lines:]]
    return "\n".join(out)


POLL_S, POLL_MAX_S = 1, 4
"""The site's poll settings for a followed sweep (`follow_sweep`)."""


def follow_sweep(cluster: dict[str, str], root: Path, tmp_path: Path,
                 timeout: float) -> tuple[str, list[list[str]]]:
    """`hpcshard status SWEEP --follow` to the sweep's end under a site polling POLL_S apart
    (backing off to POLL_MAX_S): its output and the Slurm calls it made (time, command). Its
    polls are one squeue each for every task, never a call job by job: the last two calls are
    the final table's (accounting, then squeue at most); and never more than one a poll."""
    site = tmp_path / "site.toml"
    site.write_text(f"[defaults]\npoll_s = {POLL_S}\npoll_max_s = {POLL_MAX_S}\n")
    log = tmp_path / "calls.log"
    start = time.time()
    followed = hpcshard("status", str(root), "--follow", timeout=timeout,
                        env={**cluster, "HPCSHARD_SITE": str(site), "HPCSHARD_SLURM_CALLS_LOG": str(log)})
    took = time.time() - start
    assert followed.returncode == 0, followed.stdout + followed.stderr
    calls = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert {name for _, name in calls[:-2]} == {"squeue"}, calls
    assert len(calls) <= took / POLL_S + 3, (len(calls), took)
    return followed.stdout, calls


def freeze(node: str, sig: signal.Signals = signal.SIGSTOP) -> list[int]:
    """SIGSTOP (or SIGCONT) every process of a local-cluster node (`scripts/local-slurm
    freeze|thaw`): its slurmd, the slurmstepds it started and the job's processes below
    them. A node frozen this way sends nothing, as one that died or fell off the network."""
    verb = {signal.SIGSTOP: "freeze", signal.SIGCONT: "thaw", signal.SIGKILL: "kill"}[sig]
    out = subprocess.run([str(SCRIPT), verb, node], capture_output=True, text=True, check=True)
    return [int(pid) for pid in out.stdout.split()]
