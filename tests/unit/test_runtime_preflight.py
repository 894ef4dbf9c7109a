"""The preflight the CLI runs before anything starts, called in-process."""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import pytest

from hpcshard.rundir.spec import Resolved
from hpcshard.runtime.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"data": str(Path(sysconfig.get_paths()["stdlib"]) / "json")}


def check(sets: dict[str, str], job: str = str(ROOT / "jobs" / "charlm.py"), nodes: int = 2,
          gpus: int = 2) -> dict:
    return preflight({"job": job, "sets": {**SMALL, **sets}, "nodes": nodes, "gpus": gpus})


def test_resolves_config_block_and_shape() -> None:
    res = check({"batch_size": "8"})
    assert res["sharding"] == "hybrid" and res["block"] == "Block" and res["blocks"] == 4
    assert res["config"]["batch_size"] == 8 and res["micro_batch"] == 2
    assert 800_000 < res["params"] < 900_000
    # What it finds is what spec.json's typed part keeps, key for key (`Resolved`).
    assert set(res) == {f.name for f in dataclasses.fields(Resolved)} and Resolved.of(res).steps == 300


@pytest.mark.parametrize("sets,needle", [
    ({"block": "Decoder"}, "block='Decoder' is not a class"),
    ({"sharding": "zero3"}, "sharding='zero3'"),
    ({"precision": "int8"}, "precision='int8'"),
    ({"n_heads": "3"}, "n_heads=3 does not divide dim=128"),
    ({"batch_size": "6"}, "batch_size=6 does not divide over 4 ranks"),
    ({"data": "/nonexistent/corpus"}, "'/nonexistent/corpus' does not exist"),
    ({"tp": "4"}, "tp=4 does not divide the 2 ranks of a node; use one of 1, 2"),
    ({"tp": "2", "n_heads": "1"}, "tp=2 does not divide n_heads=1"),
    ({"tp": "2", "seq_len": "33"}, "tp=2 does not divide seq_len=33"),
    ({"tp": "0"}, "tp"),
    ({"tp": "2", "batch_size": "3"}, "batch_size=3 does not divide over 2 ranks"),
    ({"reshard_after_forward": "2"}, "reshard_after_forward=2 must divide the shard group of 2 ranks "
                                     "and be smaller; use true or false on this shape"),
    ({"reshard_after_forward": "maybe"}, "reshard_after_forward='maybe' is not valid"),
    ({"reduce_dtype": "int8"}, "reduce_dtype='int8' is not valid"),
    ({"output_dtype": "fp8"}, "output_dtype='fp8' is not valid"),
    ({"prefetch": "-1"}, "prefetch"),
    ({"block": "Block,Layer"}, "block='Layer' is not a class"),
])
def test_user_errors(sets: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        check(sets)


def test_job_without_job_object(tmp_path: Path) -> None:
    bad = tmp_path / "notajob.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no job"):
        check({}, job=str(bad))


def test_unimportable_module_name() -> None:
    with pytest.raises(ValueError, match="neither a file nor an importable module"):
        check({}, job="no_such_pkg.jobs.lm")


def test_tensor_parallel_needs_the_jobs_plan(tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text((ROOT / "jobs" / "charlm.py").read_text().replace(",\n          tp_plan=tp_plan)", ")"))
    assert "tp_plan=tp_plan" not in plain.read_text()
    with pytest.raises(ValueError, match=r"tp=2: job .*plain.py has no tp_plan"):
        check({"tp": "2"}, job=str(plain))
    assert check({"tp": "2", "batch_size": "8"})["micro_batch"] == 4  # over 2 data parallel groups
