"""A node the run declared bad is never used again (issue 42's suspected items, examined):
a requeue whose `ExcNodeList` update Slurm refused puts the job on the bad node again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpcshard.launch import node as lnode
from hpcshard.launch.supervise import Supervisor
from hpcshard.rundir import events, ledger
from hpcshard.rundir.rankenv import REQUEUE_EXIT, RankEnv
from hpcshard.rundir.spec import RunSpec

pytestmark = pytest.mark.unit


def test_a_node_declared_bad_before_never_trains_when_the_job_lands_on_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scontrol update JobId=J ExcNodeList=n3` refused: `cluster.requeue` releases the job
    with the nodes it had (else it would stay held for good), and Slurm may start it on n3
    again (not drained: `bad_nodes = exclude`, or the drain was refused). Its launcher
    trained there. Now it sits the attempt out, bad again, and the job is requeued
    without it (a spare or `min_nodes` would go on here)."""
    spec = RunSpec(job="jobs/charlm.py", sets={}, nodes=1, gpus=1, backend="slurm", name="t",
                   bad_nodes="exclude")
    tmp_path.mkdir(exist_ok=True)
    spec.write(tmp_path)
    ledger.append(tmp_path, events.BadNode(attempt=0, cycle=1, node=1, host="n3", slurm_node="n3",
                                           reason="lost: its launcher was silent for 8 s"))
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    started: list[Any] = []

    def start(node: Any, env: Any) -> Any:
        started.append(env)
        raise OSError("no agent is started here")

    node = lnode.NodeEnv(node_rank=0, nnodes=1, per_node=1, rdzv_host="127.0.0.1", rdzv_port=29999,
                         run_id="again")
    code = Supervisor(node, tmp_path, spec, RankEnv(attempt=1), start).run()
    assert not started
    assert code == REQUEUE_EXIT
    (bad,) = ledger.bad_nodes(tmp_path, attempt=1)
    assert bad["slurm_node"] == "n3" and bad["reason"] == (
        "n3 was declared bad in attempt 0 (lost: its launcher was silent for 8 s) and the job was placed "
        "on it again")
    (fault,) = [r for r in ledger.read(tmp_path) if r["event"] == "fault"]
    assert "requeued without them" in fault["reason"]


@pytest.mark.parametrize("squeue, down", [
    ("echo 12\n", True),  # the job alone on its lost node: DOWN ends the wait at once
    ("echo 12; echo 345\n", False),  # another job there too (no --exclusive): a DOWN would end it
    ("exit 1\n", False),  # Slurm does not say: not known, so no
], ids=["alone", "shared", "no-answer"])
def test_a_lost_node_is_set_down_after_a_requeue_only_where_no_other_job_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: str, down: bool) -> None:
    """`bad_nodes = drain`: after the requeue the launcher set the attempt's lost nodes DOWN
    (the job's requeue waits for them otherwise), and Slurm fails every job on a DOWN node:
    on an allocation without --exclusive, other users' jobs on that node too."""
    from hpcshard.launch import exclusion
    from hpcshard.launch import slurm as launch_slurm
    from tests.unit.test_launch_release import fake_slurm

    env, called = fake_slurm(tmp_path, squeue=squeue)
    monkeypatch.setenv("PATH", env["PATH"])
    run = tmp_path / "run"
    run.mkdir()
    exclusion.declare_bad(run, 0, 0, 1, {"host": "h2", "slurm_node": "n2"}, "lost: silent", drain=False)
    spec = type("Spec", (), {"bad_nodes": "drain"})()
    launch_slurm._down_lost(run, spec, 0, "12")  # type: ignore[arg-type]
    asked = called.read_text().splitlines()
    assert asked[0] == "squeue -h -t R,S,CG -w n2 -o %A"
    assert ("scontrol update NodeName=n2 State=DOWN Reason=hpcshard run: lost: silent" in asked) is down
    (record,) = [r for r in ledger.read(run) if r["event"] == "node_down"]
    assert ("error" not in record) is down
    if not down:
        assert record["error"].startswith("not set DOWN: ") and "SlurmdTimeout" in record["error"]
