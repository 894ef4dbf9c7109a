"""The trainer in this process on one GPU, where the allocator and the parameters can be
read: CPU offload keeps the parameters in pinned host memory and trains; `hpcshard plan`
against what the GPU holds (the state within 5%, the activations within 20%, the step's
peak within the plan's total)."""

from __future__ import annotations

import dataclasses
import gc
import json
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from hpcshard.config import build_config
from hpcshard.runtime.device import DistEnv
from hpcshard.runtime.job import Job, load_job
from hpcshard.runtime.planner import DTYPES, make_plan, measure
from hpcshard.runtime.train import Trainer
from tests.conftest import ROOT

QUIET = {"eval_every": "0", "log_every": "1000", "data_prefetch": "0", "warmup_steps": "2"}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.timeout(180)
def test_cpu_offload_keeps_parameters_in_pinned_host_memory_and_trains(cuda_world: DistEnv) -> None:
    job = load_job(str(ROOT / "jobs" / "charlm.py"))
    cfg = build_config(job.config, {**QUIET, "precision": "bf16", "cpu_offload": "true", "batch_size": "16"})
    t = Trainer(job, cfg, cuda_world, None)
    try:
        params = [local(p) for p in t.params]
        assert all(p.device.type == "cpu" for p in params), {p.device for p in params}
        assert all(p.is_pinned() for p in params), "offloaded parameters not in pinned memory"
        seen = [t.train_step()[0] for _ in range(20)]
        assert seen[0].device.type == "cuda"  # the step computed on the GPU
        state = [local(v) for s in t.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        assert state and all(v.device.type == "cpu" for v in state), "optimizer state left the host"
        assert all(local(p).device.type == "cpu" and local(p).is_pinned() for p in t.params)
    finally:
        t.batches.close()
    first, last = sum(x.item() for x in seen[:3]) / 3, sum(x.item() for x in seen[-3:]) / 3
    assert last < first - 0.3, [round(x.item(), 3) for x in seen]


LLAMA = {"dim": "512", "n_layers": "4", "n_heads": "8", "vocab_size": "8192", "seq_len": "512",
         "batch_size": "8"}
CASES = {"demo": ("jobs/charlm.py", {}),  # its defaults: 0.88M parameters, 32 x 128 tokens
         "llama": ("bench/llama.py", LLAMA),  # 30M parameters, 8 x 512 tokens
         "llama-ac": ("bench/llama.py", {**LLAMA, "ac": "full"})}


class Probe:
    """Wraps a job's loss: the allocator's figure once the forward and the loss are done
    (every tensor kept for backward is then held, nothing of backward yet)."""

    def __init__(self) -> None:
        self.armed, self.at_loss = False, 0

    def wrap(self, loss: Any) -> Any:
        def measured(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = loss(model, x, y)
            if self.armed and not self.at_loss:
                self.at_loss = torch.cuda.memory_allocated()
            return out
        return measured


def held(job: Job, cfg: Any, env: DistEnv) -> dict[str, int]:
    """Two steps (the optimizer's state and cuBLAS's workspaces exist), then a third with
    the allocator's peak reset: what it held between steps (`base`), after the loss
    (`at_loss`), at its peak, and before the trainer was built."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    probe = Probe()
    t = Trainer(dataclasses.replace(job, loss=probe.wrap(job.loss)), cfg, env, None)
    try:
        t.train_step()
        t.train_step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        probe.armed = True
        t.train_step()
        torch.cuda.synchronize()
        assert t.state_bytes is not None
        return {"before": before, "base": base, "at_loss": probe.at_loss,
                "peak": torch.cuda.max_memory_allocated(), "state": sum(t.state_bytes.values())}
    finally:
        t.batches.close()
        del t
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_the_plan_is_what_one_gpu_holds(case: str, cuda_world: DistEnv, record_property: Any) -> None:
    """The plan (`make_plan`, as `hpcshard plan JOB --nodes 1 --gpus 1` makes it) against
    the trainer on one GPU with the same settings, bf16:

    - state: the parameters, gradients and AdamW moments the rank holds (`state_bytes`,
      the run's "memory" event) within 5% of the plan's;
    - activations: the allocator's growth from between steps to the end of the loss,
      less the parameters FSDP holds gathered then (the root's, and the last block's,
      which is not resharded after forward), within 20% of the tensors the plan counts
      as kept for backward (with AC: the blocks' inputs; the plan's `activations_ac`
      adds one block's recomputation, which happens in backward);
    - the step's peak (`torch.cuda.max_memory_allocated`, less what was allocated before
      the trainer) within the plan's total, reserve included.

    Every figure goes into the JUnit report (property `memory`) and, when a check
    misses, into its message."""
    path, sets = CASES[case]
    sets = {**QUIET, "precision": "bf16", **sets}
    job = load_job(str(ROOT / path))
    cfg = build_config(job.config, sets)
    plan = make_plan(job=str(ROOT / path), sets=sets, numbers={}, hf_config=None, nodes=1, gpus=1,
                     sharding="auto", precision=None, ac=None, micro_batch=None,
                     gpu_mem=torch.cuda.get_device_properties(0).total_memory)
    mode = plan["modes"][plan["sharding"]]
    cbytes = DTYPES["bf16"].itemsize
    shape = measure(job, cfg, plan["micro_batch"], DTYPES["bf16"])
    assert not shape.act_error, shape.act_error
    kept = shape.act_bytes
    if cfg.ac_every():  # forward keeps each checkpointed block's inputs only
        kept -= sum(b - i for b, i in zip(shape.act_block_bytes, shape.act_block_input_bytes, strict=True))
    m = held(job, cfg, cuda_world)
    gathered = (plan["model"]["root_params"] + plan["model"]["max_block_params"]) * cbytes
    figures = {
        "case": case, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "state_measured": m["state"], "state_planned": mode["params"] + mode["grads"] + mode["optimizer"],
        "activations_measured": m["at_loss"] - m["base"] - gathered, "activations_planned": kept,
        "peak_measured": m["peak"] - m["before"],
        "total_planned": mode["total_ac"] if cfg.ac_every() else mode["total"],
        "gathered_at_loss": gathered, "gather_planned": mode["gather"], "reduce_planned": mode["reduce"],
        "reserve_planned": mode["reserve"], **{f"allocated_{k}": v for k, v in m.items()}}
    record_property("memory", json.dumps(figures))
    why = json.dumps(figures, indent=1)
    assert figures["state_measured"] == pytest.approx(figures["state_planned"], rel=0.05), why
    assert figures["activations_measured"] == pytest.approx(kept, rel=0.20), why
    assert figures["peak_measured"] <= figures["total_planned"], why
