"""The ledger's typed events (rundir.events): each kind written through `ledger.append` gives
the JSON its readers have always read (the dicts below are the shapes the writers built by
hand before), nothing but a typed event gets into the ledger, and status and goodput read a
ledger written through the types as they read the old one."""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch.policy import Action, Decision
from hpcshard.launch.supervise import _fault
from hpcshard.rundir import events, goodput, ledger, status
from hpcshard.rundir.events import UNSET, EndReason
from hpcshard.rundir.spec import Resolved, RunSpec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

COLLECTIVE = {"group": "0", "desc": "default_pg", "seq": 9, "op": "gloo:all_reduce", "sizes": [[4]],
              "inside": [0], "missing": [1]}
FAULT = events.Fault(
    attempt=0, cycle=0, cause="rank 1 died (its process is gone)", declared=1005.5,
    culprit={"rank": 1, "node": 0, "host": "h0", "step": 5}, reached=5, action="restart", code=0,
    reason="restart 1 of 3", end="", active=[0, 1], spares=[], bad=[], replaced={}, lost=[], committed=4,
    host="h0", port=29500, restart=True, lost_steps=1, detect_s=0.2,
    collectives=[COLLECTIVE])

# One run, in the ledger's order: (time, the typed event, the line its writer built before).
# Each writer's variant of a kind is here (the runtime's end and a script launcher's, ...).
CASES: list[tuple[float, events.Event, dict[str, Any]]] = [
    (1000, events.Start(attempt=0, cycle=0, world=4, nodes=2, host="h0", slurm_job="77", slurm_run=0,
                        resumed_step=None, resumed_from=None, skipped=[]),  # runtime.main
     {"event": "start", "attempt": 0, "cycle": 0, "world": 4, "nodes": 2, "host": "h0", "slurm_job": "77",
      "slurm_run": 0, "resumed_step": None, "resumed_from": None, "skipped": []}),
    (1001, events.Watchdog(attempt=0, cycle=0, step_limit=5.0, median_step=0.25, factor=3.0, floor_s=5.0,
                           phase_s=1800.0, join_s=120.0),  # launch.supervise
     {"event": "watchdog", "attempt": 0, "cycle": 0, "step_limit": 5.0, "median_step": 0.25, "factor": 3.0,
      "floor_s": 5.0, "phase_s": 1800.0, "join_s": 120.0}),
    (1002, events.Links(attempt=0, cycle=0, mb=64.0, floor_gbps=1.0,
                        slowest={"from": 1, "to": 0, "gbps": 0.5}, links=[[0, 1, 2.0], [1, 0, 0.5]]),
     {"event": "links", "attempt": 0, "cycle": 0, "mb": 64.0, "floor_gbps": 1.0,
      "slowest": {"from": 1, "to": 0, "gbps": 0.5}, "links": [[0, 1, 2.0], [1, 0, 0.5]]}),
    (1002.5, events.Straggler(attempt=0, cycle=0, kind="link", step=0, rank=2, host="", ratio=2.0, gbps=0.5,
                              floor_gbps=1.0, policy="bad_node"),  # runtime.main
     {"event": "straggler", "attempt": 0, "cycle": 0, "kind": "link", "step": 0, "rank": 2, "host": "",
      "ratio": 2.0, "gbps": 0.5, "floor_gbps": 1.0, "policy": "bad_node"}),
    (1003, events.Straggler(attempt=0, cycle=0, step=3, rank=3, host="h1", ratio=1.8,
                            policy="warn"),  # runtime.train
     {"event": "straggler", "attempt": 0, "cycle": 0, "step": 3, "rank": 3, "host": "h1", "ratio": 1.8,
      "policy": "warn"}),
    (1005, events.RankFailed(attempt=0, cycle=0, rank=1, host="h0", step=5, error="ZeroDivisionError",
                             message="division by zero", log="logs/rank-1.log"),  # runtime.main
     {"event": "rank_failed", "attempt": 0, "cycle": 0, "rank": 1, "host": "h0", "step": 5,
      "error": "ZeroDivisionError", "message": "division by zero", "log": "logs/rank-1.log"}),
    (1005.2, events.RankFailed(attempt=0, cycle=0, rank=0, host="h0", code=1, step=None, error="exit 1",
                               message="", log="logs/rank-0.log", after_notice=False),  # script
     {"event": "rank_failed", "attempt": 0, "cycle": 0, "rank": 0, "host": "h0", "code": 1, "step": None,
      "error": "exit 1", "message": "", "log": "logs/rank-0.log", "after_notice": False}),
    (1006, FAULT,  # launch.supervise
     {"event": "fault", "attempt": 0, "cycle": 0, "cause": "rank 1 died (its process is gone)",
      "declared": 1005.5, "culprit": {"rank": 1, "node": 0, "host": "h0", "step": 5}, "reached": 5,
      "action": "restart", "code": 0, "reason": "restart 1 of 3", "end": "", "active": [0, 1], "spares": [],
      "bad": [], "replaced": {}, "lost": [], "committed": 4, "host": "h0", "port": 29500, "coord_port": 0,
      "coord_node": 0, "rdzv_node": 0,
      "restart": True,
      "lost_steps": 1, "detect_s": 0.2, "collectives": [COLLECTIVE]}),
    (1007, events.BadNode(attempt=0, cycle=0, node=1, host="h1", slurm_node="n2", reason="lost: silent",
                          drained=False, drain_error="refused"),  # launch.exclusion
     {"event": "bad_node", "attempt": 0, "cycle": 0, "node": 1, "host": "h1", "slurm_node": "n2",
      "reason": "lost: silent", "drained": False, "drain_error": "refused"}),
    (1007.5, events.BadNode(attempt=0, cycle=0, node=2, reason="health check: x"),  # (not drained)
     {"event": "bad_node", "attempt": 0, "cycle": 0, "node": 2, "reason": "health check: x"}),
    (1008, events.Start(attempt=0, cycle=1, world=4, nodes=2, host="h0", resumed_step=4,
                        resumed_from="/r/checkpoints/step-4", skipped=[["step-5", "failed to load (x)"]],
                        init_from="/hf/model"),
     {"event": "start", "attempt": 0, "cycle": 1, "world": 4, "nodes": 2, "host": "h0", "resumed_step": 4,
      "resumed_from": "/r/checkpoints/step-4", "skipped": [["step-5", "failed to load (x)"]],
      "init_from": "/hf/model"}),
    (1009, events.Recovered(attempt=0, cycle=1, step=5, seconds=3.5),  # launch.supervise
     {"event": "recovered", "attempt": 0, "cycle": 1, "step": 5, "seconds": 3.5}),
    (1010, events.Rollback(attempt=0, cycle=1, step=7, to=4, skipped=[[0, 96], [0, 112]], rollback=1,
                           of=3),  # runtime.train
     {"event": "rollback", "attempt": 0, "cycle": 1, "step": 7, "to": 4, "skipped": [[0, 96], [0, 112]],
      "rollback": 1, "of": 3}),
    (1011, events.SaveFailed(attempt=0, cycle=1, step=6, since=4, probe="ok",
                             error="RuntimeError: unexpected pos 64 vs 32"),  # runtime.checkpoint.manager
     {"event": "save_failed", "attempt": 0, "cycle": 1, "step": 6, "since": 4,
      "error": "RuntimeError: unexpected pos 64 vs 32", "probe": "ok"}),
    (1012, events.End(attempt=0, reason=EndReason.STOP, cycle=1, step=8, saved_step=8),  # runtime.main
     {"event": "end", "attempt": 0, "reason": "stop", "cycle": 1, "step": 8, "saved_step": 8}),
    (1013, events.Requeue(attempt=0, job="77", error=None, excluded=["n2"], nodes=1),  # launch.slurm
     {"event": "requeue", "attempt": 0, "job": "77", "error": None, "excluded": ["n2"], "nodes": 1}),
    (1013.5, events.NodeDown(attempt=0, slurm_node="n2"),
     {"event": "node_down", "attempt": 0, "slurm_node": "n2"}),
    (1013.6, events.NodeDown(attempt=0, slurm_node="n2,n3", error="refused"),
     {"event": "node_down", "attempt": 0, "slurm_node": "n2,n3", "error": "refused"}),
    (1020, events.Start(attempt=1, cycle=0, script=True, world=2, nodes=1, host="h3"),  # script
     {"event": "start", "attempt": 1, "cycle": 0, "script": True, "world": 2, "nodes": 1, "host": "h3"}),
    (1022, events.End(attempt=1, reason=EndReason.ERROR, cycle=0, user_error=True, error="bad value"),
     {"event": "end", "attempt": 1, "reason": "error", "cycle": 0, "user_error": True, "error": "bad value"}),
    (1022.5, events.End(attempt=1, reason=EndReason.ERROR, error="exit 3"),  # launch.node
     {"event": "end", "attempt": 1, "reason": "error", "error": "exit 3"}),
    (1023, events.End.of_script(attempt=1, reason=EndReason.STOP, how="exited 0 after the notice",
                                save={"saved_step": None, "saved": None}),  # launch.node, script
     {"event": "end", "attempt": 1, "reason": "stop", "how": "exited 0 after the notice", "saved_step": None,
      "saved": None}),
    (1023.5, events.End.of_script(attempt=1, reason=EndReason.FAULT,
                                  how="the restart budget is spent: requeued",
                                  save={"saved_step": 5, "saved": "step-5", "lost_seconds": 2.5}),
     {"event": "end", "attempt": 1, "reason": "fault", "how": "the restart budget is spent: requeued",
      "saved_step": 5, "saved": "step-5", "lost_seconds": 2.5}),
    (1024, events.End(attempt=1, reason=EndReason.DONE, saved_step=5, saved="step-5"),  # launch.node
     {"event": "end", "attempt": 1, "reason": "done", "saved_step": 5, "saved": "step-5"}),
    (1024.5, events.End(attempt=1, cycle=0, reason=EndReason.STORAGE, how="the run directory is full",
                        saved_step=5),  # launch.supervise
     {"event": "end", "attempt": 1, "cycle": 0, "reason": "storage", "how": "the run directory is full",
      "saved_step": 5}),
    (1024.6, events.End(attempt=1, cycle=0, reason=EndReason.STORAGE, step=7, saved_step=5,
                        how="stopped at step 7",
                        storage="/r is full"),  # runtime.main (a save the storage refused)
     {"event": "end", "attempt": 1, "cycle": 0, "reason": "storage", "step": 7, "saved_step": 5,
      "how": "stopped at step 7", "storage": "/r is full"}),
    (1025, events.Chain(attempt=1, job="77", next="78", at_once=True),
     {"event": "chain", "attempt": 1, "job": "77", "next": "78", "at_once": True}),
    (1025.5, events.Cancel(attempt=1, job="77", reason="its batch node n1 was lost: it cannot end by itself"),
     {"event": "cancel", "attempt": 1, "job": "77", "reason": "its batch node n1 was lost: it cannot end by "
      "itself"}),
    (1026, events.Guard(attempt=1, job="78", next="79", state="NODE_FAIL"),
     {"event": "guard", "attempt": 1, "job": "78", "next": "79", "state": "NODE_FAIL"}),
    (1027, events.Requeue(attempt=2, job="79", by="the job itself", state="REQUEUED"),
     {"event": "requeue", "attempt": 2, "job": "79", "by": "the job itself", "state": "REQUEUED"}),
    (1028, events.GaveUp(attempt=2, reason="the cap of 3 is reached"),
     {"event": "gave_up", "attempt": 2, "reason": "the cap of 3 is reached"}),
]


def write_typed(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CASES through ledger.append, each at its time."""
    now = [0.0]
    monkeypatch.setattr(ledger, "time", types.SimpleNamespace(time=lambda: now[0]))
    for t, event, _ in CASES:
        now[0] = t
        ledger.append(run, event)


def write_old(run: Path) -> None:
    """CASES' lines as the writers built them by hand before."""
    (run / ledger.LEDGER).write_text("".join(json.dumps({"time": t, **line}) + "\n" for t, _, line in CASES))


def test_every_kind_is_in_the_cases() -> None:
    assert {type(event) for _, event, _ in CASES} == set(events.KINDS.values())
    assert len(events.KINDS) == 17


@pytest.mark.parametrize("event,line", [(e, line) for _, e, line in CASES],
                         ids=[f"{i}-{e.KIND}" for i, (_, e, _) in enumerate(CASES)])
def test_each_event_is_the_line_its_readers_read(tmp_path: Path, event: events.Event,
                                                 line: dict[str, Any]) -> None:
    ledger.append(tmp_path, event)
    (got,) = ledger.read(tmp_path)
    assert isinstance(got.pop("time"), float)
    assert got == line  # fields left UNSET absent, None as null, as before
    assert events.parse({"time": 1.0, **got}) == event


def test_the_ledger_takes_nothing_but_a_typed_event(tmp_path: Path) -> None:
    """A bare dict (an untyped caller mypy did not see), the base class or anything else is
    refused, and nothing is written."""
    for bad in ({"event": "end", "attempt": 0, "reason": "done"}, events.Event(attempt=0), "end", None):
        with pytest.raises(TypeError, match="hpcshard.rundir.events"):
            ledger.append(tmp_path, bad)  # type: ignore[arg-type]
    assert not (tmp_path / ledger.LEDGER).exists()


def test_an_end_has_a_reason_its_readers_know() -> None:
    with pytest.raises(ValueError, match="'finished' is not an end reason; valid: bug, done"):
        events.End(attempt=0, reason="finished")  # type: ignore[arg-type]
    assert events.end_reason("nonfinite") == "nonfinite"
    # every end the runtime, the launchers and the policy write (supervise reads the last two)
    assert {"done", "stop", "error", "fault", "nonfinite", "gave_up", "bug", "storage",
            "unreported"} == events.END_REASONS


def test_a_fault_record_carries_every_field_of_the_decision() -> None:
    """The fault line once spread `Decision.to_dict()`: the typed record names each field, and
    a field the decision gains fails here until the record has it too."""
    decided = Decision(action=Action.REQUEUE, code=3, reason="requeued without them", end=EndReason.FAULT,
                       active=(0, 2), spares=(3,), bad=(1,), replaced={"1": 2}, lost=(1,), committed=40,
                       host="h0", port=29500)
    line = events.record(_fault(0, 2, {"cause": "lost", "time": 9.5, "silent_s": 8.0}, None, 44, decided, []))
    assert {k: line[k] for k in decided.to_dict()} == json.loads(json.dumps(decided.to_dict()))
    assert (line["declared"], line["detect_s"], line["lost_steps"], line["culprit"]) == (9.5, 8.0, 4, None)


def test_unknown_lines_parse_to_none() -> None:
    """What another hpcshard wrote (a kind or shape this one does not know) is no event."""
    assert events.parse({"event": "x", "attempt": 0}) is None
    assert events.parse({"event": "end", "attempt": 0, "reason": "finished"}) is None
    assert events.parse({"event": "end", "reason": "done"}) is None  # no attempt
    end = events.parse({"time": 1.0, "event": "end", "attempt": 3, "reason": "done", "new_field": 1})
    assert end == events.End(attempt=3, reason=EndReason.DONE) and end.cycle is UNSET


def test_end_reasons_are_an_enum_written_as_the_strings_were() -> None:
    """A StrEnum member is written as its value (the ledger's lines are what the strings
    wrote), and a line read back gives the member, in an end and in a fault's decision."""
    line = json.dumps(events.record(events.End(attempt=0, reason=EndReason.GAVE_UP)))
    assert line == '{"event": "end", "attempt": 0, "reason": "gave_up"}'
    end = events.parse(json.loads(line))
    assert isinstance(end, events.End) and end.reason is EndReason.GAVE_UP
    decided = Decision(action=Action.STOP, code=1, reason="r", end=EndReason.BUG, committed=0)
    fault = events.parse(json.loads(json.dumps(events.record(_fault(0, 0, {}, None, 0, decided, [])))))
    assert isinstance(fault, events.Fault) and fault.end is EndReason.BUG


def test_no_module_builds_a_ledger_line_by_hand() -> None:
    """Each kind has one builder, its class: no dict literal with an "event" key anywhere in
    hpcshard but there (and the metrics file's own events, which are not the ledger's)."""
    allowed = {"hpcshard/rundir/events.py", "hpcshard/runtime/metrics.py"}
    found = []
    for path in sorted((ROOT / "hpcshard").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "event"
                                                  for k in node.keys) and name not in allowed:
                found.append(f"{name}:{node.lineno}")
    assert found == [], "build ledger records with hpcshard.rundir.events"


SPEC = RunSpec(name="x", job="j", sets={}, nodes=2, gpus=2, backend="slurm", jobs=["77", "78", "79"],
               resolved=Resolved(config={"steps": 12}))


def test_status_and_goodput_read_a_typed_ledger_as_the_old_one(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    typed, old = tmp_path / "typed", tmp_path / "old"
    metrics = [{"event": "start", "time": 1000.0, "first_step": 1,
                "startup": {"entry": 995.0, "loaded": 999.0}},
               *({"step": s, "time": 1000.0 + s, "loss": 3.0, "tokens_per_s": 1e4} for s in range(1, 6)),
               {"event": "start", "time": 1008.5, "first_step": 5},
               *({"step": s, "time": 1004.0 + s, "loss": 2.0} for s in range(5, 9))]
    for run in (typed, old):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    write_typed(typed, monkeypatch)
    write_old(old)
    assert ledger.read(typed) == ledger.read(old)

    def seen(run: Path) -> tuple[object, ...]:
        header, tail = status.culprit_lines(run, 5)
        return ([line.replace(str(run), "RUN") for line in status.report(run, SPEC, None)],
                status.attempts(run), header.replace(str(run), "RUN"), tail,
                goodput.account(run, created=990.0, now=1030.0))
    assert seen(typed) == seen(old)
    text = "\n".join(seen(typed)[0])  # type: ignore[arg-type]
    for shown in ("faults (1):", "training again 3.5 s after", "bad nodes (2)", "watchdog (0.0)",
                  "links (0.0)", "stragglers (1)", "gave up: the cap of 3", "guard job 79 took the run over",
                  "rollback 1 of 3"):
        assert shown in text, shown


def test_status_shows_the_saves_failing_in_a_row_since_the_newest_checkpoint(tmp_path: Path) -> None:
    """Across attempts and cycles; those that followed an older checkpoint, or came before
    the run last stopped for its storage, are not in the row."""
    def failed(attempt: int, step: int, since: int, probe: str = "ok") -> events.SaveFailed:
        return events.SaveFailed(attempt=attempt, cycle=0, step=step, since=since, error=f"E{step}",
                                 probe=probe)
    for event in (failed(0, 3, 2), failed(0, 4, 2), events.End(attempt=0, reason=EndReason.STORAGE),
                  failed(1, 4, 2), failed(1, 8, 6), failed(2, 4, 2, probe="EIO: Input/output error")):
        ledger.append(tmp_path, event)
    assert [r["step"] for r in ledger.failed_saves(ledger.read(tmp_path), 2)] == [4, 4]
    assert status.failing_saves(tmp_path, 2) == [
        "failed saves: 2 in a row since step 2, the last at step 4 (2.0): E4; a write probe beside it got "
        "EIO: Input/output error"]
    assert status.failing_saves(tmp_path, 6) == ["failed saves: 1 in a row since step 6, the last at step 8 "
                                                 "(1.0): E8; a write probe beside it wrote fine"]
    assert status.failing_saves(tmp_path, 8) == []
