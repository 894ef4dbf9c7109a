"""The README's two commands are what a fresh machine runs; CI must run the same test line."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_starts_with_demo_and_test_commands() -> None:
    demo, test = commands()
    assert demo.startswith("pip install torch==2.13.0") and "hpcshard submit" in demo
    assert test.startswith("pip install torch==2.13.0") and "pytest" in test


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands()[1] in ci


def test_every_file_the_readme_links_to_exists() -> None:
    """The README routes to the docs site's pages (mkdocs checks the links between pages,
    not the README's)."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 10
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_readme_stays_a_short_page_that_routes_to_the_docs() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
