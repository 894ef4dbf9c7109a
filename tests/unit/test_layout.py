"""The package layout: where code lives by where it runs (../shared/DESIGN.md), no import
cycles, the names users and queued jobs rely on, and what each layer may load. The
layering itself is import-linter's (pyproject, `lint-imports`)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import subprocess
import sys

import grimp
import pytest

from tests.conftest import ROOT

FLAT = {"__init__.py", "__main__.py", "config.py", "sections.py", "entry.py", "script.py", "preemption.py",
        "errors.py"}
"""The only modules at the top of the package: the user-facing paths that must not move
(`hpcshard.errors.UserError` is also what a job's own checks raise to stop with exit 2;
`hpcshard.sections` is the configuration's typed sections, read by a job's own components
as by hpcshard's)."""


def test_nothing_sits_flat_but_the_user_facing_modules() -> None:
    flat = {p.name for p in (ROOT / "hpcshard").glob("*.py")}
    assert flat == FLAT


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_between_modules() -> None:
    # Every import counts, the ones inside functions too: a lazy import that closes a
    # cycle is still a cycle, only hidden from the interpreter until it bites.
    graph = grimp.build_graph("hpcshard")
    assert _cycles(graph) == []


@pytest.mark.parametrize("name", [
    "hpcshard.cli:main", "hpcshard.entry:main", "hpcshard.entry:rank",
    "hpcshard.launch.node:main", "hpcshard.launch.warm:main", "hpcshard.launch.smoke:node_main",
    "hpcshard.launch.slurm:node_main", "hpcshard.runtime.preflight:preflight",
    "hpcshard.config:TrainConfig", "hpcshard.runtime:Job", "hpcshard.runtime:load_checkpoint",
    "hpcshard.runtime:save_checkpoint", "hpcshard.runtime:init_distributed",
    "hpcshard.runtime:build_mesh", "hpcshard.runtime:shard_model", "hpcshard.runtime:materialize",
    "hpcshard.runtime:ShardPlan", "hpcshard.runtime.checkpoint:save_checkpoint",
    "hpcshard.runtime.checkpoint:load_checkpoint", "hpcshard.preemption:requested",
    "hpcshard.preemption:REQUEUE", "hpcshard.runtime.data:load_splits",
    "hpcshard.runtime.blocks:canonical_name", "hpcshard.runtime.train:clip_grad_norm_",
])
def test_names_users_and_launchers_rely_on_still_resolve(name: str) -> None:
    module, attr = name.split(":")
    assert getattr(importlib.import_module(module), attr) is not None


def test_a_job_queued_before_the_move_still_unpickles_and_binds() -> None:
    # What submitit wrote for a job submitted by the release before this layout (made with
    # that tree: DelayedSubmission(node_main, run_dir, gpus, attempt, max_requeues, resume,
    # policy)). A queued or chained job unpickles it after an upgrade.
    from hpcshard.launch.slurm import node_main

    with (ROOT / "tests" / "unit" / "golden" / "submitted-before-layout.pkl").open("rb") as f:
        delayed = pickle.load(f)
    assert delayed.function is node_main
    inspect.signature(node_main).bind(*delayed.args, **delayed.kwargs)


@pytest.mark.parametrize("package", ["hpcshard.launch", "hpcshard.rundir", "hpcshard.slurm",
                                     "hpcshard.site"])
def test_launchers_and_the_login_node_load_no_torch_at_import(package: str) -> None:
    code = ("import importlib, pkgutil, sys, " + package + " as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module(p.__name__ + '.' + m.name)\n"
            "print(sorted(m for m in ('torch', 'numpy', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
