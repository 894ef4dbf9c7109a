"""A Hugging Face Trainer script that knows one callback of hpcshard.

    hpcshard submit --nodes 2 --gpus 8 examples/hf_trainer/train_hf.py -- --max-steps 2000

A tiny Llama built from a config (no download) on random tokens. One callback,
`Hpcshard`, is all it has of hpcshard (and outside hpcshard it does nothing):
- a preemption: the notice (SIGTERM by default for scripts) sets `hpcshard.preemption`'s
  flag; every rank agrees on it at the same step (one tiny all-reduce), saves
  `checkpoint-N` there and ends `train()`; hpcshard requeues the job and the next attempt
  resumes from the newest complete checkpoint. (Trainer's own `enable_jit_checkpoint`
  saves on SIGTERM too, but each rank decides alone: with DDP, ranks that saw the signal a
  step apart deadlocked in the save, once in a CI run here, until the grace period ended
  them with nothing saved.)
- each step, save and evaluation is reported, so that a hung rank is found; a rank that
  crashes is restarted in place (every rank, from that same checkpoint).

On GPUs it shards with FSDP2 through accelerate. On CPU it cannot: accelerate only
turns FSDP on for GPU-like devices (`AcceleratorState` drops the FSDP plugin when the
distributed type is MULTI_CPU, and FSDP1 raises "There are currently no available devices
found"), so here it trains with DDP over gloo. FSDP2 itself runs on CPU; see
examples/own_loop for a plain FSDP2 script.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

try:  # no-ops outside hpcshard's launchers
    from hpcshard.preemption import progress, requested
except ImportError:  # hpcshard not installed
    def progress(step: int, phase: str = "step") -> None:
        pass

    def requested(sync: bool = True) -> bool:
        return False


class RandomTokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 512, seq: int = 32, vocab: int = 256) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


class SlowDown(TrainerCallback):
    """--step-seconds: a pause after each step (to watch a preemption happen on CPU)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
        time.sleep(self.seconds)


class Hpcshard(TrainerCallback):
    """A stop notice, agreed by every rank at the same step: save there and end `train()`.
    Each step, save and evaluation, told to hpcshard's launcher (hang detection)."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **_kwargs: Any) -> None:
        progress(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **_kwargs: Any) -> None:
        if requested():  # every rank, the same answer (an all-reduce of the flag)
            control.should_save = control.should_training_stop = True
        # Trainer's flow callback has just decided what follows this step; a slow save or
        # a long evaluation is then judged by its own limit, not the steps'.
        if control.should_evaluate or control.should_save:
            progress(state.global_step, "eval" if control.should_evaluate else "save")

    def on_evaluate(self, args: Any, state: Any, control: Any, **_kwargs: Any) -> None:
        if control.should_save:
            progress(state.global_step, "save")


def last_complete_checkpoint(out: Path) -> str | None:
    """transformers' get_last_checkpoint, minus checkpoints a kill cut short: their
    `checkpoint-is-incomplete.txt` marker is still there, or the main process never wrote
    `trainer_state.json`, its last file (another rank may have created the directory with
    its RNG state before the main process began: seen when a hung rank was killed)."""
    done = [p for p in out.glob("checkpoint-*")
            if p.name[11:].isdigit() and (p / "trainer_state.json").exists()
            and not (p / "checkpoint-is-incomplete.txt").exists()]
    return str(max(done, key=lambda p: int(p.name[11:]))) if done else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("HPCSHARD_CHECKPOINT_DIR", "hf-out"))
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                         max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)
    gpu = torch.cuda.is_available()
    sharding: dict[str, Any] = ({"fsdp": "full_shard", "fsdp_config": {
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}} if gpu else {})
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=args.logging_steps, save_steps=args.save_steps, report_to=[],
        use_cpu=not gpu, ddp_backend=None if gpu else "gloo", disable_tqdm=True,
        **sharding)
    callbacks: list[TrainerCallback] = [Hpcshard()]
    if args.step_seconds:
        callbacks.append(SlowDown(args.step_seconds))
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(), callbacks=callbacks)
    resume = last_complete_checkpoint(Path(args.out))
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"resumed from {resume}; stopped at step {trainer.state.global_step}/{args.max_steps}",
              flush=True)


if __name__ == "__main__":
    main()
