"""A sweep larger than the cluster's job arrays take, as several arrays that are one sweep.

Slurm bounds an array twice: its indices must stay below `MaxArraySize` (1001 by default;
so a later array cannot simply number its tasks 1001, 1002, ...), and its task count below
`SchedulerParameters=max_array_tasks` where a site sets it. A sweep of more tasks is split
into arrays of at most that many tasks, each indexed from 0: task i of the sweep is task
i - first of the array holding it (`Part`), and its run directory says which job it is.

The sweep's `--max-parallel M` must hold across all its arrays, not per array. Three ways
were weighed:

- `%M` divided among the arrays (`%3` and `%2` for 5): always within M, but an array that
  finishes early leaves its share idle while the others still wait, and M smaller than the
  number of arrays cannot be divided at all.
- Submitting an array as an earlier one ends: a process on the login node for the whole
  sweep (a logout, a reboot of the login node, and the rest of the sweep never runs).
- Dependencies (chosen): every array throttled `%M` and submitted at once, array k held by
  Slurm (`--dependency=afterany:...`) until the arrays before it are over. Slurm alone keeps
  the bound, after the command has returned, across requeues (a requeued task is pending
  again, not over, so the next array still waits). `afterany`, not `afterok`: a failed
  configuration must not stop the rest of the sweep. The cost is the tail of each array:
  while its last tasks run, fewer than M do (at most M - 1 slots, for one task's time,
  once per array of `MaxArraySize` tasks).

Where M is more than an array's size, w arrays run side by side (`width`: M // size or
one more, whichever lets more tasks run, w x min(size, M // w): M = 1.5 x size runs two
arrays of M / 2 at once, not one of `size`): array k waits for arrays k - 2w + 1 ... k - w.
By induction every array up to k - w is then over when array k starts (array k - w itself
started only once those before it were), so at most w arrays of `M // w` tasks each run at
once. M at least the sweep's tasks: nothing waits (all of them at once are within M).
Without `--max-parallel` the arrays wait for nothing: as many tasks run as Slurm
schedules, as with one array. Stdlib."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One array of a sweep: tasks `first` to `first + count - 1`, as its indices 0 to
    count - 1."""

    first: int
    count: int
    throttle: int = 0
    """Its tasks at once (`%N`); 0: as many as Slurm schedules."""
    after: tuple[int, ...] = ()
    """The parts (their positions in the plan) whose every task must be over first."""

    @property
    def spec(self) -> str:
        """sbatch's --array value: `0-N` or `0-N%M`."""
        return f"0-{self.count - 1}" + (f"%{self.throttle}" if self.throttle else "")

    @property
    def tasks(self) -> range:
        """The sweep's task indices this array runs."""
        return range(self.first, self.first + self.count)


def plan(count: int, limit: int | None, max_parallel: int = 0) -> list[Part]:
    """The arrays that run `count` tasks on a cluster whose arrays take at most `limit`
    tasks (None: unknown, one array, as sbatch would refuse it anyway), at most
    `max_parallel` at once across all of them (0: no bound). See the module's docstring."""
    if count < 1:
        raise ValueError(f"a sweep of {count} tasks has nothing to run")
    size = count if limit is None or limit < 1 else min(limit, count)
    firsts = range(0, count, size)
    if max_parallel <= 0 or len(firsts) == 1 or max_parallel >= count:
        return [Part(first, min(size, count - first), max_parallel) for first in firsts]
    # (both within the arrays there are: max_parallel < count <= len(firsts) * size)
    width = max(sorted({max(1, max_parallel // size), -(-max_parallel // size)}),
                key=lambda w: w * min(size, max_parallel // w))
    return [Part(first, min(size, count - first), max_parallel // width,
                 tuple(range(max(0, k - 2 * width + 1), k - width + 1)))
            for k, first in enumerate(firsts)]


def dependency(jobs: list[str]) -> str:
    """sbatch's --dependency value that holds a job until every task of these arrays is
    over, however it ended; empty for none."""
    return "afterany:" + ":".join(jobs) if jobs else ""


def array_limit(config: str) -> int | None:
    """The most tasks one array may have, from `scontrol show config`'s text: MaxArraySize
    (indices below it), lowered by SchedulerParameters' max_array_tasks where set; None
    when the text names neither (unknown)."""
    size = re.search(r"^MaxArraySize\s*=\s*(\d+)", config, re.MULTILINE)
    tasks = re.search(r"^SchedulerParameters\s*=.*\bmax_array_tasks=(\d+)", config, re.MULTILINE)
    limits = [int(found.group(1)) for found in (size, tasks) if found]
    return min(limits) if limits else None
