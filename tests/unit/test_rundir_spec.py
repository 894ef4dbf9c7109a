"""spec.json's parts are typed where they are read: a script as `Script`, the preflight's
findings as `Resolved`, the sbatch request as `SbatchRequest` (read by it alone), and a
spec written by an older hpcshard (a job queued before an upgrade) still loads and is
written back in the same shape."""

from __future__ import annotations

import ast
import json
from dataclasses import asdict, replace
from pathlib import Path

from hpcshard.rundir.spec import Resolved, RunSpec, Script
from hpcshard.slurm.sbatch import SbatchRequest
from tests.conftest import ROOT

SLURM = {**asdict(SbatchRequest(job_name="old", nodes=3, gpus_per_node=2, time="00:30:00", signal="USR1",
                                signal_lead_s=90, secrets=["TOKEN"], env={"A": "1"}, exclude=["n9"])),
         "run_dir": "/runs/old"}
"""A Slurm run's `slurm` as every hpcshard since the first has written it."""

OLD = {
    "job": "/jobs/train.py", "sets": {}, "nodes": 2, "gpus": 2, "spares": 1, "min_nodes": 0,
    "backend": "slurm", "name": "old", "max_requeues": 10, "max_restarts": 3, "no_progress_restarts": 2,
    "requeue_policy": "requeue", "profile": "", "bad_nodes": "drain", "health_check": "", "run_group": "",
    "script": {"kind": "file", "target": "/jobs/train.py", "args": ["--lr", "3"], "cwd": "/home/u",
               "signal": "USR1", "grace": 30},
    "jobs": ["41", "42"], "slurm": SLURM,
    "resolved": {},
    "created": 1700000000.0,
}


def test_an_old_script_run_loads_typed_and_is_written_back_in_its_shape(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(json.dumps(OLD))
    spec = RunSpec.read(tmp_path)
    assert spec.script == Script(kind="file", target="/jobs/train.py", args=("--lr", "3"), cwd="/home/u",
                                 signal="USR1", grace=30)
    assert spec.grace_s == 30.0 and spec.coord_key == ""  # (a spec from before the store)
    assert spec.script.command == "script /jobs/train.py --lr 3"
    assert spec.resolved == Resolved() and spec.resolved.steps is None
    spec.write(tmp_path)
    assert json.loads((tmp_path / "spec.json").read_text()) == {**OLD, "coord_key": ""}


def test_a_job_writes_an_empty_script_and_its_resolved_config(tmp_path: Path) -> None:
    resolved = {"config": {"steps": 12, "lr": 0.01}, "sharding": "hybrid", "replicate": 2, "shard": 2,
                "block": "Block", "blocks": 4,
                "params": 1000, "micro_batch": 8, "accumulation": 2, "train_tokens": 10**6}
    spec = RunSpec(job="charlm", sets={}, nodes=1, gpus=1, backend="local", name="x",
                   resolved=Resolved.of({**resolved, "a_newer_key": 1}))
    assert spec.script is None and spec.grace_s == 0.0 and spec.resolved.steps == 12
    spec.write(tmp_path)
    raw = json.loads((tmp_path / "spec.json").read_text())
    assert raw["script"] == {} and raw["resolved"] == resolved
    assert RunSpec.read(tmp_path) == spec


def test_the_recorded_sbatch_request_is_read_whole_and_only_by_its_class() -> None:
    old = SbatchRequest.recorded(SLURM)
    assert old == SbatchRequest(job_name="old", nodes=3, gpus_per_node=2, time="00:30:00", signal="USR1",
                                signal_lead_s=90, secrets=["TOKEN"], env={"A": "1"}, exclude=["n9"],
                                run_dir=Path("/runs/old"))
    assert SbatchRequest.recorded({}) is None  # the local backend records none
    assert SbatchRequest.recorded({**SLURM, "a_newer_key": 1}) == old
    assert old.record() == SLURM
    assert SbatchRequest.recorded(replace(old, array="0-3%2").record()) == replace(old, array="0-3%2")


def test_no_code_reads_a_spec_part_by_string_key() -> None:
    """`spec.slurm` is SbatchRequest's alone (`recorded`), `spec.script` and `spec.resolved`
    are read by attribute: no `.slurm[...]`, `.slurm.get(...)`, `.script[...]`,
    `.resolved.get(...)` anywhere in hpcshard."""
    parts = {"slurm", "script", "resolved"}
    found = []
    for path in sorted((ROOT / "hpcshard").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), name)):
            inner = (node.value if isinstance(node, ast.Subscript)
                     else node.value if isinstance(node, ast.Attribute) and node.attr == "get" else None)
            if isinstance(inner, ast.Attribute) and inner.attr in parts:
                found.append(f"{name}:{inner.lineno}")
    assert found == [], "read spec.json's parts by their types (Script, Resolved, SbatchRequest.recorded)"
