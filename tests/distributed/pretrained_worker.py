"""init_from on 4 ranks, run as `torchrun --nproc_per_node=4 pretrained_worker.py CKPT BIG OUT`:
a Hugging Face checkpoint loaded into 2x2 HSDP and into tp=2, its logits against
transformers' own forward of the same files, and each rank's peak memory while loading a
larger one. Rank 0 writes the facts to OUT as JSON."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hpcshard.config import build_config  # noqa: E402
from hpcshard.runtime.device import init_distributed  # noqa: E402
from hpcshard.runtime.job import load_job  # noqa: E402
from hpcshard.runtime.train import Trainer  # noqa: E402

JOB = load_job(str(ROOT / "jobs" / "hf_causal_lm.py"))
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes since the last reset)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def trainer(env: Any, ckpt: str, **sets: str) -> Trainer:
    # (no loader thread: the memory test measures the weights' loading, not a thread's arena)
    cfg = build_config(JOB.config, {"init_from": ckpt, "seq_len": "32", "batch_size": "4",
                                    "data_prefetch": "0", **sets})
    return Trainer(JOB, cfg, env, None)


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def logits(t: Trainer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = t.model(input_ids=x, use_cache=False).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def reference(ckpt: str, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=x).logits  # type: ignore[no-any-return]


def main() -> None:
    ckpt, big, out = sys.argv[1:4]
    env = replace(init_distributed(), per_node=2)  # 2 nodes x 2 ranks
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = reference(ckpt, x)
    facts: dict[str, Any] = {}
    for tp in ("1", "2"):
        t = trainer(env, ckpt, tp=tp)
        t.restore("never")
        facts[f"tp{tp}"] = {"max_diff": (logits(t, x) - ref).abs().max().item(),
                            "pretrained": str(t.pretrained.path) if t.pretrained else None}
        del t
    # Frozen parameters and LoRA on 2x2 HSDP.
    for name, sets in (("freeze", {"freeze": "model.embed_tokens.*,model.layers.0.*"}),
                       ("lora", {"lora_rank": "4", "lora_targets": "q_proj,v_proj"})):
        t = trainer(env, ckpt, steps="3", warmup_steps="1", lr="1e-2", **sets)
        t.restore("never")
        # (before any forward: a no-grad one leaves the last block's parameters gathered)
        fixed = {n: local(p).clone() for n, p in t.model.named_parameters() if not p.requires_grad}
        moving = {n: local(p).clone() for n, p in t.model.named_parameters() if p.requires_grad}
        before = logits(t, x)
        for _ in range(3):
            t.train_step()
        named = dict(t.model.named_parameters())
        in_optimizer = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
        facts[name] = {
            "frozen": len(fixed), "trainable": len(moving),
            "frozen_unchanged": all(torch.equal(local(named[n]), v) for n, v in fixed.items()),
            "trainable_changed": sum(not torch.equal(local(named[n]), v) for n, v in moving.items()),
            "optimizer_params": len(in_optimizer), "optimizer_state": len(t.optimizer.state),
            "frozen_in_optimizer": any(id(named[n]) in in_optimizer for n in fixed),
            "start_max_diff": (before - ref).abs().max().item()}
        del t
    # Memory: the larger checkpoint, from model build to loaded, on every rank.
    dist.barrier()
    start, _ = rss()
    reset_peak()
    t = trainer(env, big)
    t.restore("never")
    _, peak = rss()
    shard = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in t.model.parameters())
    full = sum(p.numel() * 4 for p in t.model.parameters())
    mine = torch.tensor([float(peak - start), float(shard)])
    seen = [torch.zeros(2) for _ in range(env.world)]
    dist.all_gather(seen, mine)
    facts["memory"] = {"peak_rise": [s[0].item() for s in seen], "shard": [s[1].item() for s in seen],
                       "full_fp32": full}
    if env.is_main:
        Path(out).write_text(json.dumps(facts))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker(main)
