"""hpcshard.slurm against the real sbatch: the values it accepts and refuses for --time and
--mem are the ones sbatch accepts and refuses (tests/unit/test_slurm_time.py has the full
table, measured once; this keeps it honest on the Slurm the tests run), and a guard's
script gets the node count it asks for."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcshard.slurm.cluster import requeue as cluster_requeue
from hpcshard.slurm.env import expand_nodelist
from hpcshard.slurm.sbatch import SbatchRequest, ranged_script, render
from hpcshard.slurm.time import parse_limit, parse_mem
from tests.conftest import wait_for
from tests.slurm.conftest import NFS_NODES, job_info, state

TIMES = ["30", "1:30", "1-2:30", "99:99:99", "1-", "0", "UNLIMITED", "infinite",
         "1:2:3:4", "1.5", " 30", "", "abc", "1::2", "+5"]
MEMS = ["200", "100MB", "1024K", "0", "-0", "+200", " 200",
        "1.5G", "200GiB", "200Gfoo", "200 G", "-1", "G", "", "1e3"]
# sbatch takes these but wraps them (minus 5 days; 2**63 MB): hpcshard refuses them on purpose.
WRAPPED = [("time", "-5"), ("time", "35791394"), ("mem", "8796093022208T")]


def _sbatch_takes(cluster: dict[str, str], option: str, value: str) -> bool:
    proc = subprocess.run(["sbatch", "--test-only", "--partition", "debug", f"--{option}={value}",
                           "--wrap", "true"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **cluster})
    if f"Invalid --{option} specification" in proc.stderr:
        return False
    assert proc.returncode == 0, f"--{option}={value!r}: {proc.stderr}"  # not a scheduling answer
    return True


def _we_take(parse: Callable[[str], object], value: str) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


@pytest.mark.debug_partition
def test_parsers_accept_what_sbatch_accepts(cluster: dict[str, str]) -> None:
    parsers: dict[str, Callable[[str], object]] = {"time": parse_limit, "mem": parse_mem}
    cases = [("time", v) for v in TIMES] + [("mem", v) for v in MEMS]
    disagree = [(option, value, sbatch) for option, value in cases
                if (sbatch := _sbatch_takes(cluster, option, value)) != _we_take(parsers[option], value)]
    assert not disagree, f"(option, value, sbatch accepts) where hpcshard disagrees: {disagree}"
    for option, value in WRAPPED:
        assert _sbatch_takes(cluster, option, value) and not _we_take(parsers[option], value), value


def _nodes_sbatch_would_give(cluster: dict[str, str], script: Path, nodes: str) -> int:
    """How many nodes of partition nfs a job of `script` with --nodes=`nodes` would get
    (sbatch --test-only: Slurm's own pick, nothing run)."""
    proc = subprocess.run(["sbatch", "--test-only", "--partition", "nfs", f"--nodes={nodes}", str(script)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **cluster})
    got = re.search(r"on nodes (\S+)", proc.stderr)
    assert proc.returncode == 0 and got, proc.stderr
    return len(expand_nodelist(got.group(1)))


def _idle(cluster: dict[str, str], partition: str) -> int:
    proc = subprocess.run(["sinfo", "-h", "-p", partition, "-t", "idle", "-o", "%D"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **cluster})
    return int(proc.stdout.strip() or 0)


def _script(tmp_path: Path, name: str, command: str, site_line: str = "") -> Path:
    """The built-in template rendered for 3 nodes of 2 GPUs running `command`, with a site
    template's own directive `site_line` after the first line where given."""
    req = SbatchRequest(job_name="values", nodes=3, gpus_per_node=2, run_dir=tmp_path / "run")
    for folder in ("submitit", "run/logs"):  # (the job's output files: Slurm opens them there)
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    head, _, rest = render(req, command, tmp_path / "submitit").partition("\n")
    path = tmp_path / name
    path.write_text(f"{head}\n{site_line}\n{rest}" if site_line else f"{head}\n{rest}")
    return path


@pytest.mark.nfs_partition
def test_a_guard_s_script_gets_every_node_of_its_range_that_is_free(cluster: dict[str, str],
                                                                    tmp_path: Path) -> None:
    """A guard asks for N to N+S nodes (`launch.slurm.guard`). A script that says
    `--ntasks-per-node=1` (the built-in template did; a site's may) makes sbatch count N
    tasks, and Slurm gives N nodes with N+S free, so a run the guard took over had no spare.
    The built-in template says no task count, and a guard's script leaves such options out
    (`sbatch.ranged_script`): both get all N+S, the nfs partition's 3 nodes. (That partition
    is its group's alone, tests/slurm/conftest.GROUP_PARTITIONS: once the previous test's jobs
    have ended and its nodes are back, all 3 stay idle while this one asks.)"""
    wait_for(lambda: _idle(cluster, "nfs") == len(NFS_NODES), 300, "the nfs partition's nodes idle")
    site = _script(tmp_path, "site.sh", "true", "#SBATCH --ntasks-per-node=1")
    guard = tmp_path / "guard.sh"
    guard.write_text(ranged_script(site.read_text()))
    assert _nodes_sbatch_would_give(cluster, site, "2-3") == 2  # (Slurm's way, which the guard avoids)
    assert _nodes_sbatch_would_give(cluster, guard, "2-3") == 3
    assert _nodes_sbatch_would_give(cluster, _script(tmp_path, "job.sh", "true"), "2-3") == 3


@pytest.mark.nfs_partition
def test_a_job_requeued_on_fewer_nodes_starts_on_them(cluster: dict[str, str], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose bad nodes leave its partition too few nodes for it is requeued with fewer
    (`launch.slurm._fewer_nodes` -> `cluster.requeue(nodes=)`, held while NumNodes and
    ExcNodeList change). The job of the built-in template starts again on those. With
    `--ntasks-per-node=1` (the template's until this test) it kept its 3 tasks and stayed
    PENDING (BadConstraints) for good: that is shown too, so that a template that brings the
    directive back fails here."""
    wait_for(lambda: _idle(cluster, "nfs") == len(NFS_NODES), 300, "the nfs partition's nodes idle")
    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])  # (for hpcshard.slurm.cluster)
    env = {**os.environ, **cluster}

    def submit(script: Path) -> str:
        job = subprocess.run(["sbatch", "--parsable", "--partition", "nfs", str(script)], env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        jobs.append(job)
        return job

    jobs: list[str] = []
    try:
        job = submit(_script(tmp_path, "job.sh", "sleep 300"))
        wait_for(lambda: state(job) == "RUNNING", 120, f"job {job} running")
        assert cluster_requeue(job, exclude=[NFS_NODES[-1]], nodes=2) == ""
        wait_for(lambda: state(job) == "RUNNING" and job_info(job).get("Restarts") == "1", 120,
                 f"job {job} running again")
        nodes = expand_nodelist(job_info(job)["NodeList"])
        assert len(nodes) == 2 and NFS_NODES[-1] not in nodes, nodes
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60)
        wait_for(lambda: _idle(cluster, "nfs") == len(NFS_NODES), 120, "the nfs partition's nodes idle")
        site = submit(_script(tmp_path, "site.sh", "sleep 300", "#SBATCH --ntasks-per-node=1"))
        wait_for(lambda: state(site) == "RUNNING", 120, f"job {site} running")
        assert cluster_requeue(site, exclude=[NFS_NODES[-1]], nodes=2) == ""
        wait_for(lambda: job_info(site).get("Reason") == "BadConstraints", 60, f"job {site} held back")
        assert state(site) == "PENDING"
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60)
