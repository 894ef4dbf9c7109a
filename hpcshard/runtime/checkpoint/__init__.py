"""Checkpoints: `manager` (the trainer's Checkpointer: save, commit, resume), `state`
(what is saved), `io` (how DCP writes it), `own_loop` (save_checkpoint/load_checkpoint for
your own loop). The on-disk store itself (layout, manifest, retention) is torch-free, in
`hpcshard.rundir.store`."""

from hpcshard.runtime.checkpoint.io import HandOffStager, PrivateWriter, fast_writes
from hpcshard.runtime.checkpoint.manager import Checkpointer, Loaded, TrainParts
from hpcshard.runtime.checkpoint.own_loop import load_checkpoint, save_checkpoint
from hpcshard.runtime.checkpoint.state import TrainState, config_hash, rng_state, seed_rank, set_rng_state

__all__ = ["Checkpointer", "HandOffStager", "Loaded", "PrivateWriter", "TrainParts", "TrainState",
           "config_hash", "fast_writes", "load_checkpoint", "rng_state", "save_checkpoint",
           "seed_rank", "set_rng_state"]
