"""torchtitan's own trainer on bench/llama.py's shape, for `python -m bench gpu`: its
`Trainer` and `JobConfig` (torchtitan 0.2), its llama3 model (`Transformer`) with the
Llama's sizes (dim, layers, heads, vocabulary, the SwiGLU width rule, rope base 10000,
untied head: the same parameter count), the same batch and sequence length, its own
fused AdamW, LR schedule, gradient clipping and metrics. Nothing of torchtitan is
changed on a GPU; what is ours: a train spec registered under another name (and, where
`datasets` or TensorBoard do not import, stand-ins for them: `stand_ins`), so that

- the data is synthetic (uniform random tokens on the host, a generator per run): the
  llama3 spec's loader wants a tokenizer and the c4 data set on disk (its `c4_test` sits
  in torchtitan's repository, not in its wheel) and there is no network on the GPU
  machine; drawing a batch of 8 x 2049 takes about 70 us on a CPU core, against a
  step of about a quarter of a second for this shape on an H200 (hpcshard's record);
- its metrics logger also prints each logged record as a JSON line (the figures are
  torchtitan's own: tokens/s per device, `mfu(%)` from its flops count and peak table,
  the allocator's peak active bytes).

On one GPU torchtitan does not shard: `fully_shard` is applied only when the shard
degree is above 1, and a single device trains fp32 parameters under bf16 autocast
(`training.mixed_precision_param`). That is its path on one GPU, and what this measures
beside hpcshard's (bf16 parameters through FSDP2 on a 1-rank mesh).

Prints one JSON line per logged step and a last line with `"summary": true`: the median
tokens/s and MFU of the records after the warm-up, torchtitan's flops per token, the
parameter count and the peak.

    python -m bench.titan --dim 2048 --layers 16 --heads 16 --seq 2048 --batch 8 --steps 30 --warmup 10

`--cpu` is for checking this path where there is no GPU (torchtitan 0.2 takes CUDA when
it finds no accelerator): before torchtitan is imported, the CPU is made its device type
(gloo, bf16 autocast on the CPU, a peak memory of 0). Its figures are not benchmarks;
torchtitan's import also wants Triton there (its MoE kernels are imported at import)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import types
from typing import Any

SPEC = "hpcshard_bench_llama"
RECORDS: list[dict[str, Any]] = []
"""What torchtitan's metrics processor logged, in order."""


def cpu_shim() -> None:
    """torchtitan 0.2 reads its device type once, at import (`tools/utils.py`: the
    available accelerator, else "cuda"), and asks that device's module for names, memory
    statistics and peaks. Answer "cpu", and give `torch.cpu` what it asks for."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[attr-defined]
    answers: dict[str, Any] = {
        "get_device_name": lambda *a: "cpu",
        "get_device_properties": lambda *a: argparse.Namespace(total_memory=1),
        "memory_stats": lambda *a: dict.fromkeys(("active_bytes.all.peak", "reserved_bytes.all.peak",
                                                   "num_alloc_retries", "num_ooms"), 0),
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda *a: None,
    }
    for name, fn in answers.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    # a barrier's device_ids are indices (torch.cpu's answer is the string "cpu")
    torch.cpu.current_device = lambda: 0  # type: ignore[assignment,return-value]


def stand_ins() -> list[str]:
    """torchtitan 0.2 imports `datasets` (its Hugging Face loader) and
    `torch.utils.tensorboard` (its TensorBoard logger) at module level; this bench uses
    neither. Where one does not import (a GPU machine's image need not have them), put a
    stand-in in its place that fails if anything uses it. Returns the names stood in for."""

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a stand-in of bench.titan: this bench does not use it")

    made = []
    try:
        import datasets  # noqa: F401
    except ImportError:
        root, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        root.__dict__.update(Dataset=type("Dataset", (), {}), load_dataset=unused, distributed=dist)
        dist.__dict__.update(split_dataset_by_node=unused)
        sys.modules.update({"datasets": root, "datasets.distributed": dist})
        made.append("datasets")
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        board = types.ModuleType("torch.utils.tensorboard")
        board.__dict__.update(SummaryWriter=unused)
        sys.modules["torch.utils.tensorboard"] = board
        made.append("tensorboard")
    return made


def register(args: argparse.Namespace) -> None:
    """The llama3 spec with the bench's model, a synthetic loader, no tokenizer, and a
    metrics processor whose logger also prints JSON lines."""
    import dataclasses

    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import BaseLogger, build_metrics_processor
    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import register_train_spec

    class Synthetic(BaseDataLoader):
        def __init__(self, batch: int, seq: int, vocab: int) -> None:
            self.batch, self.seq, self.vocab = batch, seq, vocab
            self.gen = torch.Generator().manual_seed(0)

        def __iter__(self):  # type: ignore[no-untyped-def]
            while True:
                tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    class Lines(BaseLogger):
        def __init__(self, inner: BaseLogger) -> None:
            self.inner = inner

        def log(self, metrics: dict[str, Any], step: int) -> None:
            self.inner.log(metrics, step)
            RECORDS.append({"step": step, **metrics})
            print(json.dumps(RECORDS[-1]), flush=True)

        def close(self) -> None:
            self.inner.close()

    def loader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any) -> BaseDataLoader:
        t = job_config.training
        return Synthetic(t.local_batch_size, t.seq_len, args.vocab)

    def metrics(job_config: Any, parallel_dims: Any, model_args: Any = None) -> Any:
        processor = build_metrics_processor(job_config, parallel_dims, model_args)
        processor.logger = Lines(processor.logger)
        return processor

    model_args = llama3.TransformerModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                             vocab_size=args.vocab, multiple_of=256, rope_theta=10000.0)
    spec = dataclasses.replace(llama3.get_train_spec(), model_args={"bench": model_args},
                               build_dataloader_fn=loader, build_tokenizer_fn=None,
                               build_metrics_processor_fn=metrics, build_validator_fn=None)
    register_train_spec(SPEC, spec)


def job_config(args: argparse.Namespace, dump: str) -> Any:
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args([
        "--job.dump_folder", dump, "--model.name", SPEC, "--model.flavor", "bench",
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq),
        "--training.steps", str(args.steps), "--training.seed", "0",
        "--lr_scheduler.warmup_steps", str(args.warmup), "--optimizer.lr", str(args.lr),
        "--metrics.log_freq", str(args.log_every), "--metrics.disable_color_printing",
        "--activation_checkpoint.mode", args.ac, "--checkpoint.no-enable",
        "--comm.init_timeout_seconds", "120"])


def summary(lines: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    after = [r for r in lines if r["step"] > warmup]
    if not after:
        raise RuntimeError(f"no record after step {warmup} (records at {[r['step'] for r in lines]})")
    return {"summary": True, "records": len(after),
            "tokens_per_s": statistics.median(r["throughput(tps)"] for r in after),
            "mfu": statistics.median(r["mfu(%)"] for r in after) / 100,
            "peak_mem_gb": max(r["memory/max_active(GiB)"] for r in after)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.titan", description=__doc__.split("\n\n")[0])
    for name, default in (("dim", 2048), ("layers", 16), ("heads", 16), ("vocab", 32000), ("seq", 2048),
                          ("batch", 8), ("steps", 30), ("warmup", 10), ("log-every", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    p.add_argument("--cpu", action="store_true", help="check the path on CPU (figures are not benchmarks)")
    args = p.parse_args(argv)
    if args.cpu:
        cpu_shim()
    # one process is the whole world: what torchrun would have set
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")}.items():
        os.environ.setdefault(k, v)
    from importlib.metadata import version

    import torch

    standing_in = stand_ins()
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    register(args)
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-titan-") as dump:
        trainer = Trainer(job_config(args, dump))
        try:
            params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
            flops = trainer.metrics_processor.num_flops_per_token
            trainer.train()
        finally:
            trainer.close()
            torch.distributed.destroy_process_group()
    out = {**summary(RECORDS, args.warmup), "flops_per_token": flops, "params": params,
           "torchtitan": version("torchtitan"),
           "stand_ins": standing_in, "device": "cpu" if args.cpu else "cuda"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
