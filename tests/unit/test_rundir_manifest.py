"""A manifest.json that parses but is not one hpcshard wrote (a list, `null` files, a size in
a string): every reader takes its checkpoint for a corrupt one, as it does a manifest that
does not parse, and goes on with the one before. Before, `ckpt list` and `status` ended in
a traceback, and so did each node's health check at every attempt and rank 0's choice of
the checkpoint to resume (while the other ranks waited for it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from hpcshard.launch import health
from hpcshard.rundir import manifest, store
from tests.unit.test_rundir_store import SPEC, make

pytestmark = pytest.mark.unit

Shape = Callable[[dict[str, Any]], Any]


def _with(**changes: Any) -> Shape:
    return lambda m: {**m, **changes}


def _without(key: str) -> Shape:
    return lambda m: {k: v for k, v in m.items() if k != key}


def _sizes(size: Any) -> Shape:
    return lambda m: {**m, "files": {name: size for name in m["files"]}}


WRONG: dict[str, Shape] = {
    "a list": lambda m: [m],
    "null": lambda m: None,
    "a string": lambda m: "step-00000004",
    "a number": lambda m: 4,
    "null files": _with(files=None),
    "files as a list": lambda m: {**m, "files": list(m["files"])},
    "files as a string": _with(files=".metadata"),
    "sizes in strings": lambda m: {**m, "files": {k: str(v) for k, v in m["files"].items()}},
    "null sizes": _sizes(None),
    "boolean sizes": _sizes(True),
    "negative sizes": _sizes(-1),
    "fractional sizes": _sizes(10.5),
    "no files": _without("files"),
    "no step": _without("step"),
    "a step in a string": _with(step="4"),
    "bytes in a string": _with(bytes="310"),
    "null bytes": _with(bytes=None),
    "a time in words": _with(time="yesterday"),
    "a time of NaN": _with(time=float("nan")),
    "an infinite time": _with(time=float("inf")),
    "save seconds in a string": _with(save_seconds="3.2"),
    "world in words": _with(world="four"),
    "world as an object": _with(world={}),
    "a world of none": _with(world=0),
    "mesh as a string": _with(mesh="2x2"),
    "mesh of strings": _with(mesh=["2", "2"]),
    "config as a list": _with(config=[]),
    "data as a list": _with(data=[]),
    "data sources of strings": _with(data={"sources": ["corpus"]}),
    "reason as an object": _with(reason={"why": "periodic"}),
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """RUN_DIR/checkpoints of a run (its spec.json: `ckpt list` and `status` read it)."""
    (tmp_path / "run" / store.CHECKPOINTS).mkdir(parents=True, mode=0o750)
    (tmp_path / "run" / "spec.json").write_text(json.dumps(SPEC))
    return tmp_path / "run" / store.CHECKPOINTS


def broken(root: Path, shape: Shape) -> Path:
    """Checkpoints 2 (210 bytes) and 4 (410 bytes: a reader that took it would size the
    next by it) of a run, step 4's manifest replaced by `shape` of itself."""
    make(root, 2)
    path = make(root, 4, files={".metadata": 10, "__0_0.distcp": 400})
    good = json.loads((path / store.MANIFEST).read_text())
    (path / store.MANIFEST).write_text(json.dumps(shape(good)))
    return path


@pytest.mark.parametrize("shape", WRONG.values(), ids=WRONG.keys())
def test_the_store_takes_a_manifest_of_the_wrong_shape_for_a_corrupt_one(root: Path, shape: Shape) -> None:
    path = broken(root, shape)
    ckpt = store.inspect(path)
    assert not ckpt.committed and ckpt.problem.startswith("corrupt manifest (")
    assert ckpt.manifest == {} and not ckpt.unreadable  # no reader gets its content
    chosen, skipped = store.select(root, "auto")
    assert chosen is not None and chosen.step == 2 and [c.step for c in skipped] == [4]
    assert [c.step for c in store.committed(root)] == [2]
    assert store.select(root, "2")[0] is not None  # a step asked for by number is still found


@pytest.mark.parametrize("shape", WRONG.values(), ids=WRONG.keys())
def test_ckpt_list_and_status_show_it_as_corrupt(root: Path, shape: Shape) -> None:
    broken(root, shape)
    listed = CliRunner().invoke(main, ["ckpt", "list", str(root.parent)])
    assert listed.exit_code == 0, listed.output
    row = listed.output.splitlines()[2]
    assert row.split()[:2] == ["4", "invalid"] and "corrupt manifest (" in row
    status = CliRunner().invoke(main, ["status", str(root.parent)])
    assert status.exit_code == 0, status.output
    assert "checkpoint: step 2 (0.0 MB" in status.output


@pytest.mark.parametrize("shape", WRONG.values(), ids=WRONG.keys())
def test_the_health_check_sizes_the_next_checkpoint_by_the_last_good_one(root: Path, shape: Shape) -> None:
    broken(root, shape)
    assert health.next_checkpoint_bytes(root.parent) == int(210 * health.ROOM_FACTOR)


def test_each_wrong_shape_is_named() -> None:
    good = {"step": 4, "files": {".metadata": 10}, "world": 4, "mesh": [2, 2], "time": 1.5,
            "extra": ["any", "json"], "newer_key": None}
    assert manifest.problem(good) == ""
    said = {name: manifest.problem(shape(good)) for name, shape in WRONG.items()}
    assert said["a list"] == "a list, not an object"
    assert said["null files"] == "'files' is null, not an object of file names and sizes"
    assert said["sizes in strings"] == "'files' gives '.metadata' the size '10', not a count of bytes"
    assert said["no step"] == "no 'step'"
    assert said["world in words"] == "'world' is 'four', not a count of ranks"
    assert all(said.values()), [name for name, why in said.items() if not why]
