"""One measurement of `bench.pretrained`, in a process of its own so that its peak memory
is its own: `python -m bench.hf_worker KIND ARGS... OUT`. Peak is resident memory (VmHWM,
reset after the imports; memory-mapped file pages included) above what the process held
before the measured work; time is wall time of that work.

    load-sharded DIR OUT       under torchrun: build the model on the meta device, shard it
                               (2x2 HSDP), read DIR into it (init_from); every rank's figures
    load-hf DIR OUT            transformers' from_pretrained(DIR) in fp32, one process
    export RUN DIR SIZE OUT    hpcshard's `ckpt export RUN --hf DIR --shard-size SIZE --dtype bf16`
                               (its imports and the meta-device model built first: one-off
                               costs, about 130 MB here, as save-hf's model is held first)
    save-hf DIR OUT2 SIZE OUT  from_pretrained(DIR), then save_pretrained(OUT2, max_shard_size=SIZE):
                               the save measured (the model already held, as an export holds it)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def rss() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def measured(work: Any) -> dict[str, float]:
    start, _ = rss()
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    work()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_rise": rss()[1] - start}


def load_sharded(ckpt: str, out: str) -> None:
    from dataclasses import replace

    import torch.distributed as dist

    from hpcshard.config import build_config
    from hpcshard.runtime.device import init_distributed
    from hpcshard.runtime.job import load_job
    from hpcshard.runtime.train import Trainer

    job = load_job(str(Path(__file__).resolve().parents[1] / "jobs" / "hf_causal_lm.py"))
    env = replace(init_distributed(), per_node=2)
    cfg = build_config(job.config, {"init_from": ckpt, "seq_len": "64", "batch_size": "4"})
    held: dict[str, Any] = {}

    def work() -> None:
        t = Trainer(job, cfg, env, None)
        t.restore("never")
        held["shard"] = sum(p.to_local().nbytes for p in t.model.parameters())  # type: ignore[attr-defined]

    facts = measured(work)
    mine = torch.tensor([facts["seconds"], float(facts["peak_rise"]), float(held["shard"])])
    seen = [torch.zeros(3, dtype=torch.float64) for _ in range(env.world)]
    dist.all_gather(seen, mine.double())
    if env.is_main:
        Path(out).write_text(json.dumps({"seconds": [s[0].item() for s in seen],
                                         "peak_rise": [s[1].item() for s in seen],
                                         "shard": [s[2].item() for s in seen]}))
    dist.destroy_process_group()


def main(kind: str, *args: str) -> None:
    if kind == "load-sharded":
        load_sharded(*args)
        return
    from transformers import AutoModelForCausalLM

    out = args[-1]
    if kind == "load-hf":
        facts = measured(lambda: AutoModelForCausalLM.from_pretrained(args[0], dtype=torch.float32))
    elif kind == "export":
        from hpcshard.runtime.export import _checkpoint, export_hf

        run, target, size = args[:3]
        _checkpoint(Path(run), None)  # transformers' and peft's modules imported, as for save-hf
        facts = measured(lambda: export_hf(Path(run), None, Path(target), "bf16", size))
    elif kind == "save-hf":
        model = AutoModelForCausalLM.from_pretrained(args[0], dtype=torch.bfloat16)
        facts = measured(lambda: model.save_pretrained(args[1], max_shard_size=args[2]))
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    Path(out).write_text(json.dumps(facts))


if __name__ == "__main__":
    main(*sys.argv[1:])
