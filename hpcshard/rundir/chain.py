"""Chains of runs: what a run waits for (`submit --after RUN_OR_JOB`), what comes after it
(`submit --then export-hf=DIR`, `--then eval`), and the decisions around them, as pure
functions of the ledger and of what Slurm says.

"After this run" means after the run has ended, not after the job it had when the chain
was made: a run's job is a moving target (a continuation job after a clean stop, a guard
job that takes a failed one over; a requeue keeps its id). So a dependent is recorded in
the run it follows (`followers`), and whoever continues the run under a new job moves the
followers' Slurm dependency onto it (`launch.slurm.carry`); a `--then` job checks the
ledger itself when it starts and waits again for whatever still carries the run
(`decide_then`), so a half-finished run is never exported, and a checkpoint older than the
run's last step is never exported silently.

The record is RUN_DIR/chain.json (`paths.CHAIN`), read and changed under its lock by the
command that submits, the `--then` jobs and the upstream run's launchers. Stdlib only."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcshard.errors import UserError
from hpcshard.rundir import paths
from hpcshard.rundir.files import locked, write_atomic

KINDS = ("afterok", "afterany", "afternotok")
"""Slurm's dependency kinds that `--after KIND:RUN_OR_JOB` takes (afterok by default)."""
THEN = ("export-hf", "eval")
"""What `--then` runs after a run has ended done."""
DONE = "done"


@dataclass(frozen=True, kw_only=True)
class After:
    """What a run waits for: `kind` (Slurm's) on `job`, the newest job of `run` when the
    chain was made (empty: a plain Slurm job, or a run that had already ended)."""

    kind: str
    target: str
    """As the user named it."""
    job: str = ""
    run: str = ""


@dataclass(kw_only=True)
class Then:
    """A step run after the run has ended done, as Slurm jobs of its own."""

    what: str
    """export-hf or eval (`THEN`)."""
    dir: str = ""
    """export-hf: the directory to write."""
    jobs: list[str] = field(default_factory=list)
    """Its Slurm jobs, oldest first (a job that found the run still going waits again as
    a new job)."""
    state: str = "waiting"
    """waiting, done, skipped or failed."""
    said: str = ""
    """What it did, or why not (one line)."""

    @property
    def label(self) -> str:
        return f"{self.what} {self.dir}".strip()


@dataclass(kw_only=True)
class Chain:
    """RUN_DIR/chain.json."""

    after: After | None = None
    then: list[Then] = field(default_factory=list)
    followers: list[dict[str, str]] = field(default_factory=list)
    """Jobs that depend on this run: {"job", "kind", "run"} (a `--then` job: run empty)."""

    @classmethod
    def read(cls, run_dir: Path) -> Chain:
        try:
            raw = json.loads((run_dir / paths.CHAIN).read_text())
        except FileNotFoundError:
            return cls()
        after = raw.get("after")
        return cls(after=After(**after) if after else None, then=[Then(**t) for t in raw.get("then", [])],
                   followers=list(raw.get("followers", [])))

    def write(self, run_dir: Path) -> None:
        write_atomic(run_dir / paths.CHAIN, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def update(cls, run_dir: Path, change: Callable[[Chain], None]) -> Chain:
        """Read, change and write under the file's lock (several writers: see the module)."""
        with locked(run_dir / paths.CHAIN) as held:
            chain = cls.read(run_dir)
            change(chain)
            held()
            chain.write(run_dir)
        return chain


def parse_after(text: str) -> tuple[str, str]:
    """`--after [KIND:]RUN_OR_JOB` as (kind, target); afterok when no kind is given."""
    kind, sep, rest = text.partition(":")
    if sep and kind in KINDS and rest:
        return kind, rest
    if sep and kind.startswith("after"):
        raise UserError(f"--after {text}: {kind!r} is not a dependency kind hpcshard takes; "
                        f"valid: {', '.join(KINDS)} (KIND:RUN_OR_JOB)")
    if not text:
        raise UserError("--after needs a run directory or a Slurm job id")
    return "afterok", text


def parse_then(items: Sequence[str]) -> list[Then]:
    """`--then export-hf=DIR` (or `export-hf:DIR`, or `'export-hf DIR'` quoted: a click
    option takes one word) and `--then eval`; a directory that exists and is not
    empty is refused, as `ckpt export --hf` would refuse it hours later."""
    out: list[Then] = []
    for item in items:
        what, _, rest = item.replace("=", " ", 1).replace(":", " ", 1).partition(" ")
        rest = rest.strip()
        if what not in THEN:
            raise UserError(f"--then {item}: valid: export-hf=DIR, eval")
        if what == "export-hf" and not rest:
            raise UserError("--then export-hf needs the directory to write: --then export-hf=DIR")
        if what == "eval" and rest:
            raise UserError(f"--then eval takes nothing more (got {rest!r})")
        if rest:
            target = Path(rest).expanduser()
            if target.exists() and (not target.is_dir() or any(target.iterdir())):
                raise UserError(f"--then export-hf {rest}: it exists and is not an empty directory; "
                                "choose a new one (nothing is overwritten)")
            rest = str(target.resolve())
        if any(t.what == what and t.dir == rest for t in out):
            raise UserError(f"--then {item} is given twice")
        out.append(Then(what=what, dir=rest))
    return out


def verdict(records: Sequence[Mapping[str, Any]]) -> str | None:
    """How the run ended, from its ledger: "done" (its last attempt trained every step),
    another reason ("gave up: ...", "error", "stop", ...) when nothing continues it by
    itself, or None: going on (a requeue, continuation or take-over comes next), or
    killed without a word (Slurm must say whether a job still carries it)."""
    attempts = [int(r["attempt"]) for r in records if "attempt" in r]
    if not attempts:
        return None
    last = [r for r in records if r.get("attempt") == max(attempts)]
    # Only what came after the attempt's newest (re)start closes it: rank 0's `end` (error)
    # of a cycle the launchers then restarted in place (their fault record says so, the
    # next cycle's start follows once its checkpoint is loaded) is history, not the run's end.
    reopened = [i for i, r in enumerate(last) if r.get("event") == "start"
                or (r.get("event") == "fault" and r.get("restart"))]
    since = last[reopened[-1] + 1:] if reopened else last
    closing = [r for r in since if r.get("event") in ("end", "gave_up", "requeue", "chain", "guard")]
    # A continuation goes on whatever end comes after it (the leader's stop may be written
    # after the launcher that sent the job on wrote its requeue), unless a give-up follows
    # it: a requeue left to the batch script whose actions could not be written
    # (`launch.slurm._leave_to_host`) is no requeue. A give-up a guard then overrode is.
    went_on = [i for i, r in enumerate(closing) if r["event"] in ("requeue", "chain", "guard")]
    gave_up = [i for i, r in enumerate(closing) if r["event"] == "gave_up"]
    if went_on and not (gave_up and gave_up[-1] > went_on[-1]):
        return None
    if gave_up:
        return f"gave up: {closing[gave_up[-1]].get('reason', '')}".rstrip(": ")
    ends = [r for r in closing if r["event"] == "end"]
    return str(ends[-1].get("reason")) if ends else None


def job_exit(records: Sequence[Mapping[str, Any]]) -> int:
    """The exit code a run's Slurm job ends with, so that what Slurm makes of it (COMPLETED
    or FAILED, and with it `afterok` and `afternotok` on the job) says what the run did:
    0 while the run goes on (requeued, continued in another job, taken over, or killed
    without a word: `verdict` None) and when it ended done; 1 when it ended otherwise (an
    error, a stop nobody continues, its storage, given up). (submitit's task exits 0
    whatever the launcher returns: a run that failed left its job COMPLETED, and a run
    queued `--after` it with afterok started.)"""
    ended = verdict(records)
    return 0 if ended is None or ended == DONE else 1


def done_step(records: Sequence[Mapping[str, Any]]) -> int | None:
    """The step a run that ended done reached (its last `end` record's)."""
    ends = [r for r in records if r.get("event") == "end" and r.get("reason") == DONE]
    step = ends[-1].get("step") if ends else None
    return int(step) if isinstance(step, int) else None


def depend_on_run(kind: str, run: str, ended: str | None, newest: str | None,
                  newest_over: bool | None) -> str:
    """The job a new run waits for with `--after KIND:RUN` ("": none, start when the
    scheduler likes), from how RUN ended (`verdict`) and its newest job; UserError where
    the dependency could never be met, or Slurm cannot say."""
    if newest is None:
        raise UserError(f"--after {run}: the run has no Slurm job (it ran on the local backend); "
                        "run the commands one after the other")
    if ended is not None:  # over: nothing to wait for, or never to be met
        ok = ended == DONE
        if (kind == "afterok" and not ok) or (kind == "afternotok" and ok):
            raise UserError(f"--after {kind}:{run}: the run has ended ({ended}), so this would never "
                            f"start; {'resume it first, or ' if not ok else ''}use afterany:{run}")
        return ""
    if newest_over is None:
        raise UserError(f"--after {run}: Slurm did not answer whether its job {newest} still runs; "
                        "nothing was submitted; try again once `scontrol ping` answers")
    if newest_over:
        raise UserError(f"--after {run}: its job {newest} is over and the run did not finish (killed, "
                        f"or waiting for `hpcshard resume`); resume it first, or use afterany:{run}")
    return newest


def decide_then(ended: str | None, carriers: Sequence[str] | None, newest: str | None) -> tuple[str, Any]:
    """What a `--then` job does when it starts: ("go", None) once the run ended done;
    ("wait", jobs) while jobs may still carry it (pending or running: the newest job, a
    guard of it); ("skip", why) when it has ended otherwise. `carriers` None: Slurm did not
    answer; the newest job is waited for again (never taken for over)."""
    if ended == DONE:
        return "go", None
    if ended is not None:
        return "skip", (f"the run ended {ended}, not done: nothing done; once it has finished "
                        "(hpcshard resume), run the step by hand")
    if carriers is None:
        return ("wait", [newest]) if newest else ("skip", "the run has no job and no end")
    if carriers:
        return "wait", list(carriers)
    return "skip", ("the run's jobs are over and its ledger says it did not finish (killed from "
                    "outside?); resume it, then run the step by hand")


def check_fresh(done: int | None, newest: int | None) -> str:
    """Why the newest committed checkpoint must not stand for the run's end ("": it may):
    it must be the very step the run finished at."""
    if done is None:
        return "the run's ledger records no step it finished at"
    if newest is None:
        return "the run has no committed checkpoint"
    if newest != done:
        return (f"the newest committed checkpoint is step {newest}, not the step the run finished "
                f"at ({done}): not exported as if it were the end")
    return ""


def status_lines(chain: Chain, states: Mapping[str, str]) -> list[str]:
    """What `status` shows of a chain; `states`: Slurm's word for each job named."""
    def of(job: str) -> str:
        return f"job {job} {states.get(job, 'unknown')}" if job else "no job"

    lines = []
    if chain.after is not None:
        a = chain.after
        waits = f"{a.kind} {a.run or a.target}" + (f" ({of(a.job)})" if a.job else " (ended: none)")
        lines.append(f"after: {waits}")
    for t in chain.then:
        job = t.jobs[-1] if t.jobs else ""
        said = f": {t.said}" if t.said else ""
        lines.append(f"then: {t.label}: {t.state}{said}" + (f" [{of(job)}]" if job else ""))
    for f in chain.followers:
        if f.get("run"):
            lines.append(f"followed by: {f['run']} ({f['kind']}, {of(f['job'])})")
    return lines
