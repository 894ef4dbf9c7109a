"""Which rank is missing from which collective: torch's flight recorder, on demand.

Every process group records its last collectives (torch's flight recorder: on by default,
2000 entries, `TORCH_FR_BUFFER_SIZE`; gloo included since 2.9). Before a launcher kills a
hung cycle, it sends its ranks FLIGHT_SIGNAL; each rank that can still answer writes its
record as JSON into RUN_DIR/logs/flight/a{attempt}-c{cycle}/rank-{rank}.json. A rank
blocked in a collective answers (a thread of its own waits for the signal: a Python
handler would never run while the main thread sits in C++); a stopped or dead rank
cannot, and that silence is itself the answer. Node 0 then reads every record
(`missing`): in each group, the newest collective some rank entered and which of the
group's ranks never did.

Stdlib at import. `arm` runs in a rank; torch is used only once the rank has imported it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from hpcshard.rundir.files import write_atomic
from hpcshard.rundir.paths import RunPaths

FLIGHT_SIGNAL = signal.SIGRTMIN + 5
"""What a launcher sends a rank to have it write its flight record (a real-time signal
that nothing else of a job uses; STACKS_SIGNAL + 1)."""


def folder(run_dir: Path, attempt: int, cycle: int) -> Path:
    return RunPaths(run_dir).flight(attempt, cycle)


def arm(run_dir: Path, attempt: int, cycle: int) -> None:
    """In a rank, before its process group exists (threads started later, gloo's and
    NCCL's included, inherit the blocked signal): a thread that writes this rank's record
    when FLIGHT_SIGNAL comes."""
    signal.signal(FLIGHT_SIGNAL, lambda *_: None)  # a stray delivery must not kill the rank
    signal.pthread_sigmask(signal.SIG_BLOCK, {FLIGHT_SIGNAL})
    out = folder(run_dir, attempt, cycle)

    def wait() -> None:
        while True:
            signal.sigwait({FLIGHT_SIGNAL})
            with contextlib.suppress(Exception):  # a record is a bonus, never a new fault
                record = dump()
                if record is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    write_atomic(out / f"rank-{record['rank']}.json", json.dumps(record))

    threading.Thread(target=wait, name="hpcshard-flight", daemon=True).start()


def dump() -> dict[str, Any] | None:
    """This rank's flight record with the groups' members (gloo leaves them out), or None
    before a process group exists."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return None
    from torch._C import _distributed_c10d as c10d

    dump_json = getattr(c10d, "_dump_fr_trace_json", None)  # (collectives, only active)
    if dump_json is None:  # a torch without the flight recorder for every backend
        return None
    record: dict[str, Any] = json.loads(dump_json(True, False))
    world = dist.distributed_c10d._world
    record["pg_config"] = {world.pg_names[pg]: {"name": world.pg_names[pg], "desc": pg.group_desc,
                                                "ranks": sorted(world.pg_group_ranks[pg])}
                           for pg in world.pg_map}
    # pg_status is keyed by the recorder's own number for a group (its order of creation
    # in this process), the entries and pg_config by the group's name, the same on every
    # rank: key the status by name too.
    order = [world.pg_names[pg] for pg in world.pg_map]
    named = {str(e["pg_id"]): str(e["process_group"][0]) for e in record.get("entries", [])}
    record["pg_status"] = {
        named.get(key) or (order[int(key)] if key.isdigit() and int(key) < len(order) else key): value
        for key, value in record.get("pg_status", {}).items()}
    record["rank"] = dist.get_rank()
    return record


def read(run_dir: Path, attempt: int, cycle: int) -> dict[int, dict[str, Any]]:
    """The records written for a cycle, by rank."""
    found: dict[int, dict[str, Any]] = {}
    where = folder(run_dir, attempt, cycle)
    for path in sorted(where.glob("rank-*.json")) if where.is_dir() else []:
        with contextlib.suppress(ValueError, OSError, KeyError):
            record = json.loads(path.read_text())
            found[int(record["rank"])] = record
    return found


def read_ranks(run_dir: Path, attempt: int, cycle: int, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """The records of these ranks (a launcher's own: written on its host, so read fresh
    there), each cut to what `missing` needs (`brief`): the launcher sends them to the
    decider in its down record, which on NFS may not see another host's new files for
    the directory's lookup cache (30-60 s)."""
    found: dict[int, dict[str, Any]] = {}
    where = folder(run_dir, attempt, cycle)
    for rank in ranks:
        with contextlib.suppress(ValueError, OSError, KeyError):
            found[rank] = brief(json.loads((where / f"rank-{rank}.json").read_text()))
    return found


def brief(record: dict[str, Any]) -> dict[str, Any]:
    """A record with, of its entries (up to 2000), only each group's newest collective
    enqueued (what `missing` names): a few hundred bytes a rank, not hundreds of KB."""
    newest = {name: str(status.get("last_enqueued_collective"))
              for name, status in record.get("pg_status", {}).items()}
    entries = [e for e in record.get("entries", [])
               if newest.get(str(e.get("process_group", [""])[0])) == str(e.get("collective_seq_id"))]
    return {"rank": record["rank"], "pg_config": record.get("pg_config", {}),
            "pg_status": record.get("pg_status", {}), "entries": entries}


def missing(records: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group with a collective in flight: the newest collective a member entered
    (sequence number, op, sizes), the members inside it, and the members that never
    entered it: behind, or with no record at all (stopped, dead, hung outside Python)."""
    if not records:
        return []
    groups: dict[str, list[int]] = {}
    for record in records.values():
        for name, pg in record.get("pg_config", {}).items():
            groups.setdefault(name, [int(r) for r in pg.get("ranks", [])])
    found = []
    for name, members in sorted(groups.items()):
        entered = {r: int(records[r]["pg_status"][name]["last_enqueued_collective"])
                   for r in members if name in records.get(r, {}).get("pg_status", {})}
        if not entered:
            continue
        newest = max(entered.values())
        inside = [r for r in members if entered.get(r) == newest
                  and int(records[r]["pg_status"][name]["last_completed_collective"]) < newest]
        if not inside:
            continue  # nothing in flight in this group
        absent = [r for r in members if entered.get(r, -1) < newest]
        entry: dict[str, Any] = next((e for e in reversed(records[inside[0]].get("entries", []))
                      if str(e.get("process_group", [""])[0]) == name
                      and e.get("collective_seq_id") == newest), {})
        found.append({"group": name, "desc": records[inside[0]]["pg_config"][name].get("desc", ""),
                      "seq": newest, "op": entry.get("profiling_name", "?"),
                      "sizes": entry.get("input_sizes", []), "inside": inside, "missing": absent})
    return found


def roots(found: list[dict[str, Any]]) -> list[int]:
    """Ranks missing from a collective while waiting in none: where a chain of waits
    begins (a rank missing from one group because it waits in another is a consequence)."""
    waiting = {r for g in found for r in g["inside"]}
    return sorted({r for g in found for r in g["missing"]} - waiting)


def summary(found: list[dict[str, Any]]) -> str:
    """One phrase: `rank 1 missing from gloo:all_gather #110 of group 3 (mesh_shard), where
    rank 0 waits`; only the groups where a chain of waits begins, when one is known."""
    first = set(roots(found))
    parts = []
    for g in found:
        absent = [r for r in g["missing"] if r in first] if first else g["missing"]
        if absent:
            parts.append(f"rank {', '.join(map(str, absent))} missing from {g['op']} #{g['seq']} "
                         f"of group {g['group']}{' (' + g['desc'] + ')' if g['desc'] else ''}, "
                         f"where rank {', '.join(map(str, g['inside']))} wait"
                         f"{'s' if len(g['inside']) == 1 else ''}")
    return "; ".join(parts)


def ask(pids: list[int]) -> None:
    """Have these ranks write their records (the launcher, before it kills them)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, FLIGHT_SIGNAL)
