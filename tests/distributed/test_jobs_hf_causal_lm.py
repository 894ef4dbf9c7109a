"""jobs/hf_causal_lm.py end to end: `hpcshard submit` on 2 local CPU ranks trains a
transformers Llama built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, hpcshard
from tests.hf_models import tiny_llama

pytest.importorskip("transformers")

LAYERS = 3


SETS = {"steps": 15, "log_every": 5, "warmup_steps": 5, "eval_every": 0, "layers": LAYERS,
        "batch_size": 8, "seq_len": 64,
        # The package's own sources: a small corpus, read faster than the stdlib's.
        "data": ROOT / "hpcshard", "pattern": "*.py"}


def set_args(**values: object) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(run: Path, nodes: int = 1, **extra: object) -> tuple[list[float], dict]:
    proc = hpcshard("submit", "--nodes", str(nodes), "--gpus", "2", "jobs/hf_causal_lm.py",
                    "--run-dir", str(run), *set_args(**{**SETS, **extra}), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = records(run)
    losses = [r["loss"] for r in recs if "loss" in r and "event" not in r]  # "end" repeats it
    return losses, next(r for r in recs if r.get("event") == "start")


@pytest.mark.dist
def test_hf_job_trains_on_two_ranks_and_with_tensor_parallelism(tmp_path: Path) -> None:
    """FSDP over 2 ranks, then the same Llama with tp=2 (transformers' own plan for its
    projections) on 2 nodes, resumed from its step 10 with tp=1 on 1 node: the same losses,
    float reduction order apart (the same data-parallel world of 2 reads the same batches)."""
    losses, start = train(tmp_path / "hf")
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert start["blocks"] == LAYERS
    assert start["world"] == 2
    tp_run = tmp_path / "hf-tp"
    tp_losses, tp_start = train(tp_run, nodes=2, tp=2, ckpt_every=5)
    assert tp_start["mesh"] == [2, 1, 2]  # (replicate 2, shard 1, tp 2)
    assert tp_losses == pytest.approx(losses, rel=1e-4)
    proc = hpcshard("resume", str(tp_run), "--nodes", "1", "--gpus", "2", "--resume", "10",
                    *set_args(tp=1), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = records(tp_run)
    newest = max(i for i, r in enumerate(recs) if r.get("event") == "start")
    assert recs[newest]["first_step"] == 11 and recs[newest]["mesh"] == [2]
    resumed = [r["loss"] for r in recs[newest:] if "loss" in r and "event" not in r]
    assert resumed == pytest.approx(losses[2:], rel=1e-4)


def logits_of(model: Any) -> Any:
    import torch

    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=x).logits.float()


@pytest.mark.dist
def test_a_run_from_a_pretrained_checkpoint_goes_back_to_from_pretrained(tmp_path: Path) -> None:
    """init_from a bf16 Llama in several safetensors files, trained with tp=2, exported with
    --hf: `from_pretrained` loads the directory and gives the logits of the trained weights
    (fp32: exactly; the default dtype is the checkpoint's bf16), config and all."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    base = tmp_path / "base"
    tiny_llama(base, layers=LAYERS)
    run = tmp_path / "run"
    _, start = train(run, init_from=base, tp=2, steps=4, seq_len=32)
    started = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert next(r for r in started if r["event"] == "start")["init_from"] == str(base)
    assert start["mesh"] == [1, 2]

    assert hpcshard("ckpt", "export", str(run), "--out", str(tmp_path / "full.safetensors")).returncode == 0
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=torch.float32)
    trained.load_state_dict(load_file(tmp_path / "full.safetensors"))
    for dtype, shard_size in (("fp32", "60KB"), ("", "5GB")):
        out = tmp_path / f"hf-{dtype or 'default'}"
        args = ["--dtype", dtype] if dtype else []
        proc = hpcshard("ckpt", "export", str(run), "--hf", str(out), "--shard-size", shard_size, *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        loaded = AutoModelForCausalLM.from_pretrained(out)
        config = json.loads((out / "config.json").read_text())
        assert config["use_cache"] is True
        if dtype == "fp32":  # several files with an index, and the very weights trained
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert len(index["weight_map"]) == 3 + 9 * LAYERS
            assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
            assert torch.equal(logits_of(loaded), logits_of(trained))
        else:
            assert config["dtype"] == "bfloat16" and loaded.dtype == torch.bfloat16
            assert (out / "model.safetensors").is_file()
            assert torch.allclose(logits_of(loaded), logits_of(trained), atol=0.05)
    again = hpcshard("ckpt", "export", str(run), "--hf", str(tmp_path / "hf-fp32"))
    assert again.returncode == 2 and "exists; choose a new directory" in again.stderr
