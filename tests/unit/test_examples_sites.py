"""The example sites in examples/sites/ load, and every profile renders to its golden file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcshard import site
from hpcshard.slurm.sbatch import SbatchRequest, render
from tests.unit.test_slurm_sbatch import check_golden

COMMAND = "/usr/bin/python3 -u -m submitit.core._submit /shared/runs/x/submitit"
SITES = Path(__file__).resolve().parents[2] / "examples" / "sites"


def profiles() -> list[tuple[str, str]]:
    out = []
    for folder in sorted(p for p in SITES.iterdir() if (p / "site.toml").is_file()):
        layers = site.load({"HPCSHARD_SITE": str(folder / "site.toml")}, cwd=folder)
        out += [(folder.name, name) for name in sorted(site.profile_names(layers))]
    return out


def test_there_are_three_example_sites_with_profiles() -> None:
    assert {name for name, _ in profiles()} >= {"modules-ib", "pyxis-enroot", "apptainer"}


@pytest.mark.parametrize("site_name,profile", profiles())
def test_example_profile_renders_to_its_golden_file(site_name: str, profile: str,
                                                    tmp_path: Path) -> None:
    # Only the site file: no user file (XDG_CONFIG_HOME is empty), no project file (cwd).
    env = {"HPCSHARD_SITE": str(SITES / site_name / "site.toml"), "XDG_CONFIG_HOME": str(tmp_path)}
    res = site.resolve(site.load(env, cwd=tmp_path), profile)
    req = SbatchRequest.from_settings(res.values, res.template_dirs, job_name="charlm", nodes=2,
                                      gpus=res.values["gpus_per_node"], run_dir=Path("/shared/runs/x"))
    text = render(req, COMMAND, Path("/shared/runs/x/submitit"))
    check_golden(f"sites/{site_name}-{profile}.sbatch", text)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_the_apptainer_site_overrides_only_the_launch_block() -> None:
    text = (SITES / "apptainer" / "templates" / "apptainer.j2").read_text()
    assert '{% extends "sbatch.j2" %}' in text
    assert [line.split()[2] for line in text.splitlines() if line.startswith("{% block")] == ["launch"]
