"""The backends behind one interface (`launch.backends`): which one reaches a run, what each
does to it, and that nothing else compares a run's backend name."""

from __future__ import annotations

import ast
from collections.abc import Callable
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


def test_a_spec_of_a_backend_neither_knows_is_reached_as_a_local_run(tmp_path: Path) -> None:
    """A spec.json written by something else: commands treat it as the local backend did
    before (no scheduler to ask)."""
    run = spec("pbs", ("5",))
    assert backends.of(run).name == backends.reaching(run).name == backends.LOCAL
    assert backends.reaching(run).over(run, tmp_path) is True


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


def test_a_local_run_between_two_attempts_has_not_ended(tmp_path: Path) -> None:
    """No launcher runs while the command that owns the run requeues it: over, not ended
    (`logs -f` waits for the next attempt); once the owner is gone, ended."""
    from hpcshard.rundir import lease

    run = spec("local")
    me = lease.take(tmp_path, lease.Owner.of_process("a local run"), lambda job: None)
    assert backends.reaching(run).over(run, tmp_path) is True
    assert backends.reaching(run).ended(run, tmp_path) is False
    lease.release(tmp_path, me)
    assert backends.reaching(run).ended(run, tmp_path) is True


def names(node: ast.AST, words: frozenset[str], constants: tuple[str, ...] = ()) -> bool:
    """One of `words` as a string, or one of `constants` by its name, alone or in a tuple,
    set or list."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in words
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in constants
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return any(names(e, words, constants) for e in node.elts)
    return False


def comparisons(source: str, named: Callable[[ast.AST], bool]) -> list[int]:
    """Lines comparing anything with what `named` finds: `==`, `!=`, `in`, a `match` case,
    a `.startswith`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(named, [node.left, *node.comparators])):
            lines.append(node.lineno)
        elif isinstance(node, ast.match_case) and any(
                named(n) for n in ast.walk(node.pattern) if isinstance(n, ast.expr)):
            lines.append(node.pattern.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and any(map(named, node.args))):
            lines.append(node.lineno)
    return lines


def found_outside(owner: str, lines_of: Callable[[str], list[int]]) -> list[str]:
    """`path:line` of every line `lines_of` finds in hpcshard's modules but `owner`'s."""
    found = []
    for path in sorted((ROOT / "hpcshard").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() != owner:
            found += [f"{path.relative_to(ROOT)}:{n}" for n in lines_of(path.read_text())]
    return found


def comparisons_of_backend_names(source: str) -> list[int]:
    return comparisons(source, lambda node: names(node, frozenset((backends.LOCAL, backends.SLURM)),
                                                  ("LOCAL", "SLURM")))


@pytest.mark.parametrize("line", [
    'x = spec.backend == "slurm"', 'x = "local" != backend', 'x = kind in ("slurm",)',
    'x = k in {"local"}', "x = spec.backend == backends.SLURM", 'x = d.get("backend") == "slurm"',
    'x = (s.backend or "") == "local"', 'x = s.backend.lower().startswith("slurm")',
    'match s.backend:\n    case "slurm":\n        pass',
])
def test_the_source_walk_finds_a_comparison_in_any_form(line: str) -> None:
    assert comparisons_of_backend_names(line)


def test_no_module_but_the_backends_compares_a_backend_name() -> None:
    """Every decision by a run's backend is a backend's (`launch.backends`)."""
    found = found_outside("hpcshard/launch/backends.py", comparisons_of_backend_names)
    assert not found, found
