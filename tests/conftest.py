"""Test layers: tests/unit (fast, no processes), tests/distributed (multi-rank torchrun on
CPU/gloo, and the CLI end to end), tests/slurm (the real local cluster). Each directory's
tests carry its layer's marker (unit, dist, slurm), so `pytest -m dist` runs one layer.
(Not `tests/dist`: pytest skips directories named dist by default.) tests/gpu (marker gpu)
needs one CUDA GPU and skips, with the reason, without one."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"unit": "unit", "distributed": "dist", "slurm": "slurm", "gpu": "gpu"}


# pytest-xdist (-n 3 --dist loadgroup, see pyproject): tests of one group run in one worker,
# in order. The Slurm tests share one cluster: "slurm" uses its low/high partitions (and
# preempts through them), "slurm-debug" only the separate debug partition, "slurm-nfs" only
# the nfs partition (its NFS-like nodes), so the three run side by side. Modules with
# expensive module-scoped fixtures stay in one worker each.
GROUPS = {"tests/distributed/test_runtime_train.py": "runtime-facts",
          "tests/distributed/test_runtime_tp.py": "tp-run",
          "tests/distributed/test_runtime_loss.py": "loss-facts",
          "tests/distributed/test_pretrained.py": "pretrained-facts",
          "tests/distributed/test_finetune.py": "finetune-example",
          "tests/unit/test_jobs_hf_causal_lm.py": "hf-model"}


RERUNS = 1
"""A multi-process test (dist, slurm) that fails is run once more (pytest-rerunfailures,
where it is installed: the `test` extra), and the first failure is printed in full under
"rerun test summary info" at the suite's end. On CI's 2 cores, three workers' runs of
launchers, ranks and a whole Slurm cluster starve each other for seconds at a time: about
one test in 2,000 met a timing it had never met here (three CI runs, three different tests,
each passing alone and under load). Each rerun listed is a race to find, as those three
were (tests/conftest.NOT_ABOUT_HANGS); a test that fails twice is red. The unit layer is
never rerun."""


def pytest_configure(config: pytest.Config) -> None:
    """Each rerun's first failure in full at the end (set here, not in pyproject's addopts:
    a pytest without the plugin, such as the GPU machine's, would refuse the option)."""
    if config.pluginmanager.hasplugin("rerunfailures"):
        config.option.rerun_show_tracebacks = True


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns xdist_group marks into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rerun = config.pluginmanager.hasplugin("rerunfailures")
    for item in items:
        path = Path(str(item.fspath)).relative_to(ROOT)
        layer = path.parts[1]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, LAYERS[layer]))
        if rerun and layer in ("distributed", "slurm"):
            item.add_marker(pytest.mark.flaky(reruns=RERUNS))
        group = GROUPS.get(str(path))
        if layer == "slurm":
            group = ("slurm-debug" if item.get_closest_marker("debug_partition") else
                     "slurm-nfs" if item.get_closest_marker("nfs_partition") else "slurm")
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


CPU_AT_SETUP = pytest.StashKey[float]()
CPU_SHOWN = 25
"""The suite's costliest tests by CPU, listed at its end (what to shorten: the suite is
CPU-bound on 2 cores)."""


def cpu_seconds() -> float:
    """User and system CPU of this process and of every descendant it has waited for (a
    test's CLI, launchers and ranks; not a Slurm job's, whose processes are slurmd's)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[CPU_AT_SETUP] = cpu_seconds()
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "teardown" and CPU_AT_SETUP in item.stash:  # (fixtures it started included)
        report.user_properties.append(("cpu_s", cpu_seconds() - item.stash[CPU_AT_SETUP]))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    costs = sorted(((value, report.nodeid) for reports in terminalreporter.stats.values()
                    for report in reports for key, value in getattr(report, "user_properties", ())
                    if key == "cpu_s"), reverse=True)
    if not costs:
        return
    total = sum(cost for cost, _ in costs)
    terminalreporter.write_sep("=", f"CPU seconds by test: {total:.0f} in all, the {CPU_SHOWN} costliest")
    for cost, nodeid in costs[:CPU_SHOWN]:
        terminalreporter.write_line(f"{cost:8.1f}s {100 * cost / total:5.1f}%  {nodeid}")


@pytest.fixture(autouse=True)
def no_site_config(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """This machine's own site and user files must not change what a test sees; tests that
    want a configuration set HPCSHARD_SITE / XDG_CONFIG_HOME themselves."""
    monkeypatch.setenv("HPCSHARD_SITE", "")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "no-user-config"))


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A 1-rank gloo process group in this process (no rendezvous, no network)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def quiet_env(**extra: str) -> dict[str, str]:
    """Two cores shared by up to four ranks: one thread each, and no warning about it.
    No SLURM_CONF unless a test asks: `--backend auto` then means the local backend."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def hpcshard(*args: str, cwd: Path = ROOT, timeout: float = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "hpcshard", *args], cwd=cwd,
                          env=quiet_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def hpcshard_bg(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the real CLI in the background (for preemption and fault injection)."""
    return subprocess.Popen([sys.executable, "-m", "hpcshard", *args], cwd=cwd, env=quiet_env(**(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if "loss" in r and "event" not in r]


def wait_for(cond: Callable[[], object], timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _status_field(pid: int, name: str) -> str | None:
    """One field of /proc/PID/status (None: no such process)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in status.splitlines()
                 if line.startswith(f"{name}:")), None)


def catches(pid: int, sig: int) -> bool:
    """The process has a handler for `sig` (/proc/PID/status SigCgt): what a test waits for
    before it sends a signal the process must take (a rank past its entry point's first
    line; until then a notice is lost or kills it), never a delay after its start."""
    caught = _status_field(pid, "SigCgt") or "0"
    return bool(int(caught, 16) >> (sig - 1) & 1)


def pending(pid: int) -> int:
    """The signals sent to the process and not yet taken (SigPnd, its thread's, and ShdPnd,
    the process's), as a mask: a signal sent is here until the process is scheduled to take
    it, so a test that asserts none was sent looks here too, not only after a delay."""
    return int(_status_field(pid, "SigPnd") or "0", 16) | int(_status_field(pid, "ShdPnd") or "0", 16)


def sleeping(pid: int) -> bool:
    """The process sleeps (State S): a freshly started `sleep 60` is running (R) until it
    has exec'd and reached its sleep, which on a loaded machine can take a while."""
    return (_status_field(pid, "State") or "").startswith("S")


def gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped (State Z)."""
    state = _status_field(pid, "State")
    return state is None or state.startswith("Z")


STEPS = 16
NOT_ABOUT_HANGS = {"watchdog_floor_s": 60}
"""Settings for a multi-node test whose subject is not the hang watchdog. A rank's wait for a
CPU is credited only by its own node's watchdog (`launch/watchdog.py`): its peers on another
node, asleep in a collective, are declared hung at the floor (5 s by default). On a busy 2-core
CI machine one slow step then adds a fault, a restart and steps trained again to what such a
test counts (CI recorded two faults in the fewer-nodes test: rank 0 "hung" at 5 s, before the
frozen node's silence was declared at 8 s)."""


def sets(**kv: object) -> list[str]:
    out = []
    # A global batch of 24 divides over 1, 2, 4 and 6 ranks: every shape sees the same batches.
    for k, v in {"log_every": 1, "eval_every": 0, "batch_size": 24, **kv}.items():
        out += ["--set", f"{k}={v}"]
    return out


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A temporary directory every pytest-xdist worker of this session sees (the parent of
    the workers' own); without xdist, the session's own."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def reference_run(shared_tmp: Path, name: str, nodes: int, gpus: int) -> Path:
    """The demo on `nodes` x `gpus`, STEPS steps, never preempted, a checkpoint after every
    step, all kept: trained once per session, under a lock in the pytest-xdist workers'
    common temporary directory (the first worker to ask trains it, the others wait)."""
    run, done = shared_tmp / name, shared_tmp / f"{name}.done"
    with FileLock(str(shared_tmp / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(run, ignore_errors=True)
            proc = hpcshard("submit", "--nodes", str(nodes), "--gpus", str(gpus), "jobs/charlm.py",
                            "--run-dir", str(run),
                            *sets(steps=STEPS, ckpt_every=1, keep_last=1000, eval_every=STEPS))
            assert proc.returncode == 0, proc.stdout[-3000:]
            done.touch()
    return run


@pytest.fixture(scope="session")
def uninterrupted(shared_tmp: Path) -> Path:
    """The reference for every exact-resume test of sharded state: the demo on 2x2 (HSDP,
    each rank holding half of each block), `reference_run`. Tests copy it before they
    change anything."""
    return reference_run(shared_tmp, "uninterrupted", 2, 2)


@pytest.fixture(scope="session")
def uninterrupted_2x1(shared_tmp: Path) -> Path:
    """The same reference on 2 nodes x 1 rank, for the fault tests whose subject is the
    launchers (a node frozen, a rank stopped, a notice that comes mid-recovery): their runs
    start 2 ranks instead of 4 at each of their starts (about 9 CPU-s each, and a third
    less per step), while `uninterrupted`'s tests keep the sharded state's exact resume."""
    return reference_run(shared_tmp, "uninterrupted-2x1", 2, 1)


@pytest.fixture
def fake_srun(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's SlurmExecutor refuses to exist where `srun` is not on PATH (it looks for
    it, nothing more): unit tests that build one to compare its text get a stand-in that
    fails if anything ever runs it."""
    bin_dir = tmp_path_factory.mktemp("fake-slurm")
    srun = bin_dir / "srun"
    srun.write_text("#!/bin/sh\necho 'fake srun: a unit test ran srun' >&2\nexit 99\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '')}")


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A file system of its own at `where`, `size` big (a disk that fills up, a mount that
    goes read-only): root only, as in CI."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode:
        pytest.fail("cannot mount a tmpfs (full-disk tests need root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
