"""DCP checkpoints of a training run with an atomic commit, async saves, and resume that
falls back.

Save: rank 0 clears a stale `step-N.tmp`; every rank writes its shards into it with
`dcp.save` (replicated HSDP shards are written once, by one replica); rank 0 then checks
every file DCP's `.metadata` names against the bytes DCP wrote into it, writes the
manifest, renames the directory into place, fsyncs, moves `latest` and retires old
checkpoints. Nothing is ever saved into an existing directory: a crash mid-save into a
complete checkpoint can leave new data under old metadata that loads silently.

Load: rank 0 picks; every rank loads; the ranks agree on the outcome (`failures`): loaded,
try again (transient), skip to the previous checkpoint (its content), or fail the rank (a
fault: the launchers restart the ranks, the checkpoint is left as it is).

Rank 0 commits, cleans interrupted saves, quarantines and moves checkpoints aside only
while this job owns the run (`guard.disowned`); every rank learns what rank 0 found
(committed, failed, failed for the storage, disowned), so all take the same next step.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.rundir import events, ledger, store
from hpcshard.rundir.spec import trusted_gid
from hpcshard.runtime.checkpoint.failures import (
    LOAD_RETRY_DELAYS_S,
    LoadFault,
    MetadataReader,
    load_agreed,
)
from hpcshard.runtime.checkpoint.guard import (
    FIND,
    FREE,
    Disowned,
    Probe,
    disowned,
    in_a_row,
    probe,
    storage_trouble,
)
from hpcshard.runtime.checkpoint.io import (
    HandOffStager,
    PrivateWriter,
    fast_writes,
    one_line,
    written_by_dcp,
)
from hpcshard.runtime.checkpoint.state import (
    LOAD_OPTIONS,
    SAVE_OPTIONS,
    TrainState,
    config_hash,
    rng_state,
    set_rng_state,
    tensors,
)
from hpcshard.runtime.device import DistEnv
from hpcshard.sections import CheckpointSection

log = logging.getLogger("hpcshard")

COMMITTED, FAILED, FULL, DISOWNED = 1, 0, 2, 3
"""What rank 0 tells every rank of a save: committed; failed (the next save tries again);
failed for the run's storage (full, over quota, read-only, or SAVE_FAILURES_STOP in a
row); not committed because this job no longer owns the run (every rank raises
`Disowned`)."""
SAVE_FAILURES_STOP = 3
"""Saves in a row that fail, for whatever reason, before the run's storage is taken to take
no checkpoint (the storage rule, `on_storage_full`: stop by default). One failure is a
save lost to something passing (a peer lost mid-save, a server's failover): the next
tries again. Two in a row can still be one outage that outlasted a save interval. A third,
after the write probe named nothing, is storage that refuses checkpoints in a way no
errno says (one full Lustre OST that the probe's file missed, a quota that the probe
fitted under): training on would lose everything since the newest checkpoint at the next
fault, and each time-limit requeue would restart from it, up to max_requeues times.
Three is NVIDIA's resiliency extension's bound too (cycles without checkpoint progress).
The count survives restarts and requeues (each resumes from the same checkpoint and fails
the same way, its attempt's training lost, up to max_requeues times): rank 0 records each
failed save in the ledger (`events.SaveFailed`), and the row is those that followed the
checkpoint the ranks resumed from (`ledger.failed_saves`), then this process's own."""


@dataclass
class Loaded:
    """What a resume found, for the log and the attempts ledger."""

    step: int
    path: str
    skipped: list[tuple[str, str]]
    world_changed: bool
    manifest: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's manifest (its layout, config, what its frozen weights came from)."""


@dataclass
class TrainParts:
    """What a checkpoint saves and restores besides the step: the Checkpointer is given
    these, not the trainer. `batches` is the data position (state_dict/load_state_dict)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: Any
    scaler: Any = None
    """A grad scaler (fp16) or None."""
    layout: dict[str, Any] | None = None
    """How the state is sharded (mesh shape, sharding mode), for the manifest."""


class Checkpointer:
    """Saves and loads one run's full state under RUN_DIR/checkpoints."""

    def __init__(self, parts: TrainParts, env: DistEnv, cfg: TrainConfig, run_dir: Path,
                 owner: str = "", newest: int = 0, start: tuple[int, int] = (0, 0)) -> None:
        self.parts, self.env, self.cfg = parts, env, cfg
        """`cfg`: the whole config, saved with each checkpoint (and its hash) and compared
        on resume; what the checkpointer itself does follows its section, `settings`."""
        self.settings = CheckpointSection.of(cfg)
        self.run_dir, self.owner, self.newest = run_dir, owner, newest
        """`owner`: this job's lease token (RankEnv.owner; "": no lease, it always owns);
        `newest`: a restart's newest committed step as the launchers know it (RankEnv)."""
        self.start = start
        """This process's attempt and cycle (RankEnv), for its ledger records."""
        self.root = run_dir / store.CHECKPOINTS
        # Async saves run their collectives on a gloo group of their own, so they never
        # interleave with training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if self.settings.async_save else None
        # Async saves copy the state in a background thread too (no pinned or shared
        # memory: works on CPU): the step only waits for the copy before it changes the
        # parameters (`staged`), so forward and backward overlap it.
        self.stager = HandOffStager() if self.settings.async_save else None
        self.staging: Any = None
        # The state's layout is the same at every save: plan it once (DCP's plan cache; a
        # changed layout is planned again).
        self.planner = DefaultSavePlanner(enable_plan_caching=True)
        fast_writes()
        self.pending: tuple[Any, int, Path, float, str] | None = None
        self.last_saved = -1
        self.last_time = time.monotonic()
        self.save_seconds: list[float] = []
        self.last_bytes = 0
        self.train_state: TrainState | None = None  # built at the first save
        self.full = ""
        """Set when the last save failed for the run's storage (on rank 0: what is wrong,
        one line); "" once a save commits."""
        self.fix = FREE
        """On rank 0, with `full`: what the user does before `hpcshard resume`."""
        self.failures = 0
        """This process's saves in a row that failed (0 once one commits)."""
        self.before: int | None = None
        """On rank 0: saves in a row that failed before this process, the ledger's (read at
        its first failure; 0 once a save commits). With `failures`, SAVE_FAILURES_STOP of
        them are the storage's."""

    # -- what is saved --------------------------------------------------------------

    def _state(self, step: int, fresh: bool = False) -> dict[str, Any]:
        """What a save writes; `fresh` for a load, which writes into what it is given."""
        p = self.parts
        if fresh:
            model, optim = get_state_dict(p.model, p.optimizer, options=SAVE_OPTIONS)
        else:
            self.train_state = self.train_state or TrainState(p.model, p.optimizer)
            model, optim = self.train_state(copy_buffers=self.settings.async_save)
        progress = {"step": step, "data": p.batches.state_dict(),
                    "scheduler": p.scheduler.state_dict(), "world": self.env.world}
        if p.scaler is not None:
            progress["scaler"] = p.scaler.state_dict()
        # Per-rank values need per-rank keys: DCP deduplicates equal keys across ranks
        # and would hand every rank one arbitrary rank's copy.
        return {"model": model, "optim": optim, "progress": progress,
                f"rng.rank{self.env.rank}": rng_state(self.env.device)}

    def _apply(self, state: dict[str, Any], saved_world: int) -> None:
        p = self.parts
        set_state_dict(p.model, p.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=LOAD_OPTIONS)
        progress = state["progress"]
        p.batches.load_state_dict(progress["data"])
        p.scheduler.load_state_dict(progress["scheduler"])
        if p.scaler is not None and "scaler" in progress:
            p.scaler.load_state_dict(progress["scaler"])
        key = f"rng.rank{self.env.rank}"
        if key in state and self.env.rank < saved_world:
            set_rng_state(state[key], self.env.device)

    # -- save -----------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Is a periodic save due at this step (steps or wall-time trigger)? Rank-local:
        the caller agrees on it with every rank before acting."""
        cfg = self.settings
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            return True
        return bool(cfg.ckpt_minutes) and time.monotonic() - self.last_time >= cfg.ckpt_minutes * 60

    def save(self, step: int, reason: str) -> bool:
        """Save the state as of `step`. Returns False (state and older checkpoints intact)
        when the write failed, e.g. with no space left on the device."""
        self.wait()
        if step == self.last_saved:
            return True
        tmp = self.root / (store.step_name(step) + store.TMP_SUFFIX)
        writer = PrivateWriter(tmp, self.root, self.env.is_main)
        start = time.perf_counter()
        self.last_time = time.monotonic()
        try:
            if self.settings.async_save:
                response = dcp.async_save(self._state(step), storage_writer=writer, planner=self.planner,
                                          process_group=self.group, async_stager=self.stager)
                future = getattr(response, "upload_completion", response)
                self.staging = getattr(response, "staging_completion", None)
                assert self.stager is not None
                self.stager.start()
                self.pending = (future, step, tmp, start, reason)
                return True
            dcp.save(self._state(step), storage_writer=writer, planner=self.planner)
        except BaseException as err:  # CheckpointException is a BaseException
            if self.stager is not None:
                self.stager.drop(err)
            if isinstance(err, KeyboardInterrupt):
                raise
            return self._agree(step, tmp, start, reason, err)
        return self._agree(step, tmp, start, reason)

    def staged(self) -> None:
        """Return once an async save has its own copy of the state (call before the
        parameters or the optimizer state change)."""
        if self.staging is not None:
            staging, self.staging = self.staging, None
            staging.result()

    def wait(self) -> bool:
        """Finish an async save: wait for every rank's write, then commit it."""
        if self.pending is None:
            return True
        future, step, tmp, start, reason = self.pending
        self.pending = None
        try:
            self.staged()
            future.result()
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt):
                raise
            return self._agree(step, tmp, start, reason, err)
        return self._agree(step, tmp, start, reason)

    def _agree(self, step: int, tmp: Path, start: float, reason: str,
               err: BaseException | None = None) -> bool:
        """Rank 0 commits the save (`err`: every rank's write failed with it) or finds why
        not; every rank learns the outcome (COMMITTED...), and how long the save took
        (every rank plans a time-limit stop with the same number). One broadcast of the
        same shape on both paths: a rank whose write failed while rank 0's did not still
        meets it, and rank 0's word stands (its commit then finds the file missing)."""
        seconds = time.perf_counter() - start
        told = torch.tensor([FAILED, seconds], dtype=torch.float64, device=self.env.device)
        why = ""  # (rank 0's line for FULL and DISOWNED)
        if self.env.is_main:
            outcome, why = self._settle(step, tmp, seconds, reason, err)
            told[0] = outcome
        elif err is not None:
            log.debug("checkpoint failure", exc_info=err)
        dist.broadcast(told, src=0)
        outcome = int(told[0].item())
        if outcome == DISOWNED:
            raise Disowned(why or "this job no longer owns the run; it stops without committing")
        if outcome == COMMITTED:
            self.last_saved, self.before = step, 0
            self.save_seconds.append(float(told[1].item()))
        self.failures = 0 if outcome == COMMITTED else self.failures + 1
        self.full = (why or "the run's storage takes no checkpoint") if outcome == FULL else ""
        return outcome == COMMITTED

    def _settle(self, step: int, tmp: Path, seconds: float, reason: str,
                err: BaseException | None) -> tuple[int, str]:
        """Rank 0's part of `_agree` (the outcome, and the line of a FULL or DISOWNED), which
        must never raise on rank 0 alone (the others would wait in the broadcast). Nothing
        is committed or removed unless this job still owns the run: a `step-N.tmp` of a job
        that was taken over is left for the new owner's next start to clean (it may be the
        new owner's own save of that step)."""
        try:
            gone = disowned(self.run_dir, self.owner, "committing")
        except OSError as failed:  # the lease could not be read: nothing is committed now
            log.error("checkpoint at step %d NOT committed: whether this job still owns %s could "
                      "not be read (%s); earlier checkpoints are intact", step, self.run_dir, failed)
            return FAILED, ""
        if gone:
            return DISOWNED, gone
        if err is None:
            try:
                self._publish(step, tmp, seconds, reason)
                return COMMITTED, ""
            except (OSError, store.Incomplete) as failed:
                # A file missing here was removed after DCP wrote it: by a second job's
                # start on this run directory (it cleans every step-N.tmp), or by hand.
                err = failed
                log.error("checkpoint at step %d NOT committed (%s); earlier checkpoints are "
                          "intact%s", step, failed, "; is a second job using this run directory?"
                          if isinstance(failed, store.Incomplete) else "")
        return self._failed(step, tmp, reason, err)

    def _failed(self, step: int, tmp: Path, reason: str, err: BaseException) -> tuple[int, str]:
        """Rank 0's part of `_agree` after a save that failed with `err`: probe the storage,
        remove the failed save, judge (`_classify`) and record it (`_record`). Never raises:
        the others wait in `_agree`'s broadcast."""
        probed = Probe()
        try:
            try:  # before the failed save is removed: under a quota its bytes are what fills it
                probed = probe(self.root, err)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.debug("checkpoint failure", exc_info=err)
            judged = self._classify(step, err, reason, probed)
        except Exception as judging:
            log.error("checkpoint at step %d FAILED: %s (and judging why failed: %s); training "
                      "state and earlier checkpoints are intact", step, one_line(err), judging)
            judged = FAILED, ""
        self._record(step, err, probed)
        return judged

    def _classify(self, step: int, err: BaseException, reason: str, probed: Probe) -> tuple[int, str]:
        """FULL and what is wrong when the storage took no save (with the failed one
        removed: what it lacks for the next), or when SAVE_FAILURES_STOP saves in a row
        failed, else FAILED; one line either way (DCP wraps every rank's traceback into one
        exception). Where the run stops for it (stop mode; a stop's or the end's save) its
        own last line says it on the console."""
        full, row = storage_trouble(err, self.root, self._next_bytes(step), probed), self._row() + 1
        self.fix = FREE
        if not full and row >= SAVE_FAILURES_STOP:
            full, self.fix = in_a_row(row, err, self.root, probed), FIND
        if not full:
            found = probed.words(self.root)
            log.error("checkpoint at step %d FAILED: %s%s; training state and earlier checkpoints "
                      "are intact; %d in a row (%d are the storage's)", step, one_line(err),
                      f" ({found})" if found else "", row, SAVE_FAILURES_STOP)
            return FAILED, ""
        training_on = self.settings.on_storage_full == "train" and reason == "periodic"
        (log.warning if training_on else log.debug)(
            "checkpoint at step %d FAILED: %s [%s]; training state and earlier checkpoints are "
            "intact%s", step, full, one_line(err),
            "; training on without it (on_storage_full=train)" if training_on else "")
        return FULL, full

    def _row(self) -> int:
        """Saves in a row that failed before this one: the ledger's before this process (its
        records that followed the checkpoint it resumed from: `ledger.failed_saves`), then
        its own. A ledger that cannot be read counts this process's alone (read again at
        the next failure)."""
        if self.before is None:
            try:
                self.before = len(ledger.failed_saves(ledger.read(self.run_dir), self.last_saved))
            except (OSError, ValueError) as err:
                log.warning("the failed saves before this start could not be counted (%s): "
                            "counting this start's own", err)
                return self.failures
        return self.before + self.failures

    def _record(self, step: int, err: BaseException, probed: Probe) -> None:
        """The failed save in the ledger, for the starts after this one to count (`_row`).
        Tried, never fatal: storage that refuses it is what the save failed on, and this
        process counts its own failures either way."""
        attempt, cycle = self.start
        try:
            ledger.append(self.run_dir, events.SaveFailed(
                attempt=attempt, cycle=cycle, step=step, since=self.last_saved,
                error=one_line(err)[:300], probe=probed.brief))
        except Exception as refused:  # (OSError, a lock that timed out or was broken)
            log.warning("the failed save at step %d could not be recorded in the ledger (%s): a "
                        "restart or requeue will not count it", step, one_line(refused))

    def _next_bytes(self, step: int) -> int:
        """About how big the next checkpoint is: this run's last one, else the newest on
        disk, else the state's tensors on every rank (replicas counted: at most that)."""
        if self.last_bytes:
            return self.last_bytes
        try:
            newest = store.committed(self.root)
        except OSError:
            newest = []
        if newest and newest[-1].bytes:
            return newest[-1].bytes
        # What this rank holds, without building the state dict (no collective: rank 0
        # alone asks), on every rank.
        held = {"model": dict(enumerate(self.parts.model.parameters())),
                "optim": dict(enumerate(self.parts.optimizer.state.values()))}
        return sum(t.numel() * t.element_size() for t in tensors(held)) * self.env.world

    def _publish(self, step: int, tmp: Path, seconds: float, reason: str) -> None:
        env = self.env
        _, manifest, gone = store.commit(tmp, step, {
            "world": env.world, "nodes": env.nodes, "per_node": env.per_node,
            **(self.parts.layout or {}), "config_hash": config_hash(self.cfg),
            "config": asdict(self.cfg), "torch": torch.__version__, "reason": reason,
            "save_seconds": round(seconds, 3)}, self.settings.keep_last, self.settings.keep_every,
            least=written_by_dcp(tmp))
        self.last_bytes = manifest["bytes"]
        log.info("checkpoint step %d committed (%s, %.1f MB in %.2fs)%s", step, reason,
                 manifest["bytes"] / 1e6, seconds,
                 f"; retired {', '.join(p.name for p in gone)}" if gone else "")

    # -- load -----------------------------------------------------------------------

    def resume(self, how: str, *, reader: bool = False) -> Loaded | None:
        """Load the checkpoint `how` names (auto|never|STEP|PATH).

        `reader`: a process beside the run, not the run (`runtime.evaluate`, a `--then
        eval` step, while a resumed run may be saving): it loads and changes nothing in the
        checkpoint directory (no interrupted save cleaned, no newer step moved aside, none
        renamed damaged).

        Rank 0 reads the directory and tells every rank what to load: on a shared
        filesystem another host's listing can lag behind (NFS attribute caching), and
        ranks that loaded different steps would train a mix. On auto, a checkpoint whose
        content does not load is skipped for the previous one; damaged ones are renamed
        aside only once an older one has loaded, and if none loads the job stops with the
        reason (a changed model, say) instead of silently training from scratch. A
        transient error is tried again; one that persists, or a fault, fails the rank
        (`LoadFault`) and leaves every checkpoint as it is.
        """
        skipped: list[tuple[str, str]] = []
        failed: list[tuple[store.Checkpoint, str]] = []
        while True:
            chosen, passed = self._decide(how, frozenset(c.path for c, _ in failed), reader)
            skipped += passed
            if chosen is None:
                if failed:
                    ckpt, why = failed[0]
                    raise UserError(f"no checkpoint in {self.root} could be loaded; the newest, "
                                    f"{ckpt.path.name}, failed with: {why}{self._config_note(ckpt)}")
                self._log_skipped(skipped)
                if how == "never" and not reader:
                    self._supersede(-1)
                return None
            why = load_agreed(chosen.path, partial(self._load, chosen), self.env)
            if why:
                if how != "auto":
                    raise UserError(f"checkpoint {chosen.path} failed to load: {why}"
                                    f"{self._config_note(chosen)}")
                failed.append((chosen, why))
                skipped.append((chosen.path.name, f"failed to load ({why})"))
                continue
            self._log_skipped(skipped)
            # Damaged and newer than what loaded: renamed aside, or they would collide with
            # the next saves of this timeline.
            if not reader:
                self._quarantine([Path(self.root / name) for name, _ in skipped])
            if how != "auto" and not reader:
                self._supersede(chosen.step)
            world = int(chosen.manifest.get("world", self.env.world))
            log.info("resumed from %s (step %d, written by %d ranks as %s)", chosen.path,
                     chosen.step, world, chosen.manifest.get("mesh"))
            self.last_saved = chosen.step
            return Loaded(step=chosen.step, path=str(chosen.path), skipped=skipped,
                          world_changed=world != self.env.world, manifest=chosen.manifest)

    def _decide(self, how: str, exclude: frozenset[Path], reader: bool = False,
                ) -> tuple[store.Checkpoint | None, list[tuple[str, str]]]:
        """Rank 0 cleans up interrupted saves, picks and checks; every rank gets the same
        answer, or the same error: a `UserError` (a step that is not there, a checkpoint
        others can write), a `LoadFault` (the directory could not be read) or `Disowned`."""
        answer: list[Any] = [None]
        if self.env.is_main:
            answer = [self._pick(how, exclude, reader)]
        dist.broadcast_object_list(answer, src=0)
        chosen, passed, error, kind = answer[0]
        if error:
            raise {"fault": LoadFault, "disowned": Disowned}.get(kind, UserError)(error)
        return chosen, list(passed)

    def _pick(self, how: str, exclude: frozenset[Path], reader: bool = False) -> tuple[Any, ...]:
        """Rank 0's part of `_decide`, which must never raise on rank 0 alone (the others
        would wait in the broadcast): (chosen, skipped, error, kind of error: "" for a
        user error, fault, disowned). Interrupted saves are cleaned only while this job
        owns the run (a `step-N.tmp` may be the new owner's save in progress). An
        unreadable directory (ESTALE, EIO) is looked at again after each of
        LOAD_RETRY_DELAYS_S."""
        delays = iter(LOAD_RETRY_DELAYS_S)
        while True:
            try:
                gone = disowned(self.run_dir, self.owner, "cleaning or loading anything")
                if gone:
                    return None, [], gone, "disowned"
                for stale in [] if reader else store.clean_incomplete(self.root):
                    log.warning("removed incomplete checkpoint %s (a save was interrupted)", stale)
                chosen, passed = store.select(self.root, how, exclude, newest=self.newest)
                if chosen is not None:
                    store.check_safe(chosen, trusted_gid(self.root.parent))
                return chosen, [(c.path.name, c.problem) for c in passed], "", ""
            except ValueError as err:  # hpcshard's own checks (UserError; check_safe's)
                return None, [], str(err), ""
            except OSError as err:
                delay = next(delays, None)
                if delay is None:
                    return None, [], f"the checkpoints in {self.root} could not be read: {err}", "fault"
                log.warning("the checkpoints in %s could not be read (%s); looking again in "
                            "%.0f s", self.root, err, delay)
                time.sleep(delay)
            except Exception as err:  # a bug: every rank fails with it, none waits for rank 0
                log.error("choosing the checkpoint in %s failed", self.root, exc_info=err)
                return None, [], f"choosing the checkpoint in {self.root} failed: {one_line(err)}", "fault"

    def _log_skipped(self, skipped: list[tuple[str, str]]) -> None:
        if self.env.is_main:
            for name, why in skipped:
                log.warning("skipped checkpoint %s: %s", name, why)

    def _config_note(self, ckpt: store.Checkpoint) -> str:
        saved = ckpt.manifest.get("config", {})
        changed = sorted(k for k, v in asdict(self.cfg).items() if k in saved and saved[k] != v)
        return f" (config differs from the checkpoint's in: {', '.join(changed)})" if changed else ""

    def _load(self, ckpt: store.Checkpoint, reader: MetadataReader) -> None:
        state = self._state(0, fresh=True)
        saved_world = int(ckpt.manifest.get("world", self.env.world))
        if self.env.rank >= saved_world:  # no RNG was saved for this rank
            state.pop(f"rng.rank{self.env.rank}")
        dcp.load(state, storage_reader=reader)
        self._apply(state, saved_world)

    def _supersede(self, step: int) -> None:
        def move() -> None:
            moved = store.supersede(self.root, step)
            if moved:
                log.warning("resuming step %d starts a new timeline: moved the newer "
                            "checkpoints %s aside into %s/superseded-*", step, ", ".join(moved),
                            self.root)
        self._on_main(move, "moving checkpoints aside")

    def _quarantine(self, paths: list[Path]) -> None:
        """Damaged checkpoints are renamed `.corrupt` (kept for inspection), so that no
        later attempt trips on them and no new save collides with their names."""
        def rename() -> None:
            for path in paths:
                if path.parent == self.root and path.is_dir() and not path.name.endswith(store.TMP_SUFFIX):
                    os.replace(path, path.with_name(path.name + store.CORRUPT))
        self._on_main(rename, "renaming damaged checkpoints aside")

    def _on_main(self, act: Callable[[], None], doing: str) -> None:
        """Once every rank is done reading: rank 0 does `act` (it moves checkpoints) if this
        job still owns the run; every rank learns how that went and raises the same error,
        `Disowned`, or `LoadFault` where the file system refused (rank 0 alone raising would
        leave the others waiting in a collective)."""
        dist.barrier()
        answer: list[Any] = [("", "")]
        if self.env.is_main:
            try:
                gone = disowned(self.run_dir, self.owner, doing)
                if not gone:
                    act()
                answer = [("disowned", gone) if gone else ("", "")]
            except OSError as err:
                answer = [("fault", f"{doing} in {self.root} failed: {err}")]
        dist.broadcast_object_list(answer, src=0)
        kind, why = answer[0]
        if kind:
            raise (Disowned if kind == "disowned" else LoadFault)(why)

