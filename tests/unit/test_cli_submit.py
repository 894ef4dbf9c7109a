"""CLI behaviour that needs no job import: validation, errors, and what it loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcshard.cli import main

JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "charlm.py")


LOADED = """
import json, sys
before = set(sys.modules)  # what the interpreter loads by itself (site .pth files)
from hpcshard.cli import main
try:
    main(sys.argv[1:], prog_name="hpcshard")
except SystemExit:
    pass
ours = sorted(m for m in sys.modules if m.startswith("hpcshard"))
others = sorted({m.split(".")[0] for m in set(sys.modules) - before}
                - set(sys.stdlib_module_names) - {"hpcshard"})
print(json.dumps([ours, others]), file=sys.stderr)
"""


def loaded(*args: str) -> tuple[list[str], list[str]]:
    """(hpcshard modules, third-party packages) a CLI command imports, in a fresh process."""
    import json

    proc = subprocess.run([sys.executable, "-c", LOADED, *args], capture_output=True, text=True)
    ours, others = json.loads(proc.stderr.strip().splitlines()[-1])
    return ours, others


def test_help_imports_click_and_the_group_only() -> None:
    # An allowlist, not a blocklist (click's own test_imports does the same): a new import
    # on the --help path fails here whatever it is.
    assert loaded("--help") == (["hpcshard", "hpcshard.cli"], ["click"])


def test_render_imports_no_torch_and_no_submitit(tmp_path: Path) -> None:
    ours, others = loaded("render", JOB, "--run-dir", str(tmp_path / "r"))
    assert set(others) <= {"click", "jinja2", "markupsafe"}, others
    assert "hpcshard.cli.submit" in ours and not any(m.startswith("hpcshard.runtime") for m in ours)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def assert_one_line_error(code: int, output: str, *needles: str) -> None:
    assert code == 2, output
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 or (lines[0].startswith("Usage:") and lines[-1].startswith("Error:")), output
    for needle in needles:
        assert needle in output


@pytest.mark.parametrize("args,needles", [
    (["--nodes", "0"], ["'--nodes'", "0"]),
    (["--gpus", "-1"], ["'--gpus'", "-1"]),
    (["--backend", "mpi"], ["'mpi'", "local"]),
    (["--spares", "-1"], ["'--spares'", "-1"]),
    (["--min-nodes", "-2"], ["'--min-nodes'", "-2"]),
])
def test_bad_shape_options(args: list[str], needles: list[str], tmp_path: Path) -> None:
    code, out = invoke("submit", *args, JOB, "--run-dir", str(tmp_path / "r"))
    assert code == 2 and all(n in out for n in needles), out
    assert not (tmp_path / "r").exists()


def test_min_nodes_above_nodes_is_one_line_and_nothing_is_made(tmp_path: Path) -> None:
    code, out = invoke("submit", "--nodes", "2", "--min-nodes", "3", JOB, "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(code, out, "--min-nodes 3 is more than --nodes 2", "at most 2")
    assert not (tmp_path / "r").exists()


def test_missing_job_file(tmp_path: Path) -> None:
    code, out = invoke("submit", str(tmp_path / "nope.py"), "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(code, out, "nope.py", "does not exist")
    assert not (tmp_path / "r").exists()


def test_malformed_set(tmp_path: Path) -> None:
    code, out = invoke("submit", JOB, "--run-dir", str(tmp_path / "r"), "--set", "steps")
    assert_one_line_error(code, out, "'steps'", "key=value")


def test_run_dir_not_writable(tmp_path: Path) -> None:
    code, out = invoke("submit", JOB, "--run-dir", "/proc/hpcshard-test/run")
    assert_one_line_error(code, out, "/proc/hpcshard-test/run", "not writable", "--run-dir")


def test_existing_run_is_never_overwritten(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "spec.json").write_text("{}")
    code, out = invoke("submit", JOB, "--run-dir", str(run))
    assert_one_line_error(code, out, str(run), "not empty")
    assert (run / "spec.json").read_text() == "{}"


def test_help_lists_submit() -> None:
    code, out = invoke("--help")
    assert code == 0 and "submit" in out


def test_slurm_backend_without_slurm_is_one_clear_line(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo, sbatch, scontrol here
    code, out = invoke("submit", "--backend", "slurm", JOB, "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(code, out, "no sinfo on PATH", "--backend local")
    assert not (tmp_path / "r").exists()


def test_run_name_and_run_dir_take_the_same_stem() -> None:
    from hpcshard.rundir.spec import default_run_dir, job_stem

    assert job_stem("jobs/charlm.py") == "charlm" and job_stem("pkg.jobs.lm") == "lm"
    assert default_run_dir("pkg.jobs.lm").name.startswith("lm-")


@pytest.mark.parametrize("value,needle", [("nan", "is not a finite number"),
                                          ("inf", "is not a finite number"),
                                          ("-inf", "is not in the range")])
def test_numeric_options_refuse_non_finite_values(value: str, needle: str) -> None:
    code, out = invoke("doctor", "--wait", value)  # a range check alone lets nan through
    assert code == 2 and needle in out, out


def test_memory_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    code, out = invoke("render", JOB, "--run-dir", str(tmp_path / "r"), "--mem", "1.5G")
    assert_one_line_error(code, out, "--mem '1.5G'", "whole number")
    assert not (tmp_path / "r").exists()
