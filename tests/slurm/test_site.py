"""Site profiles on the real local cluster: a user with only a site file and --profile runs
the demo through a site template, and `doctor` passes there and names each failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from tests.conftest import NOT_ABOUT_HANGS, STEPS, hpcshard, sets, step_records, wait_for
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load, trained_to
from tests.slurm.conftest import restarts, wait_state

TOKEN = "tok" + "X9q" * 11
"""A secret the profile names: in the submitting environment, never in a file."""
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

# A stand-in for Lmod's `module`: records what was loaded, fails for unknown modules.
FAKE_MODULE = """#!/bin/sh
echo "$(hostname) module $*" >> "$MODULE_LOG"
case "$*" in *missing*) echo "Lmod has detected the following error: unknown module $*"; exit 1;; esac
"""

# Overrides only the launch block: the same srun, with a flag of the site's and a marker.
LAUNCH = """{% extends "sbatch.j2" %}
{% block launch -%}
# site launch ({{ reservation }})
echo "site launch on $SLURM_JOB_NODELIST"
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --cpu-bind=none --output {{ task_stdout | q }} --error {{ task_stderr | q }} \\
    "${HPCSHARD_SRUN_ARGS[@]}" "${HPCSHARD_WRAP[@]}" {{ command }}
{%- endblock %}
"""


@pytest.fixture
def site_env(cluster: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """A site directory (site.toml + templates/), a fake `module` on PATH, shared storage."""
    root = tmp_path / "site"
    (root / "templates").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "module").write_text(FAKE_MODULE)
    (root / "bin" / "module").chmod(0o755)
    (root / "templates" / "launch.j2").write_text(LAUNCH)
    (tmp_path / "shared").mkdir()
    (root / "site.toml").write_text(f'''
profile = "local"
template_dirs = ["templates"]

[defaults]
storage_root = "{tmp_path}/shared"

[profiles.local]
description = "the local test cluster"
partition = "low"
requeue_policy = "requeue"
gpus_per_node = 2
time = "00:10:00"
modules = ["demo/1.0"]
env = {{ SITE_MARK = "hello world" }}
setup = ['echo "setup saw $SITE_MARK on $(hostname), secret ${{#SITE_TOKEN}} long" >> "{tmp_path}/setup.log"']
secrets = ["SITE_TOKEN"]
signal = "USR1"
template = "launch.j2"
vars = {{ reservation = "none" }}

[profiles.chained]
description = "the local test cluster, continuation jobs"
partition = "low"
gpus_per_node = 2
requeue_policy = "chain"

[profiles.big]
partition = "high"
gpus_per_node = 8

[profiles.typo]
partition = "lowww"
''')
    path = f"{root / 'bin'}:{os.environ['PATH']}"
    # sbatch passes the submitting environment on: the fake module finds its log there.
    yield {**cluster, "HPCSHARD_SITE": str(root / "site.toml"), "PATH": path,
           "MODULE_LOG": str(tmp_path / "modules.log"), "SITE_TOKEN": TOKEN}


def test_a_profile_alone_runs_the_demo_through_a_site_launch_block(
        site_env: dict[str, str], tmp_path: Path, uninterrupted: Path) -> None:
    """No --backend, --gpus, --partition or --run-dir: the site file and --profile say it all.
    The profile's notice (USR1) is what `preempt` sends and what the ranks stop on; the job
    is requeued by Slurm and resumes bit for bit where it stopped (the same weights as the
    2x2 reference that was never preempted)."""
    proc = hpcshard("submit", "--profile", "local", "--nodes", "2", "jobs/charlm.py",
                    *sets(steps=STEPS, **NOT_ABOUT_HANGS), env=site_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)  # type: ignore[union-attr]
    run = Path(re.search(r"run directory: (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert run.parent == tmp_path / "shared"  # the profile's storage root
    script = (run / "submitit" / f"{job}_submission.sh").read_text()
    for line in ("#SBATCH --partition=low", "#SBATCH --gpus-per-node=2", "#SBATCH --signal=USR1@120",
                 "module load demo/1.0", "export SITE_MARK='hello world'", "# site launch (none)",
                 "srun --unbuffered --cpu-bind=none"):
        assert line in script, line
    wait_for(lambda: trained_to(run, 3), 240, "training to start")
    preempt = hpcshard("preempt", str(run), env=site_env)
    assert preempt.returncode == 0 and "sent SIGUSR1" in preempt.stdout, preempt.stdout + preempt.stderr
    assert wait_state(job, DONE, 300) == "COMPLETED"
    assert restarts(job) == 1
    ends = [r for r in ledger.read(run) if r["event"] == "end"]
    assert [e["reason"] for e in ends] == ["stop", "done"]
    starts = [r for r in ledger.read(run) if r["event"] == "start"]
    assert starts[1]["resumed_step"] == ends[0]["saved_step"] == ends[0]["step"]  # nothing recomputed
    assert [r["step"] for r in step_records(run)] == list(range(1, STEPS + 1))  # no step twice
    assert_bitwise_equal(load(committed(run)[STEPS]), load(committed(uninterrupted)[STEPS]), "final")
    spec = json.loads((run / "spec.json").read_text())
    assert spec["profile"] == "local" and spec["gpus"] == 2
    # What the profile asked for happened on the compute nodes, once per attempt.
    assert (tmp_path / "modules.log").read_text().count("module load demo/1.0") == 2
    assert f"setup saw hello world on n1, secret {len(TOKEN)} long" in (tmp_path / "setup.log").read_text()
    assert ': "${SITE_TOKEN:?the secret SITE_TOKEN' in script  # the secret arrived, by name
    leaked = [f for f in run.rglob("*") if f.is_file() and TOKEN.encode() in f.read_bytes()]
    assert not leaked, leaked
    assert "site launch on n[1-2]" in (run / "logs" / f"slurm-{job}.out").read_text()


def test_a_profile_asking_more_gpus_than_the_partition_has_is_refused(site_env: dict[str, str],
                                                                      tmp_path: Path) -> None:
    proc = hpcshard("submit", "--profile", "big", "jobs/charlm.py", env=site_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "8 GPUs per node (--gpus, or the profile's gpus_per_node) is more than the nodes of " \
           "partition 'high' have (2)" in proc.stderr
    assert not any((tmp_path / "shared").iterdir())  # nothing created


def test_doctor_passes_on_the_local_cluster_with_a_smoke_all_reduce(site_env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    proc = hpcshard("doctor", "--smoke", env=site_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[8:30].strip(): line[:6].strip() for line in proc.stdout.splitlines()[2:] if line[:4]
            in ("pass", "FAIL", "skip")}
    assert rows == {"template": "pass", "slurm commands": "pass", "controller": "pass",
                    "storage root": "pass", "partition": "pass", "gpus per node": "pass",
                    "time limit": "pass", "storage from compute": "pass",
                    "modules": "pass", "requeue": "pass", "all-reduce": "pass"}, proc.stdout
    assert "4 ranks on n1,n2 (gloo)" in proc.stdout and "all checks passed" in proc.stdout
    assert not list((tmp_path / "shared").iterdir())  # the probe cleaned up after itself


def test_doctor_checks_that_compute_nodes_may_submit_a_continuation(site_env: dict[str, str]) -> None:
    proc = hpcshard("doctor", "--profile", "chained", env=site_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chain: sbatch from a compute node accepted (a held job, cancelled)" in proc.stdout


def test_doctor_names_each_failure_with_its_fix(site_env: dict[str, str], tmp_path: Path) -> None:
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    # Root ignores permission bits: only a read-only mount is unwritable for every user.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], check=True)
    try:
        proc = hpcshard("doctor", "--profile", "typo", env=site_env,
                        cwd=_project(tmp_path, f'[defaults]\nstorage_root = "{readonly}"\n'))
    finally:
        subprocess.run(["umount", str(readonly)], check=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    site = site_env["HPCSHARD_SITE"]
    assert f"FAIL    storage root          {readonly} is not writable" in proc.stdout
    assert "FAIL    partition             'lowww' does not exist" in proc.stdout
    assert "skip    storage from compute  needs the partition checks to pass" in proc.stdout
    assert (f"partition: set partition in site {site} [profiles.typo] to one of: debug, high, low"
            in proc.stdout)
    assert f"storage root: make it writable for this user or set storage_root in project " \
           f"{tmp_path / 'project' / 'hpcshard.toml'} [defaults]" in proc.stdout
    # A module that does not load is caught on the compute node, by the probe job.
    proc = hpcshard("doctor", env=site_env,
                    cwd=_project(tmp_path, '[profiles.local]\nmodules = ["missing/1.0"]\n'))
    assert proc.returncode == 1
    assert "FAIL    modules               module load missing/1.0: Lmod has detected" in proc.stdout
    assert "modules: fix the module names (module avail), or set modules in project" in proc.stdout


def _project(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "project"
    folder.mkdir(exist_ok=True)
    (folder / "hpcshard.toml").write_text(text)
    return folder
