"""What a checkpoint holds and how it is gathered: the model and optimizer state dicts
(built once and reused while valid: `TrainState`), every RNG of a rank, the config hash."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from hpcshard.config import TrainConfig

SAVE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Frozen parameters are not saved: they are init_from's or the seed's, rebuilt on resume."""
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
"""...and not expected in a checkpoint (DCP still fails on any other missing tensor: it
loads exactly the names the model asks for)."""


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


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, torch.Tensor):
        return [local(tree)]
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
        return [objects, [local(t).data_ptr() for t in tensors]]

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
            model, optim = get_state_dict(self.model, self.optimizer, options=SAVE_OPTIONS)
            self.kept = (self._identity(), dict(model), dict(optim))  # after its hooks have run
            self.builds += 1
        _, model_state, optim_state = self.kept
        if copy_buffers:
            buffers = {b.data_ptr() for b in self.model.buffers()}
            model_state = {k: v.clone() if isinstance(v, torch.Tensor) and local(v) is v
                           and v.data_ptr() in buffers else v for k, v in model_state.items()}
        groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": kept["params"]}
                  for live, kept in zip(self.optimizer.param_groups, optim_state["param_groups"],
                                        strict=True)]
        return model_state, {"state": optim_state["state"], "param_groups": groups}
