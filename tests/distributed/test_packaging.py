"""hpcshard installed from its wheel, as a cluster's Python would have it: no source tree
beside it. The built-in sbatch template must come with it, and `render` must work."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from tests.conftest import ROOT, quiet_env


def test_a_wheel_install_renders_with_its_built_in_template(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would leave build/ behind (and reuse it). Without
    # build isolation: setuptools (>= 70.1 builds wheels itself) is in the test extra.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "*_cache", "__pycache__", "build", "*.egg-info", "runs", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("hpcshard-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {f"hpcshard/templates/{p.name}" for p in (ROOT / "templates").iterdir()}
    assert templates and templates <= names, sorted(names)

    # A venv that sees this machine's torch, submitit, jinja2 and click, with hpcshard from
    # the wheel only (its own site-packages come before the system's editable install).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "-q", str(wheel)], check=True, capture_output=True)
    where = subprocess.run([str(python), "-c", "import hpcshard; print(hpcshard.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert str(env_dir) in where and str(ROOT) not in where

    job = tmp_path / "job.py"
    job.write_text((ROOT / "jobs" / "charlm.py").read_text())
    proc = subprocess.run([str(env_dir / "bin" / "hpcshard"), "render", "--nodes", "2", "--gpus", "4",
                           str(job), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=tmp_path, env=quiet_env())
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --gpus-per-node=4" in proc.stdout
