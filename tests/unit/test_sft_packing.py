"""Packed fine-tuning records do not attend across their boundaries: jobs/hf_causal_lm.py's
loss hands the records' position ids to the model, and transformers builds a mask from them
that keeps each record to itself, for every model type tried and both CPU kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcshard.config import build_config
from hpcshard.runtime.job import Job, load_job
from hpcshard.runtime.order import positions
from hpcshard.runtime.sft import IGNORE

transformers = pytest.importorskip("transformers")

JOB = Path(__file__).resolve().parents[2] / "jobs" / "hf_causal_lm.py"


@pytest.fixture(scope="module")
def job() -> Job:
    return load_job(str(JOB))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_records_loss_does_not_depend_on_the_record_before_it(job: Job, model_type: str, attn: str) -> None:
    sizes = {"hidden": "32", "heads": "4"} | ({} if model_type == "gpt2" else {"intermediate": "64"})
    cfg = build_config(job.config, {"model_type": model_type, "attn_implementation": attn, "seq_len": "32",
                                    **sizes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        job.model.__globals__["hf_config"](cfg), attn_implementation=attn, dtype=torch.float32)
    model.eval()  # (GPT-2's dropout)
    record = torch.randint(0, 256, (1, 10))
    before = [torch.randint(0, 256, (1, 6)) for _ in range(2)]
    starts = torch.zeros(1, 16, dtype=torch.bool)
    starts[0, [0, 6]] = True
    pos = torch.from_numpy(positions(starts.numpy()))
    assert pos.tolist() == [[*range(6), *range(10)]]
    learnt = torch.cat([torch.full((1, 6), IGNORE), record[:, 1:], torch.full((1, 1), IGNORE)], dim=1)
    packed = [job.loss(model, torch.cat([b, record], dim=1), learnt, positions=pos) for b in before]
    alone = job.loss(model, record, torch.cat([record[:, 1:], torch.full((1, 1), IGNORE)], dim=1))
    assert packed[0].item() == pytest.approx(alone.item(), rel=1e-5)
    assert packed[1].item() == pytest.approx(alone.item(), rel=1e-5)
    # without the position ids the record would see the one before it
    unmasked = [job.loss(model, torch.cat([b, record], dim=1), learnt) for b in before]
    assert unmasked[0].item() != pytest.approx(unmasked[1].item(), rel=1e-5)
