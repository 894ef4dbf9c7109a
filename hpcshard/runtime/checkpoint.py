"""DCP checkpoints with an atomic commit, async saves, and resume that falls back.

Save: rank 0 clears a stale `step-N.tmp`; every rank writes its shards into it with
`dcp.save` (replicated HSDP shards are written once, by one replica); rank 0 then writes
the manifest, renames the directory into place, fsyncs, moves `latest` and retires old
checkpoints. Nothing is ever saved into an existing directory: a crash mid-save into a
complete checkpoint can leave new data under old metadata that loads silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.serialization import config as serialization

from hpcshard import checkpoints as store
from hpcshard.config import TrainConfig

log = logging.getLogger("hpcshard")


def config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:16]


def seed_rank(seed: int, rank: int) -> None:
    """Seed every generator a job may draw from during training, per rank: torch (dropout),
    Python's `random` and numpy's global RNG. Unseeded, their states are OS noise, and a
    job that uses them could not resume exactly."""
    value = seed * 7919 + rank + 1
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


def _one_line(err: BaseException) -> str:
    """The first line of the first rank's error (DCP wraps all ranks' tracebacks)."""
    failures = getattr(err, "failures", None)
    first = next(iter(failures.values())) if failures else err
    if isinstance(first, tuple):
        first = first[0]
    text = str(first).strip().splitlines()
    return f"{type(first).__name__}: {text[0] if text else ''}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, torch.Tensor):
        return [_local(tree)]
    return []


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator that can affect training on this rank."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class Loaded:
    """What a resume found, for the log and the attempts ledger."""

    step: int
    path: str
    skipped: list[tuple[str, str]]
    world_changed: bool


def fast_writes() -> None:
    """DCP writes each tensor with torch.save, which by default also computes a zip CRC32
    over every byte: half of a CPU rank's serialisation time, for a checksum nothing reads
    (torch.load does not verify it; the manifest's sizes catch truncated files). Off for
    this process, a rank: DCP's writes may run in a background thread (async saves)."""
    serialization.save.compute_crc32 = False


def _known_hook(hook: Any) -> bool:
    """State-dict hooks that leave the built dict valid while its tensors are: activation
    checkpointing's (strips its wrapper's prefix from the keys) and FSDP2's pre-save hook
    (makes the registered parameters the sharded ones; `TrainState` rebuilds whenever
    the registered parameters are other objects than when it built)."""
    return (hook is ActivationWrapper._post_state_dict_hook
            or (getattr(hook, "__module__", "").startswith("torch.distributed.fsdp._fully_shard")
                and getattr(hook, "__name__", "") == "to_sharded_hook"))


class TrainState:
    """`get_state_dict(model, optimizer)` for every save, built once and then reused while
    it still holds the very objects training updates in place: FSDP2's sharded parameters
    (their storage too), the buffers and the optimizer's per-parameter state. Building it
    walks every module and maps every parameter to its name: 15-50 ms per save in the
    training thread, most of what an async save blocks training for. The learning rate
    and the other hyperparameters are read fresh each time; any replaced parameter, buffer,
    storage or state value builds it again (the objects themselves are kept and compared,
    so a new object at a freed one's address is not taken for it). Never reused for models
    or optimizers that compute their state dict (extra state, their own `state_dict`,
    state-dict hooks)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.kept: tuple[list[Any], dict[str, Any], dict[str, Any]] | None = None
        self.builds = 0

    def _identity(self) -> list[Any]:
        """Everything the built dict refers to, as objects (compared with `is`), and the
        addresses of the parameters' and buffers' data (compared with ==)."""
        model, optim = self.model, self.optimizer
        tensors = [*model.parameters(), *model.buffers()]
        objects = [*tensors, *(p for g in optim.param_groups for p in g["params"])]
        for param, state in optim.state.items():
            objects += [param, state, *state.values()]
        return [objects, [_local(t).data_ptr() for t in tensors]]

    def _same(self, identity: list[Any]) -> bool:
        assert self.kept is not None
        (objects, ptrs), (kept_objects, kept_ptrs) = identity, self.kept[0]
        return (ptrs == kept_ptrs and len(objects) == len(kept_objects)
                and all(a is b for a, b in zip(objects, kept_objects, strict=True)))

    def _computed(self) -> bool:
        """Would a state dict built now differ from the kept one's objects?"""
        optim = self.optimizer
        if (type(optim).state_dict is not torch.optim.Optimizer.state_dict
                or optim._optimizer_state_dict_pre_hooks or optim._optimizer_state_dict_post_hooks):
            return True
        base = torch.nn.Module
        return any(type(m).get_extra_state is not base.get_extra_state
                   or type(m).state_dict is not base.state_dict
                   or type(m)._save_to_state_dict is not base._save_to_state_dict
                   or not all(map(_known_hook, (*m._state_dict_pre_hooks.values(),
                                                *m._state_dict_hooks.values())))
                   for m in self.model.modules())

    def __call__(self, copy_buffers: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model and optimizer state dicts. `copy_buffers`: the buffers as copies, for a
        save that is written while training goes on (a buffer that the forward pass
        updates in place, such as BatchNorm's statistics, would otherwise be written with
        a later step's values)."""
        if self.kept is None or self._computed() or not self._same(self._identity()):
            model, optim = get_state_dict(self.model, self.optimizer)
            self.kept = (self._identity(), dict(model), dict(optim))  # after its hooks have run
            self.builds += 1
        _, model_state, optim_state = self.kept
        if copy_buffers:
            buffers = {b.data_ptr() for b in self.model.buffers()}
            model_state = {k: v.clone() if isinstance(v, torch.Tensor) and _local(v) is v
                           and v.data_ptr() in buffers else v for k, v in model_state.items()}
        groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": kept["params"]}
                  for live, kept in zip(self.optimizer.param_groups, optim_state["param_groups"],
                                        strict=True)]
        return model_state, {"state": optim_state["state"], "param_groups": groups}


class HandOffStager(DefaultStager):
    """DCP's async stager (copies the state in a background thread), except that the
    copy starts when `start()` is called, once `async_save` has returned, instead of
    inside it: a copy thread started earlier competes with the training thread for the
    interpreter and the cores while training is still waiting on the call."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False))
        self.held: tuple[Future[Any], Any, dict[str, Any]] | None = None

    def stage(self, state_dict: Any, **kwargs: Any) -> Future[Any]:
        done: Future[Any] = Future()
        self.held = (done, state_dict, kwargs)
        self._staging_future = done
        return done

    def start(self) -> None:
        if self.held is None:
            return
        (done, state_dict, kwargs), self.held = self.held, None
        assert self._staging_executor is not None
        try:
            copy = self._staging_executor.submit(self._stage, state_dict, **kwargs)
        except BaseException as err:  # never leave DCP's upload thread waiting on `done`
            done.set_exception(err)
            raise

        def forward(f: Future[Any]) -> None:
            if f.exception() is not None:
                done.set_exception(f.exception())
            else:
                done.set_result(f.result())
        copy.add_done_callback(forward)

    def drop(self, err: BaseException) -> None:
        """async_save failed after staging was asked for: fail the held copy instead."""
        if self.held is not None:
            (done, _, _), self.held = self.held, None
            done.set_exception(err)


def _private_dir(path: Path) -> None:
    """0750 whatever the umask: the loader refuses group-writable checkpoints."""
    path.mkdir(exist_ok=True, mode=0o750)
    path.chmod(0o750)


class PrivateWriter(FileSystemWriter):
    """DCP's file writer, except that rank 0 first clears a stale `step-N.tmp` and creates
    it private (0750), in DCP's first step: before its plan exchange, and so before any
    rank writes, with no collective of hpcshard's own (the broadcast that used to order
    it was training's longest wait in an async save). In an async save this runs in DCP's
    background thread; a failure (a quota, a read-only remount) reaches every rank as
    DCP's error for the save."""

    def __init__(self, tmp: Path, root: Path, main: bool) -> None:
        super().__init__(str(tmp))
        self.tmp, self.root, self.main = tmp, root, main

    def prepare_local_plan(self, plan: Any) -> Any:
        if self.main:
            _private_dir(self.root)
            shutil.rmtree(self.tmp, ignore_errors=True)
            _private_dir(self.tmp)
        return super().prepare_local_plan(plan)


class Checkpointer:
    """Saves and loads one trainer's full state under RUN_DIR/checkpoints."""

    def __init__(self, trainer: Any, run_dir: Path) -> None:
        self.t = trainer
        self.root = run_dir / store.CHECKPOINTS
        self.env = trainer.env
        cfg: TrainConfig = trainer.cfg
        self.cfg = cfg
        # Async saves run their collectives on a gloo group of their own, so they never
        # interleave with training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if cfg.async_save else None
        # Async saves copy the state in a background thread too (no pinned or shared
        # memory: works on CPU): the step only waits for the copy before it changes the
        # parameters (`staged`), so forward and backward overlap it.
        self.stager = HandOffStager() if cfg.async_save else None
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

    # -- what is saved --------------------------------------------------------------

    def _state(self, fresh: bool = False) -> dict[str, Any]:
        """What a save writes; `fresh` for a load, which writes into what it is given."""
        t = self.t
        if fresh:
            model, optim = get_state_dict(t.model, t.optimizer)
        else:
            self.train_state = self.train_state or TrainState(t.model, t.optimizer)
            model, optim = self.train_state(copy_buffers=self.cfg.async_save)
        progress = {"step": t.step, "data": t.batches.state_dict(),
                    "scheduler": t.scheduler.state_dict(), "world": self.env.world}
        if t.scaler is not None:
            progress["scaler"] = t.scaler.state_dict()
        # Per-rank values need per-rank keys: DCP deduplicates equal keys across ranks
        # and would hand every rank one arbitrary rank's copy.
        return {"model": model, "optim": optim, "progress": progress,
                f"rng.rank{self.env.rank}": rng_state(self.env.device)}

    def _apply(self, state: dict[str, Any], saved_world: int) -> None:
        t = self.t
        set_state_dict(t.model, t.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        progress = state["progress"]
        t.step = int(progress["step"])
        t.batches.load_state_dict(progress["data"])
        t.scheduler.load_state_dict(progress["scheduler"])
        if t.scaler is not None and "scaler" in progress:
            t.scaler.load_state_dict(progress["scaler"])
        key = f"rng.rank{self.env.rank}"
        if key in state and self.env.rank < saved_world:
            set_rng_state(state[key], self.env.device)

    # -- save -----------------------------------------------------------------------

    def due(self) -> bool:
        """Is a periodic save due at this step (steps or wall-time trigger)? Rank-local:
        the caller agrees on it with every rank before acting."""
        cfg, step = self.cfg, self.t.step
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            return True
        return bool(cfg.ckpt_minutes) and time.monotonic() - self.last_time >= cfg.ckpt_minutes * 60

    def save(self, reason: str) -> bool:
        """Save the current step. Returns False (state and older checkpoints intact) when
        the write failed, e.g. with no space left on the device."""
        self.wait()
        step = self.t.step
        if step == self.last_saved:
            return True
        tmp = self.root / (store.step_name(step) + store.TMP_SUFFIX)
        writer = PrivateWriter(tmp, self.root, self.env.is_main)
        start = time.perf_counter()
        self.last_time = time.monotonic()
        try:
            if self.cfg.async_save:
                response = dcp.async_save(self._state(), storage_writer=writer, planner=self.planner,
                                          process_group=self.group, async_stager=self.stager)
                future = getattr(response, "upload_completion", response)
                self.staging = getattr(response, "staging_completion", None)
                assert self.stager is not None
                self.stager.start()
                self.pending = (future, step, tmp, start, reason)
                return True
            dcp.save(self._state(), storage_writer=writer, planner=self.planner)
        except BaseException as err:  # CheckpointException is a BaseException
            if self.stager is not None:
                self.stager.drop(err)
            if isinstance(err, KeyboardInterrupt):
                raise
            return self._failed(step, tmp, err)
        return self._commit(step, tmp, start, reason)

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
            return self._failed(step, tmp, err)
        return self._commit(step, tmp, start, reason)

    def _failed(self, step: int, tmp: Path, err: BaseException) -> bool:
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        # Every rank sees the same failure; on a thousand ranks one line is enough.
        (log.error if self.env.is_main else log.debug)(
            "checkpoint at step %d FAILED: %s; training state and earlier checkpoints are "
            "intact", step, self._describe(err))
        log.debug("checkpoint failure", exc_info=err)
        return False

    def _describe(self, err: BaseException) -> str:
        """One line for a failed save. DCP wraps every rank's traceback into one exception,
        and torch.save reports a full disk as "unexpected pos N vs M", so the free space is
        checked against the size of the last checkpoint."""
        text = _one_line(err)
        need = self.last_bytes or sum(t.numel() * t.element_size() for t in
                                      _tensors(self._state())) * self.env.world
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        if free < need:
            return (f"no space left on the device holding {self.root} ({free / 1e6:.1f} MB free, "
                    f"a checkpoint needs about {need / 1e6:.1f} MB) [{text}]")
        return text

    def _commit(self, step: int, tmp: Path, start: float, reason: str) -> bool:
        """Rank 0 makes the checkpoint visible; every rank learns whether that worked."""
        ok = torch.ones(1, device=self.env.device)
        if self.env.is_main:
            try:
                self._publish(step, tmp, time.perf_counter() - start, reason)
            except OSError as err:
                log.error("checkpoint at step %d could not be committed (%s); earlier "
                          "checkpoints are intact", step, err)
                shutil.rmtree(tmp, ignore_errors=True)
                ok.zero_()
        dist.broadcast(ok, src=0)
        if ok.item():
            self.last_saved = step
        return bool(ok.item())

    def _publish(self, step: int, tmp: Path, seconds: float, reason: str) -> None:
        t, env = self.t, self.env
        _, manifest, gone = store.commit(tmp, step, {
            "world": env.world, "nodes": env.nodes, "per_node": env.per_node,
            "mesh": list(t.mesh.shape), "sharding": t.mode, "config_hash": config_hash(self.cfg),
            "config": asdict(self.cfg), "torch": torch.__version__, "reason": reason,
            "save_seconds": round(seconds, 3)}, self.cfg.keep_last, self.cfg.keep_every)
        self.save_seconds.append(seconds)
        self.last_bytes = manifest["bytes"]
        log.info("checkpoint step %d committed (%s, %.1f MB in %.2fs)%s", step, reason,
                 manifest["bytes"] / 1e6, seconds,
                 f"; retired {', '.join(p.name for p in gone)}" if gone else "")

    # -- load -----------------------------------------------------------------------

    def resume(self, how: str) -> Loaded | None:
        """Load the checkpoint `how` names (auto|never|STEP|PATH).

        Rank 0 reads the directory and tells every rank what to load: on a shared
        filesystem another host's listing can lag behind (NFS attribute caching), and
        ranks that loaded different steps would train a mix. On auto, a checkpoint that
        fails to load is skipped for the previous one; damaged ones are renamed aside only
        once an older one has loaded, and if none loads the job stops with the reason
        (a changed model, say) instead of silently training from scratch.
        """
        skipped: list[tuple[str, str]] = []
        failed: list[tuple[store.Checkpoint, str]] = []
        while True:
            path, passed, error = self._decide(how, frozenset(c.path for c, _ in failed))
            if error:
                raise ValueError(error)
            skipped += passed
            if path is None:
                if failed:
                    ckpt, why = failed[0]
                    raise ValueError(f"no checkpoint in {self.root} could be loaded; the newest, "
                                     f"{ckpt.path.name}, failed with: {why}{self._config_note(ckpt)}")
                self._log_skipped(skipped)
                if how == "never":
                    self._supersede(-1)
                return None
            chosen = store.inspect(Path(path))
            store.check_safe(chosen)
            try:
                self._load(chosen)
            except BaseException as err:
                if isinstance(err, KeyboardInterrupt):
                    raise
                why = _one_line(err)
                log.debug("load failure", exc_info=err)
                if how != "auto":
                    raise ValueError(f"checkpoint {chosen.path} failed to load: {why}"
                                     f"{self._config_note(chosen)}") from None
                failed.append((chosen, why))
                skipped.append((chosen.path.name, f"failed to load ({why})"))
                continue
            self._log_skipped(skipped)
            # Damaged and newer than what loaded: renamed aside, or they would collide with
            # the next saves of this timeline.
            self._quarantine([Path(self.root / name) for name, _ in skipped])
            if how != "auto":
                self._supersede(chosen.step)
            world = int(chosen.manifest.get("world", self.env.world))
            log.info("resumed from %s (step %d, written by %d ranks as %s)", chosen.path,
                     chosen.step, world, chosen.manifest.get("mesh"))
            self.last_saved = chosen.step
            return Loaded(step=chosen.step, path=str(chosen.path), skipped=skipped,
                          world_changed=world != self.env.world)

    def _decide(self, how: str, exclude: frozenset[Path],
                ) -> tuple[str | None, list[tuple[str, str]], str]:
        """Rank 0 cleans up interrupted saves and picks; every rank gets the same answer."""
        answer: list[Any] = [None]
        if self.env.is_main:
            try:
                for stale in store.clean_incomplete(self.root):
                    log.warning("removed incomplete checkpoint %s (a save was interrupted)", stale)
                chosen, passed = store.select(self.root, how, exclude)
                answer = [(str(chosen.path) if chosen else None,
                           [(c.path.name, c.problem) for c in passed], "")]
            except ValueError as err:
                answer = [(None, [], str(err))]
        dist.broadcast_object_list(answer, src=0)
        path, passed, error = answer[0]
        return path, list(passed), error

    def _log_skipped(self, skipped: list[tuple[str, str]]) -> None:
        if self.env.is_main:
            for name, why in skipped:
                log.warning("skipped checkpoint %s: %s", name, why)

    def _config_note(self, ckpt: store.Checkpoint) -> str:
        saved = ckpt.manifest.get("config", {})
        changed = sorted(k for k, v in asdict(self.cfg).items() if k in saved and saved[k] != v)
        return f" (config differs from the checkpoint's in: {', '.join(changed)})" if changed else ""

    def _load(self, ckpt: store.Checkpoint) -> None:
        state = self._state(fresh=True)
        saved_world = int(ckpt.manifest.get("world", self.env.world))
        if self.env.rank >= saved_world:  # no RNG was saved for this rank
            state.pop(f"rng.rank{self.env.rank}")
        dcp.load(state, checkpoint_id=str(ckpt.path))
        self._apply(state, saved_world)

    def _supersede(self, step: int) -> None:
        dist.barrier()
        if self.env.is_main:
            moved = store.supersede(self.root, step)
            if moved:
                log.warning("resuming step %d starts a new timeline: moved the newer "
                            "checkpoints %s aside into %s/superseded-*", step, ", ".join(moved),
                            self.root)
        dist.barrier()

    def _quarantine(self, paths: list[Path]) -> None:
        """Damaged checkpoints are renamed `.corrupt` (kept for inspection), so that no
        later attempt trips on them and no new save collides with their names."""
        dist.barrier()
        if self.env.is_main:
            for path in paths:
                if path.parent == self.root and path.is_dir() and not path.name.endswith(store.TMP_SUFFIX):
                    os.replace(path, path.with_name(path.name + ".corrupt"))
        dist.barrier()



# -- the same checkpoints for your own loop ---------------------------------------------

def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a checkpoint of your own loop holds: the model (and optimizer) as DCP state
    dicts (sharded, any mesh), and this rank's RNG under a per-rank key."""
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    state[f"rng.rank{rank}"] = rng_state(_device_of(model))
    return state


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None, keep_last: int = 2) -> Path:
    """Save `step` under ROOT/step-N, on every rank together (collective).

    The shards go into step-N.tmp; once every rank has written, rank 0 adds a manifest
    (with `extra`: JSON values such as the epoch or the data position, rank 0's copy),
    renames it into place, fsyncs and keeps the newest `keep_last`. A crash mid-save
    leaves a .tmp that `load_checkpoint` never reads. Returns the committed directory.
    """
    root = Path(root)
    tmp = root / (store.step_name(step) + store.TMP_SUFFIX)
    final = root / store.step_name(step)
    main = not dist.is_initialized() or dist.get_rank() == 0
    done = [final.is_dir()]  # saved already (a periodic save, then the notice)
    if main and not done[0]:
        root.mkdir(parents=True, exist_ok=True, mode=0o750)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o750)
    if dist.is_initialized():
        dist.broadcast_object_list(done, src=0)  # rank 0's view of the shared directory
    if done[0]:
        return final
    start = time.perf_counter()
    dcp.save(_local_state(model, optimizer), checkpoint_id=str(tmp))
    if main:
        store.commit(tmp, step, {"world": dist.get_world_size() if dist.is_initialized() else 1,
                                 "extra": json.loads(json.dumps(extra or {})),
                                 "torch": torch.__version__,
                                 "save_seconds": round(time.perf_counter() - start, 3)}, keep_last)
    if dist.is_initialized():
        dist.barrier()  # nobody trains on (or exits) before the checkpoint is committed
    return final


def load_checkpoint(root: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    step: int | None = None) -> dict[str, Any] | None:
    """Load the newest committed checkpoint under ROOT (or `step`) into the model and the
    optimizer, on every rank together; restores this rank's RNG. Returns {"step": N,
    "extra": {...}}, or None when ROOT holds no committed checkpoint (a fresh start).

    Rank 0 picks the checkpoint and tells the others (another host's listing of shared
    storage can lag); incomplete and damaged ones are skipped.
    """
    root = Path(root)
    choice: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        ckpt, _ = store.select(root, "auto" if step is None else str(step))
        if ckpt is not None:
            store.check_safe(ckpt)
            choice = [(str(ckpt.path), ckpt.step, ckpt.manifest.get("extra", {}),
                       int(ckpt.manifest.get("world", 1)))]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path, found, extra, saved_world = choice[0]
    state = _local_state(model, optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank >= saved_world:  # no RNG was saved for this rank (a larger world now)
        state.pop(f"rng.rank{rank}")
    dcp.load(state, checkpoint_id=path)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    if f"rng.rank{rank}" in state:
        set_rng_state(state[f"rng.rank{rank}"], _device_of(model))
    return {"step": found, "extra": extra, "path": path}
