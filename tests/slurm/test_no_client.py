"""A launcher without Slurm's client, as in a container that has none (pyxis/enroot,
Apptainer): its srun'd PATH lacks every Slurm command, while the batch script keeps them.
A notice still ends in a requeue: the launcher writes it for the batch script, whose host
block runs `scontrol requeue` once srun returns (`hpcshard.launch.hostside`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpcshard.rundir import ledger
from tests.conftest import hpcshard, wait_for
from tests.slurm.conftest import restarts, wait_state
from tests.slurm.test_launch_slurm import DONE
from tests.slurm.test_script import COUNTER, log_has

SLURM_COMMANDS = ("sacct", "sacctmgr", "salloc", "sattach", "sbatch", "sbcast", "scancel", "scontrol",
                  "sdiag", "sinfo", "sprio", "squeue", "sreport", "srun", "sshare", "sstat", "strigger")
# Only the launchers run in the "container": a PATH of their own (the job's PATH without
# the directories that hold Slurm's commands, and those directories' other commands).
TEMPLATE = """{% extends "sbatch.j2" %}
{% block container -%}
HPCSHARD_WRAP=(/usr/bin/env PATH={{ launcher_path | q }})
{% endblock %}
"""


def launcher_path(where: Path) -> str:
    """PATH as the job has it, with no Slurm command on it."""
    bare = where / "bin"
    bare.mkdir()
    keep = []
    for entry in os.environ["PATH"].split(os.pathsep):
        folder = Path(entry)
        if not (folder / "scontrol").exists():
            keep.append(entry)
            continue
        for tool in folder.iterdir():  # (/usr/bin: the rest of it, as an image has its own)
            if tool.name not in SLURM_COMMANDS and not (bare / tool.name).exists():
                (bare / tool.name).symlink_to(tool)
    return os.pathsep.join([str(bare), *keep])


def test_a_launcher_without_slurms_client_is_requeued_by_the_batch_script(
        cluster: dict[str, str], tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "templates").mkdir(parents=True)
    (site / "templates" / "noclient.j2").write_text(TEMPLATE)
    (site / "site.toml").write_text(f'''
template_dirs = ["templates"]
[defaults]
template = "noclient.j2"
vars = {{ launcher_path = {json.dumps(launcher_path(tmp_path))} }}
''')
    run = tmp_path / "noclient"
    proc = hpcshard("submit", "--backend", "slurm", "--run-dir", str(run), COUNTER, "--nodes", "2",
                    "--gpus", "1", "--time", "10:00", "--requeue-policy", "requeue", "--grace", "3", "--",
                    "--steps", "24", "--save-every", "4", "--step-seconds", "0.4",
                    env={**cluster, "HPCSHARD_SITE": str(site / "site.toml")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = str(json.loads((run / "spec.json").read_text())["jobs"][-1])
    wait_for(lambda: log_has(run, "rank 0 step 5\n"), 240, "step 5")
    assert hpcshard("preempt", str(run), env=cluster).returncode == 0
    assert wait_state(job, DONE, 300) == "COMPLETED"
    assert restarts(job) == 1
    records = ledger.read(run)
    requeues = [r for r in records if r["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["host"] is True and requeues[0]["job"] == job
    assert [r["reason"] for r in records if r["event"] == "end"] == ["stop", "done"]
    assert not [r for r in records if r["event"] == "gave_up"]
    launcher_logs = "".join(p.read_text() for p in (run / "submitit").glob(f"{job}_*_log.err"))
    assert "no Slurm client (scontrol) on this launcher's PATH" in launcher_logs
    batch_log = (run / "logs" / f"slurm-{job}.err").read_text()
    assert f"hpcshard (batch host): requeue {job}" in batch_log
    assert (run / "launch" / f"host-{job}.0").read_text().splitlines()[-2:] == [f"requeue {job} - -", "end"]
    assert (run / "launch" / f"host-{job}.1").read_text() == ""  # the second run finished: nothing left
