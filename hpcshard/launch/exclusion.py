"""Bad nodes: a node declared bad is never used again by the run (the ledger's `bad_node`
records; later jobs of the run exclude them in Slurm), and, where the profile says
`bad_nodes = drain` and the user may, Slurm is told too (an admin reads why in `sinfo -R`).
Only a node's own trouble makes it bad: lost (silent), a failed health check, a straggler
or a node with every link slow (and a node declared bad before that the job lands on
again). Never storage, whatever the error (see `launch.health`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpcshard.launch import hostside
from hpcshard.rundir import events, ledger


def declare_bad(run_dir: Path, attempt: int, cycle: int, node: int, where: dict[str, Any],
                reason: str, drain: bool) -> None:
    """Record node `node` (of this attempt's launchers; `where`: its host and Slurm node)
    as bad for the run, and drain it in Slurm when asked to."""
    drained: bool | events.Unset = events.UNSET  # (not asked)
    drain_error: str | events.Unset = events.UNSET
    if where.get("slurm_node") and drain and not hostside.has_client():
        # (in a container without Slurm's client: the batch script drains it once srun
        # returns, `hostside`; the run never uses the node again meanwhile)
        print(hostside.missing("drain"), file=sys.stderr, flush=True)
        drained, drain_error = False, hostside.DEFERRED
    elif where.get("slurm_node") and drain:
        from hpcshard.slurm import cluster

        try:
            cluster.drain(where["slurm_node"], f"hpcshard {run_dir.name}: {reason}")
            drained = True
        except cluster.SlurmError as err:
            drained, drain_error = False, str(err)
    ledger.append(run_dir, events.BadNode(
        attempt=attempt, cycle=cycle, node=node, host=where.get("host", events.UNSET),
        slurm_node=where.get("slurm_node", events.UNSET), reason=reason, drained=drained,
        drain_error=drain_error))


def declared_before(run_dir: Path, slurm_node: str) -> str:
    """Why the run declared this Slurm node bad before ("" if it never did, or the ledger
    cannot be read). A job may be placed on such a node again: Slurm refused the requeue's
    `ExcNodeList` update (`cluster.requeue` then releases the job with the nodes it had),
    or a drain was refused and the job was requeued by hand. The node sits this attempt
    out like one that fails its health check (a spare, fewer nodes, or the queue again)."""
    if not slurm_node:
        return ""
    try:
        found = [r for r in ledger.bad_nodes(run_dir) if r.get("slurm_node") == slurm_node]
    except OSError:
        return ""
    if not found:
        return ""
    return (f"{slurm_node} was declared bad in attempt {found[-1]['attempt']} ({found[-1]['reason']}) "
            "and the job was placed on it again")


def bad(run_dir: Path, attempt: int) -> dict[int, str]:
    """The nodes declared bad in this attempt (they never train in it again), and why."""
    return {int(r["node"]): str(r["reason"]) for r in ledger.bad_nodes(run_dir, attempt)}


def stragglers(run_dir: Path, attempt: int, cycle: int) -> list[dict[str, Any]]:
    """The stragglers the ranks named in this cycle under straggler_policy=bad_node."""
    return [r for r in ledger.read(run_dir) if r["event"] == "straggler"
            and r.get("policy") == "bad_node" and r["attempt"] == attempt and r.get("cycle") == cycle]


def slow_nodes(run_dir: Path, attempt: int, cycle: int, downs: list[dict[str, Any]]
               ) -> list[tuple[int, dict[str, Any], str]]:
    """The node of each straggler named under straggler_policy=bad_node, not bad yet (the
    down records say which node each rank ran on): (node, where it ran, why)."""
    node_of = {int(r["rank"]): r for down in downs for r in down.get("ranks", [])}
    known = set(bad(run_dir, attempt))
    found = []
    for r in stragglers(run_dir, attempt, cycle):
        where = node_of.get(int(r["rank"]))
        if where is None or int(where["node"]) in known:
            continue
        known.add(int(where["node"]))
        why = (f"slow link: every link of it under {r['floor_gbps']:g} GB/s (slowest {r['gbps']} GB/s)"
               if r.get("kind") == "link" else
               f"straggler: rank {r['rank']} computed {r['ratio']}x slower than the median of the others")
        found.append((int(where["node"]), where, why))
    return found
