"""What every rank runs (`hpcshard.entry` calls `main` under torchrun or in a warm fork).

RUN_DIR/spec.json (written by `hpcshard submit`) names the job and its --set values.
A user error (a bad value the preflight could not see: hpcshard's own `UserError`) exits
2 with one line, and is not restarted; its traceback goes to the rank's log file. Any
other exception (a torch or json ValueError included) is a rank failure, which the
launchers may restart. A save that the run's storage refused (full, over quota,
read-only) ends the run with STORAGE_EXIT and an `end` record whose reason is "storage"
(not restarted, not requeued: every attempt would fail the same way); a job that no
longer owns its run directory (`rundir.lease`) exits 0 and writes nothing more: the run
is someone else's now.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from hpcshard.config import build_config, kept_sets
from hpcshard.errors import UserError
from hpcshard.rundir import events, flight, launchers, ledger, store
from hpcshard.rundir.events import EndReason
from hpcshard.rundir.files import side_name
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.progress import Board
from hpcshard.rundir.rankenv import STACKS_SIGNAL, STORAGE_EXIT, STRAGGLER_EXIT, RankEnv
from hpcshard.rundir.runlogs import start_line
from hpcshard.rundir.spec import RunSpec
from hpcshard.runtime import links
from hpcshard.runtime.checkpoint import Loaded
from hpcshard.runtime.checkpoint.guard import FREE, Disowned
from hpcshard.runtime.device import DistEnv, init_distributed
from hpcshard.runtime.job import load_job
from hpcshard.runtime.logfile import LogFile
from hpcshard.runtime.pretrained import Stored
from hpcshard.runtime.stop import StopRequest
from hpcshard.runtime.train import Hooks, Past, Summary, Trainer
from hpcshard.sections import SupervisionSection
from hpcshard.slurm.env import current_run

USER_ERROR = 2
log = logging.getLogger("hpcshard")


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs fully to RUN_DIR/logs/rank-N.log (while its storage takes writes:
    `LogFile`); only rank 0 talks on the console."""
    paths = RunPaths(run_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    to_file = LogFile(paths.rank_log(rank), say=rank == 0)
    to_file.setFormatter(fmt)
    to_file.setLevel(logging.DEBUG)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.handlers[:] = [to_file, console]
    log.setLevel(logging.DEBUG)
    log.propagate = False


def check_writable(run_dir: Path) -> None:
    """Refuse to start, before any training, where the user may not write checkpoints
    (permissions: theirs to fix, a UserError). Any other refusal is not the user's: a file
    server's blip (ESTALE, EIO) is a fault the launchers restart the ranks for, and a full
    or read-only file system is the run's storage trouble, which the launchers find and
    stop the run for (their own writes fail too), never a user error that ends the run."""
    probe = side_name(run_dir / "write-probe")  # every rank probes: two may have one pid (containers)
    try:
        probe.write_text("")
        probe.unlink()
    except PermissionError as err:
        raise UserError(f"run directory {run_dir} is not writable ({err.strerror}); "
                        "checkpoints could not be saved: fix its permissions") from None


def main(argv: list[str] | None = None, early: list[int] | None = None,
         start: float | None = None, early_at: list[float] | None = None) -> int:
    """One rank's whole run. `early`: signals the entry point received before the runtime
    took them (a notice while torch loaded, or during the rendezvous), each at the time in
    `early_at` (boot clock): the entry point's own lists, which it appends to until then;
    `start`: when the entry point started."""
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    spec = RunSpec.read(run_dir)
    # Set by the launcher: which attempt this is, and what to resume from. Requeued
    # attempts always resume "auto" (the newest checkpoint), whatever the first asked.
    ranks = RankEnv.from_environ()
    attempt, resume = ranks.attempt, ranks.resume
    startup = {"entry": start or time.time(), "torch": time.time()}
    flight.arm(run_dir, attempt, ranks.cycle)  # before the process group: see rundir.flight
    report = reporter(ranks)
    report("join", 0)  # the launcher's watchdog gives it watchdog_join_s
    env = init_distributed()
    startup["rendezvous"] = time.time()
    report("setup", 0)
    signal.signal(signal.SIGTERM, _terminated(report))
    stop: StopRequest | None = None
    trainer: Trainer | None = None
    try:
        check_writable(run_dir)
        setup_logging(run_dir, env.rank)
        # Where this start begins in the log, and where it runs: `hpcshard logs` heads each
        # attempt and restart with it and finds a node's ranks by it (rundir.runlogs).
        slurm = current_run()
        log.debug("%s", start_line(attempt, ranks.cycle, os.getpid(), socket.gethostname(),
                                   env.rank // env.per_node, slurm[0] if slurm else None))
        # Before a hung rank is killed, its launcher asks for every thread's stack: where
        # it hung, in its own log. (faulthandler writes from the signal handler itself,
        # so a rank blocked inside a C++ collective still answers.)
        faulthandler.register(STACKS_SIGNAL, file=RunPaths(run_dir).rank_log(env.rank).open("a"),
                              all_threads=True)
        spec.use_code()  # the copy of the code submitted (`cli.snapshot`)
        job = load_job(spec.job)
        cfg = build_config(job.config, kept_sets(spec.sets, spec.resolved.config))
        # (the entry point's lists themselves, even empty: a notice until the handlers are in)
        stop = StopRequest(f"{cfg.stop_signals},{ranks.notice}").install(
            [] if early is None else early, [] if early_at is None else early_at)
        hooks = Hooks(report=report, record=_recorder(run_dir, env.is_main))
        trainer = Trainer(job, cfg, env, run_dir, hooks=hooks, past=_past(run_dir))
        startup["built"] = time.time()
        loaded = trainer.restore(resume)
        startup["loaded"] = time.time()
        if env.is_main:
            _record(run_dir, _started(ranks, env, loaded, trainer.pretrained))
        supervision = SupervisionSection.of(cfg)
        if ranks.cycle == 0 and env.nodes > 1 and supervision.health_link_mb and _slow_link(
                run_dir, env, supervision, attempt):
            return STRAGGLER_EXIT
        summary = trainer.run(stop, startup)
        if summary.reason == "storage":
            _storage_stop(run_dir, ranks, env, summary, trainer)
    except Disowned as err:  # every rank together; nothing more is written to the run
        if env.is_main:
            print(f"hpcshard: {err}", file=sys.stderr, flush=True)
        summary = Summary(step=trainer.step if trainer else 0, loss=float("nan"), eval_loss=None,
                          reason="disowned", saved_step=-1, unigram_entropy=0.0)
    except UserError as err:
        log.debug("user error", exc_info=True)
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
            _end(run_dir, events.End(attempt=attempt, reason=EndReason.ERROR, cycle=ranks.cycle,
                                     user_error=True, error=str(err)))
        return USER_ERROR
    except BaseException as err:
        _failed(run_dir, ranks, env, trainer.step if trainer else None, err)
        raise
    finally:
        report("done", trainer.step if trainer else 0)
        if stop is not None:
            stop.ignore_from_now()
        if dist.is_initialized():
            dist.destroy_process_group()
    _wait_retired(trainer)
    if summary.reason == "straggler":  # not an end: the launchers replace the node
        return STRAGGLER_EXIT
    if summary.reason == "storage":
        return STORAGE_EXIT
    if summary.reason == "disowned":  # (the launcher leaves quietly: no restart, no requeue)
        return 0
    if env.is_main:
        _end(run_dir, events.End(attempt=attempt, reason=events.end_reason(summary.reason),
                                 cycle=ranks.cycle, step=summary.step, saved_step=summary.saved_step))
    if summary.reason == "nonfinite":
        if env.is_main:
            spent = (f" after {trainer.rollbacks} rollback(s), the most nan_rollbacks allows"
                     if trainer is not None and trainer.rollbacks else "")
            print(f"error: the loss or the gradient norm became nan or inf at step {summary.step}"
                  f"{spent}; stopped with no save after it: the newest checkpoint, step "
                  f"{summary.saved_step}, is intact; lower the learning rate or check the data "
                  "(or --set nan_policy=rollback), then hpcshard resume", file=sys.stderr)
        return 1
    if summary.reason == "done" and summary.saved_step != summary.step:
        (log.error if env.is_main else log.debug)(
            "the final checkpoint (step %d) could not be saved; see the errors above", summary.step)
        return 1
    return 0


def _storage_stop(run_dir: Path, ranks: RankEnv, env: DistEnv, summary: Summary, trainer: Trainer) -> None:
    """The run stops for its storage: rank 0 says what is full and how big the next
    checkpoint is (one line) and tries the `end` record (on a full disk it may not land:
    the line is on the console either way). Every rank waits for that before it leaves:
    torchrun tears the others down as soon as one rank exits non-zero."""
    if env.is_main:
        full = trainer.ckpt.full if trainer.ckpt is not None else "the run's storage refused the save"
        fix = trainer.ckpt.fix if trainer.ckpt is not None else FREE
        newest = (f"the newest checkpoint, step {summary.saved_step}, is intact"
                  if summary.saved_step >= 0 else "no checkpoint was saved")
        line = (f"stopped at step {summary.step} for the run's storage: {full}; {newest}; {fix}, "
                f"then hpcshard resume {run_dir}"
                + ("" if trainer.cfg.on_storage_full == "train"
                   else " (--set on_storage_full=train trains on without checkpoints instead)"))
        print(f"error: {line}", file=sys.stderr, flush=True)
        log.debug("%s", line)  # (the log file too, when it takes writes: `hpcshard logs`)
        _end(run_dir, events.End(attempt=ranks.attempt, reason=EndReason.STORAGE, cycle=ranks.cycle,
                                 step=summary.step, saved_step=summary.saved_step, how=line, storage=full))
    dist.barrier()


def _wait_retired(trainer: Trainer | None) -> None:
    """Before the rank leaves (by `os._exit`, which kills threads mid-work): let the
    deletion of checkpoints retired by this run's last saves finish. Bounded by the
    slowest of the last saves, at least store.RETIRE_WAIT_S: deleting a checkpoint is less
    work for the storage than writing it was, and a time-limit stop keeps twice that save
    before the deadline, of which its own save spent one. What is left after the bound
    is `step-N.deleting.tmp`: never loaded, removed by the next start, shown by `ckpt list`."""
    saves = trainer.ckpt.save_seconds[-3:] if trainer is not None and trainer.ckpt is not None else []
    left = store.wait_retired(max([store.RETIRE_WAIT_S, *saves]))
    if left:
        log.warning("retired checkpoints still being deleted as the rank exits: %s (the next "
                    "start removes them)", ", ".join(p.name for p in left))


def _started(ranks: RankEnv, env: DistEnv, loaded: Loaded | None, pretrained: Stored | None) -> events.Start:
    """The attempt's (or cycle's) start, once what it resumes from is loaded."""
    # Which run of which Slurm job: status matches it with accounting (a sweep's task is
    # JOB_TASK, as accounting and the spec name it).
    slurm = current_run()
    return events.Start(
        attempt=ranks.attempt, cycle=ranks.cycle, world=env.world, nodes=env.nodes, host=socket.gethostname(),
        slurm_job=slurm[0] if slurm else events.UNSET, slurm_run=slurm[1] if slurm else events.UNSET,
        resumed_step=loaded.step if loaded else None, resumed_from=loaded.path if loaded else None,
        skipped=[list(s) for s in loaded.skipped] if loaded else [],
        init_from=str(pretrained.path) if pretrained else events.UNSET)


def _slow_link(run_dir: Path, env: DistEnv, cfg: SupervisionSection, attempt: int) -> bool:
    """Time the links between the nodes (runtime.links); True when one node has every link
    under health_link_gbps: it is declared bad (the launchers replace it)."""
    found = links.measure(env, cfg.health_link_mb)
    slowest = min(found, key=lambda link: link.gbps)
    bad = links.culprit(found, cfg.health_link_gbps, env.nodes) if cfg.health_link_gbps else None
    if env.is_main:
        ledger.append(run_dir, events.Links(
            attempt=attempt, cycle=0, mb=cfg.health_link_mb, floor_gbps=cfg.health_link_gbps,
            slowest={"from": slowest.source, "to": slowest.target, "gbps": round(slowest.gbps, 3)},
            links=[[x.source, x.target, round(x.gbps, 3)] for x in found]))
        slow = [x for x in found if x.gbps < cfg.health_link_gbps]
        if slow:
            log.warning("%d link(s) between nodes under health_link_gbps=%g GB/s (slowest: node %d "
                        "-> %d at %.2f GB/s)%s", len(slow), cfg.health_link_gbps, slowest.source,
                        slowest.target, slowest.gbps, f"; every link of node {bad} is: declared "
                        "bad" if bad is not None else "; no single node has only slow links")
        if bad is not None:
            ledger.append(run_dir, events.Straggler(
                attempt=attempt, cycle=0, kind="link", step=0, rank=bad * env.per_node, host="",
                ratio=round(cfg.health_link_gbps / max(slowest.gbps, 1e-9), 2),
                gbps=round(slowest.gbps, 3), floor_gbps=cfg.health_link_gbps, policy="bad_node"))
    return bad is not None


def _past(run_dir: Path) -> Past:
    """The run's rollbacks so far (the ledger's, across restarts and requeues): their
    batches stay skipped and they count against nan_rollbacks."""
    before = [r for r in ledger.read(run_dir) if r["event"] == "rollback"]
    return Past(rollbacks=len(before),
                skipped=frozenset((int(e), int(o)) for r in before for e, o in r["skipped"]))


def _recorder(run_dir: Path, main: bool) -> Callable[[events.Event], None]:
    """Where the Trainer's rollbacks and stragglers go: rank 0's into the ledger (every
    rank sees the same)."""
    def record(event: events.Event) -> None:
        if main:
            _record(run_dir, event)
    return record


def _record(run_dir: Path, record: events.Event) -> None:
    """A ledger record of the run's progress (start, rollback, straggler): tried, never
    fatal. A full disk must not fail the rank over its bookkeeping (the save that
    follows finds the storage's trouble and stops the run with one line)."""
    try:
        ledger.append(run_dir, record)
    except OSError as err:
        log.warning("the ledger's %s record could not be written (%s)", record.KIND, err)


def reporter(ranks: RankEnv) -> Callable[[str, int], None]:
    """This rank's slot on its node's progress board, which its launcher watches. From
    torchrun's variables: it reports before it joins the process group."""
    if not ranks.board:
        return lambda phase, step: None
    local_rank, rank = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("RANK", 0))
    board = Board(Path(ranks.board), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def report(phase: str, step: int) -> None:
        board.publish(local_rank, rank=rank, step=step, phase=phase)
    return report


def _terminated(report: Callable[[str, int], None]) -> Callable[[int, object], None]:
    """SIGTERM (torchrun tearing the ranks down after one failed, a cancel): say so on the
    board, then die of it as before. The launcher then does not take this rank, dead
    beside the one that failed first, for a culprit."""
    def handle(signum: int, _frame: object) -> None:
        report("done", 0)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return handle


def _failed(run_dir: Path, ranks: RankEnv, env: DistEnv, step: int | None, err: BaseException) -> None:
    """Every rank that fails says how, for the launchers to tell a bug in the job (the same
    exception at the same step again) from a fault (a peer that died, a signal). A rank of
    a node that was frozen while the run went on (its peers gone when it is thawed) says
    nothing: the run has moved on."""
    with contextlib.suppress(OSError):
        if launchers.over(run_dir, ranks.attempt, ranks.cycle):
            return
        ledger.append(run_dir, events.RankFailed(
            attempt=ranks.attempt, cycle=ranks.cycle, rank=env.rank, host=socket.gethostname(),
            step=step, error=type(err).__name__,
            message=str(err).strip().splitlines()[0][:300] if str(err).strip() else "",
            log=str(RunPaths(run_dir).rank_log(env.rank))))
    if env.is_main:
        _end(run_dir, events.End(attempt=ranks.attempt, reason=EndReason.ERROR, cycle=ranks.cycle,
                                 error=f"{type(err).__name__}: {err}"))


def _end(run_dir: Path, end: events.End) -> None:
    with contextlib.suppress(OSError):  # an unwritable run dir must not hide the real error
        ledger.append(run_dir, end)


if __name__ == "__main__":
    sys.exit(main())
