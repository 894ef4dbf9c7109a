"""`hpcshard ckpt` on a plain install: what it says when an optional package is missing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import main
from tests.unit.test_rundir_store import SPEC, make


def test_safetensors_export_without_the_package_names_the_extra(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "spec.json").write_text(json.dumps(SPEC))
    make(tmp_path / "checkpoints", 10)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "safetensors" else real(name, *a))
    out = tmp_path / "m.safetensors"
    result = CliRunner().invoke(main, ["ckpt", "export", str(tmp_path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "needs the safetensors package" in result.output and "hpcshard[hf]" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
