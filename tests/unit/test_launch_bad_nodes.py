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
