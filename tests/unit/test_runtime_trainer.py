"""The Trainer is built whole: its collaborators (hooks, the run's past rollbacks) are given
at construction, every attribute is born in `__init__`, and no code outside
runtime/train.py sets one afterwards (the runtime used to wire its hooks in by mutation)."""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpcshard.config import build_config
from hpcshard.runtime.device import DistEnv
from hpcshard.runtime.job import load_job
from hpcshard.runtime.train import Hooks, Past, Trainer
from tests.conftest import ROOT

TRAIN = ROOT / "hpcshard" / "runtime" / "train.py"
SEARCHED = ("hpcshard", "bench", "examples", "tests")
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _mentions_trainer(annotation: ast.expr | None) -> bool:
    """`Trainer`, `Trainer | None`, `"Trainer"`, `train.Trainer`..."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Trainer":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Trainer":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "Trainer" in node.value:
            try:
                return _mentions_trainer(ast.parse(node.value, mode="eval").body)
            except SyntaxError:  # a string that is not an annotation (Literal["HF Trainer"])
                continue
    return False


def _imports_ours(tree: ast.Module) -> bool:
    """hpcshard's Trainer, not another (examples/hf_trainer's is Hugging Face's)."""
    return any(isinstance(n, ast.ImportFrom) and n.module == "hpcshard.runtime.train"
               and any(a.name == "Trainer" for a in n.names) for n in ast.walk(tree))


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of one scope: nested functions and classes are scopes of their own."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (*FUNCTIONS, ast.ClassDef)):
            yield from _own_nodes(child)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in _flat(target)]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.NamedExpr):
        return [node.target]
    return []


def _flat(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for e in target.elts for t in _flat(e)]
    return [target.value] if isinstance(target, ast.Starred) else [target]


def _is_trainer(value: ast.expr | None, makers: set[str]) -> bool:
    """A call that builds or returns a Trainer: `Trainer(...)`, or a function of the module
    annotated `-> Trainer`."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name == "Trainer" or name in makers


def _trainers_bound(scope: ast.AST, makers: set[str]) -> set[str]:
    """Names this scope binds to a Trainer: annotated parameters and variables, and names
    assigned a Trainer's construction."""
    bound: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = scope.args
        bound |= {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
                  if _mentions_trainer(a.annotation)}
    for node in _own_nodes(scope):
        annotated = isinstance(node, ast.AnnAssign) and _mentions_trainer(node.annotation)
        built = isinstance(node, (ast.Assign, ast.NamedExpr, ast.AnnAssign)) and \
            _is_trainer(node.value, makers)
        if annotated or built:
            bound |= {t.id for t in _targets(node) if isinstance(t, ast.Name)}
    return bound


def _sets(scope: ast.AST, bound: set[str]) -> Iterator[tuple[int, str]]:
    """(line, "name.attr") for each attribute this scope sets on a name bound to a Trainer:
    assigned, augmented, or through setattr."""
    for node in _own_nodes(scope):
        if not isinstance(node, (ast.stmt, ast.expr)):
            continue
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in bound:
                yield node.lineno, f"{t.value.id}.{t.attr}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in bound:
            yield node.lineno, f"setattr({node.args[0].id}, ...)"


def trainer_attributes_set(source: str) -> list[tuple[int, str]]:
    """Every place this module's code sets an attribute of one of hpcshard's Trainers."""
    tree = ast.parse(source)
    if not _imports_ours(tree):
        return []
    makers = {n.name for n in ast.walk(tree)
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _mentions_trainer(n.returns)}
    found: list[tuple[int, str]] = []

    def visit(scope: ast.AST, inherited: set[str]) -> None:
        bound = inherited | _trainers_bound(scope, makers)
        found.extend(_sets(scope, bound))
        for node in _own_nodes(scope):
            if isinstance(node, FUNCTIONS):
                visit(node, bound - _parameters(node))
            elif isinstance(node, ast.ClassDef):
                visit(node, set())
    visit(tree, set())
    return sorted(found)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """What a nested function's own parameters shadow of the enclosing scope's names."""
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


WIRED_BY_MUTATION = '''
from hpcshard.runtime.train import Trainer

def main(job, cfg, env, run_dir):
    trainer = Trainer(job, cfg, env, run_dir)
    trainer.report = print
    _rollbacks(run_dir, trainer)
    def later():
        trainer.startup = {}
    t = build()
    t.step += 1
    t.optimizer.zero_grad = None  # the optimizer's, not the Trainer's
    other = object()
    other.x = 1

def _rollbacks(run_dir, trainer: Trainer | None) -> None:
    trainer.rollbacks, trainer.batches.skip = 3, set()
    setattr(trainer, "record", print)

def build() -> "Trainer":
    return Trainer(None, None, None, None)

def unrelated(trainer):
    trainer.report = print  # not annotated, not built here: not known to be one
'''


def test_the_check_finds_wiring_by_mutation() -> None:
    """The check below is not vacuous: the old runtime's wiring, and its variants, are found."""
    assert [what for _, what in trainer_attributes_set(WIRED_BY_MUTATION)] == [
        "trainer.report", "trainer.startup", "t.step", "trainer.rollbacks", "setattr(trainer, ...)"]
    hugging_face = WIRED_BY_MUTATION.replace("hpcshard.runtime.train", "transformers")
    assert trainer_attributes_set(hugging_face) == []


def test_no_code_outside_train_sets_a_trainers_attribute() -> None:
    """Collaborators go in through the constructor (`Hooks`, `Past`), run-time inputs
    through `run`; nothing reaches in afterwards."""
    found = {f"{path.relative_to(ROOT)}:{line}: {what}"
             for top in SEARCHED for path in sorted((ROOT / top).rglob("*.py")) if path != TRAIN
             for line, what in trainer_attributes_set(path.read_text(encoding="utf-8"))}
    assert not found, ("set from outside the Trainer (give it to the constructor):\n"
                       + "\n".join(sorted(found)))


def _trainer_class() -> ast.ClassDef:
    tree = ast.parse(TRAIN.read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def _self_sets(function: ast.AST) -> set[str]:
    return {t.attr for node in ast.walk(function) for t in _targets(node)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def born_in_init() -> set[str]:
    """The attributes Trainer.__init__ assigns."""
    init = next(n for n in _trainer_class().body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return _self_sets(init)


def test_every_attribute_is_born_in_init() -> None:
    """Other methods only reassign what `__init__` made (a method that creates an attribute
    as a side effect hides what a Trainer holds, and when)."""
    trainer = _trainer_class()
    methods = [n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
    born = born_in_init()
    later = {f"{m.name}: self.{name}" for m in methods for name in _self_sets(m) - born}
    assert not later, "attributes born outside __init__:\n" + "\n".join(sorted(later))
    assert not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                   for n in ast.walk(trainer))


@pytest.fixture
def small_trainer(world_of_one: None) -> Iterator[tuple[Trainer, list[tuple[str, int]]]]:
    """charlm, tiny, on one rank, one earlier rollback behind it; and what it tells its
    report hook."""
    job = load_job(str(ROOT / "jobs" / "charlm.py"))
    cfg = build_config(job.config, {"dim": "16", "n_heads": "2", "n_layers": "2", "seq_len": "8",
                                    "batch_size": "2", "steps": "2", "log_every": "1",
                                    "data": str(Path(sysconfig.get_paths()["stdlib"]) / "json")})
    env = DistEnv(rank=0, world=1, local_rank=0, per_node=1, device=torch.device("cpu"), backend="gloo")
    reported: list[tuple[str, int]] = []
    hooks = Hooks(report=lambda phase, step: reported.append((phase, step)))
    past = Past(rollbacks=1, skipped=frozenset({(0, 0)}))
    yield Trainer(job, cfg, env, None, hooks=hooks, past=past), reported


def test_a_built_trainer_holds_what_init_made_and_keeps_to_it(
        small_trainer: tuple[Trainer, list[tuple[str, int]]]) -> None:
    """The same at run time: after construction, and after training, a Trainer's attributes
    are exactly `__init__`'s; its hooks and past are the ones given."""
    trainer, reported = small_trainer
    assert set(vars(trainer)) == born_in_init()
    assert trainer.rollbacks == 1 and trainer.batches.skip == {(0, 0)}
    assert trainer.batches.upcoming() != (0, 0)
    assert trainer.restore("never") is None  # the load phase is on the board for the watchdog
    summary = trainer.run(startup={"entry": 1.0})
    assert summary.reason == "done" and summary.step == 2
    assert set(vars(trainer)) == born_in_init()
    assert reported == [("load", 0), ("step", 0), ("step", 1), ("eval", 2)]


def test_the_runs_rollbacks_come_back_from_the_ledger_across_restarts(tmp_path: Path) -> None:
    """`main._past`: every rollback the ledger holds (any attempt's) counts, and its batches
    stay skipped; rank 0's recorder writes there, another rank's nowhere."""
    from hpcshard.rundir import events, ledger
    from hpcshard.runtime import main

    assert main._past(tmp_path) == Past(rollbacks=0, skipped=frozenset())
    main._recorder(tmp_path, True)(events.Rollback(attempt=0, cycle=0, step=7, to=5, skipped=[[0, 6]],
                                                   rollback=1, of=3))
    main._recorder(tmp_path, False)(events.Rollback(attempt=0, cycle=0, step=9, to=5, skipped=[[0, 8]],
                                                    rollback=2, of=3))
    ledger.append(tmp_path, events.Rollback(attempt=1, cycle=0, step=12, to=10, skipped=[[1, 2], [1, 3]],
                                            rollback=2, of=3))
    assert main._past(tmp_path) == Past(rollbacks=2, skipped=frozenset({(0, 6), (1, 2), (1, 3)}))
