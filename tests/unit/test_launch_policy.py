"""The recovery policy (launch.policy.decide), branch by branch: facts in, a typed decision
out, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcshard.launch.policy import Action, Decision, Facts, StorageVerdict, decide, storage_verdict
from hpcshard.rundir.rankenv import BUG_EXIT, REQUEUE_EXIT, STORAGE_EXIT

pytestmark = pytest.mark.unit

BASE = Facts(cycle=0, active=(0, 1), committed=40)
LOST = "lost: its launcher was silent for 8 s"
ALONE = ("the run directory /r takes no write (EIO: Input/output error) (3 tries), seen from node(s) [1], "
         "not from [0]")

# (name, facts, action, code, end, active, spares, bad, words in the reason)
CASES = [
    ("a crash restarts in place", BASE, Action.RESTART, 0, "", (0, 1), (), (), "restart 1 of 3"),
    ("unreported nodes stop everything", replace(BASE, unreported=(1,), storage="full", noticed=True),
     Action.STOP, 1, "unreported", (), (), (), "did not report"),
    ("storage stops before any node is blamed",
     replace(BASE, storage="the run directory /r is full", noticed=True, bad={1: LOST}),
     Action.STOP, STORAGE_EXIT, "storage", (), (), (), "no node is blamed"),
    ("a notice requeues", replace(BASE, noticed=True, bad={1: LOST}), Action.REQUEUE, REQUEUE_EXIT,
     "stop", (), (), (), "notice"),
    ("a node that stopped on a notice while another failed: requeued, not waited for",
     replace(BASE, ended={0: REQUEUE_EXIT}), Action.REQUEUE, REQUEUE_EXIT, "stop", (), (), (),
     "stopped on a notice"),
    ("a node whose ranks finished while another failed: nothing to restart with",
     replace(BASE, ended={1: 0}), Action.STOP, 1, "gave_up", (), (), (), "finished while another failed"),
    ("a node whose launcher failed: a spare takes its place, the node is not called bad",
     replace(BASE, spares=(2,), ended={0: 1}), Action.RESTART, 0, "", (1, 2), (), (0,),
     "its launcher ended (exit 1)"),
    ("...and without a spare: back through the queue", replace(BASE, ended={0: 1}), Action.REQUEUE,
     REQUEUE_EXIT, "fault", (), (), (0,), "requeued without them"),
    ("an idle spare that ended is no reason to stop", replace(BASE, spares=(2,), ended={2: 0}),
     Action.RESTART, 0, "", (0, 1), (2,), (), "restart 1 of 3"),
    ("a spare takes a lost node's place", replace(BASE, spares=(2,), lost=(1,), bad={1: LOST}),
     Action.RESTART, 0, "", (0, 2), (), (1,), "spare node(s) [2] take their place"),
    ("two bad, one spare, min_nodes 1: fewer nodes",
     replace(BASE, active=(0, 1, 2), spares=(3,), min_nodes=1, bad={1: LOST, 2: "health check: x"}),
     Action.RESTART, 0, "", (0, 3), (), (1, 2), "going on with 2 nodes"),
    ("no spare and no min_nodes: requeued without the bad node", replace(BASE, lost=(1,), bad={1: LOST}),
     Action.REQUEUE, REQUEUE_EXIT, "fault", (), (), (1,), "requeued without them"),
    ("the local backend has no other node", replace(BASE, local=True, bad={1: "health check: x"}),
     Action.STOP, 1, "gave_up", (), (), (1,), "local backend"),
    ("a lost node on the local backend is requeued (the node comes back)",
     replace(BASE, local=True, lost=(1,), bad={1: LOST}), Action.REQUEUE, REQUEUE_EXIT, "fault", (), (),
     (1,), "requeued without them"),
    ("the same bug twice stops", replace(BASE, cycle=1, bug="ZeroDivisionError"), Action.STOP, BUG_EXIT,
     "bug", (), (), (), "a bug, not a fault"),
    ("no progress after restarts gives up", replace(BASE, cycle=2, stalled=2), Action.STOP, 1, "gave_up",
     (), (), (), "2 restarts in a row"),
    ("no progress, but a bad node replaced: one more try",
     replace(BASE, cycle=2, stalled=2, spares=(2,), bad={1: LOST}), Action.RESTART, 0, "", (0, 2), (),
     (1,), "restart 3 of 3"),
    ("a spent restart budget requeues", replace(BASE, cycle=3), Action.REQUEUE, REQUEUE_EXIT, "fault", (),
     (), (), "restart budget (3) is spent"),
    ("a bad node is never active again", replace(BASE, active=(0, 2), spares=(3,), bad={1: LOST}),
     Action.RESTART, 0, "", (0, 2), (3,), (), "restart 1 of 3"),
    # A node that alone saw the run directory refuse a write sits the attempt out: not bad.
    ("an unfit node: a spare takes its place, nothing calls it bad",
     replace(BASE, spares=(2,), unfit={1: ALONE}),
     Action.RESTART, 0, "", (0, 2), (), (), f"node(s) [1] sit this attempt out ({ALONE}): spare node(s) [2]"),
    ("an unfit node, min_nodes 1: fewer nodes", replace(BASE, min_nodes=1, unfit={1: ALONE}),
     Action.RESTART, 0, "", (0,), (), (), "going on with 1 nodes"),
    ("an unfit node, no spare: back through the queue, nothing excluded", replace(BASE, unfit={1: ALONE}),
     Action.REQUEUE, REQUEUE_EXIT, "fault", (), (), (), "sit this attempt out"),
    ("a bad node and an unfit one: requeued, the bad one excluded",
     replace(BASE, active=(0, 1, 2), lost=(2,), bad={2: LOST}, unfit={1: ALONE}), Action.REQUEUE,
     REQUEUE_EXIT, "fault", (), (), (2,), f"node(s) [2] bad ({LOST}) and node(s) [1] sit this attempt out"),
    ("an unfit spare is not used", replace(BASE, spares=(2, 3), lost=(1,), bad={1: LOST}, unfit={2: ALONE}),
     Action.RESTART, 0, "", (0, 3), (), (1,), "spare node(s) [3] take their place"),
    ("no progress, but a node sat out and a spare came: one more try",
     replace(BASE, cycle=2, stalled=2, spares=(2,), unfit={1: ALONE}), Action.RESTART, 0, "", (0, 2), (), (),
     "restart 3 of 3"),
]


@pytest.mark.parametrize("name,facts,action,code,end,active,spares,bad,said", CASES,
                         ids=[c[0] for c in CASES])
def test_every_branch_of_the_policy(name: str, facts: Facts, action: Action, code: int, end: str,
                                    active: tuple[int, ...], spares: tuple[int, ...], bad: tuple[int, ...],
                                    said: str) -> None:
    got = decide(facts)
    assert (got.action, got.code, got.end) == (action, code, end)
    assert said in got.reason
    assert got.committed == facts.committed and got.lost == facts.lost
    if action is Action.RESTART:
        assert (got.active, got.spares) == (active, spares)
    assert got.bad == bad
    # Every decision that neither restarts nor requeues closes the attempt (defect 1: a
    # give-up without a closing record let a guard job take the run over, again and again).
    assert bool(got.end) == (action is not Action.RESTART)


def test_a_decision_survives_its_file() -> None:
    """The decider writes it once (next-A-C.json); every launcher reads it back."""
    got = replace(decide(replace(BASE, spares=(2,), bad={1: LOST})), host="n1", port=29400)
    import json

    back = Decision.from_dict(json.loads(json.dumps(got.to_dict())))
    assert back == got and back.restart and back.to_dict()["restart"] is True


EIO = "the run directory /r takes no write (EIO: Input/output error) (3 tries)"
FULL = "the run directory /r is full"
HUNG = "the run directory /r did not answer a write within 60 s (hung)"


@pytest.mark.parametrize("seen,lasting,wrote,verdict", [
    ({}, (), (0, 1), StorageVerdict()),  # every write landed
    ({0: EIO, 1: EIO}, (), (), StorageVerdict(wait=EIO)),  # every node: it may pass, waited for
    ({0: HUNG, 1: EIO}, (), (), StorageVerdict(wait=HUNG)),
    ({0: EIO, 1: FULL}, (1,), (), StorageVerdict(stop=FULL)),  # one a person must fix: at once
    ({1: EIO}, (), (), StorageVerdict(wait=EIO)),  # (node 0 lost: the ones that reported)
    ({1: EIO}, (), (0, 2), StorageVerdict(unfit={1: f"{EIO}, seen from node(s) [1], not from [0, 2]"})),
    ({1: FULL}, (1,), (0,), StorageVerdict(unfit={1: f"{FULL}, seen from node(s) [1], not from [0]"})),
    ({0: EIO, 2: HUNG}, (), (1,), StorageVerdict(unfit={
        n: f"{why}, seen from node(s) [0, 2], not from [1]" for n, why in ((0, EIO), (2, HUNG))})),
], ids=["nothing", "every-node-eio", "every-node-hung-or-eio", "every-node-one-full", "the-only-one",
        "one-alone", "full-alone", "two-alone"])
def test_the_nodes_probes_compared(seen: dict[int, str], lasting: tuple[int, ...], wrote: tuple[int, ...],
                                   verdict: StorageVerdict) -> None:
    """The run stops for its storage only when every node that reported saw an error; at
    once where a person must act (full, quota, read-only), else once the decider waited
    for it in vain. Seen by some while others wrote (a stale mount), it is those nodes'."""
    assert storage_verdict(seen, lasting, wrote) == verdict
