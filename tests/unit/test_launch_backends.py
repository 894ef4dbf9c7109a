"""The backends behind one interface (`launch.backends`): which one reaches a run, what each
does to it, and that nothing else compares a run's backend name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpcshard.launch import backends
from hpcshard.rundir.spec import RunSpec
from tests.conftest import ROOT


def spec(backend: str, jobs: tuple[str, ...] = ()) -> RunSpec:
    return RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, backend=backend, name="r", jobs=list(jobs))


@pytest.mark.parametrize(("backend", "jobs", "reaching", "job", "in_queue"), [
    ("local", (), backends.LOCAL, None, False),
    ("slurm", ("7", "9"), backends.SLURM, "9", True),
    # submitted with Slurm, no job yet (a sweep's task before its array, an sbatch that
    # refused): only processes of this host could be its
    ("slurm", (), backends.LOCAL, None, True),
])
def test_which_backend_reaches_a_run(backend: str, jobs: tuple[str, ...], reaching: str, job: str | None,
                                     in_queue: bool) -> None:
    run = spec(backend, jobs)
    assert backends.reaching(run).name == reaching and backends.reaching(run).job(run) == job
    assert backends.of(run).in_queue is in_queue


def test_a_spec_of_an_unknown_backend_is_one_line() -> None:
    with pytest.raises(ValueError, match="backend 'pbs' of run 'r' is not one of local, slurm"):
        backends.of(spec("pbs"))


def test_slurm_sends_the_notice_and_cancels_through_scancel(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(cluster, "scancel", lambda *args: asked.append(args))
    run = spec("slurm", ("41", "42"))
    said = backends.reaching(run).notify(run, tmp_path, "SIGUSR2")
    assert asked == [("--signal", "USR2", "42")] and said == f"sent SIGUSR2 to Slurm job 42 ({tmp_path})"
    assert backends.reaching(run).cancel(run, tmp_path) == f"cancelled Slurm job 42 ({tmp_path})"
    assert asked[-1] == ("42",)


def test_the_local_backend_says_when_no_launcher_runs(tmp_path: Path) -> None:
    run = spec("local")
    with pytest.raises(ValueError, match="nothing to preempt"):
        backends.reaching(run).notify(run, tmp_path, "SIGUSR2")
    with pytest.raises(ValueError, match="nothing to cancel"):
        backends.reaching(run).cancel(run, tmp_path)
    assert backends.reaching(run).over(run, tmp_path) is True
    assert backends.reaching(run).state(run) is None and backends.reaching(run).history(run) is None


def test_no_module_but_the_backends_compares_a_backend_name() -> None:
    """`x.backend == "slurm"`, `backend != "local"`, ...: every such decision is a backend's."""
    names = {backends.LOCAL, backends.SLURM}
    found = []
    for path in sorted((ROOT / "hpcshard").rglob("*.py")):
        if path.name == "backends.py" and path.parent.name == "launch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in names for s in sides)
            about = any((isinstance(s, ast.Attribute) and s.attr == "backend")
                        or (isinstance(s, ast.Name) and s.id == "backend") for s in sides)
            if named and about:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
