"""The examples run as a user would run them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, hpcshard, quiet_env


def test_own_loop_example_trains_on_two_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "examples/pieces/loop.py", "--steps", "20"], cwd=ROOT,
                          env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_custom_job_example(tmp_path: Path) -> None:
    run = tmp_path / "custom"
    proc = hpcshard("submit", "--gpus", "2", "examples/custom_job/job.py", "--run-dir", str(run),
                    "--set", "steps=12", "--set", "log_every=6", "--set", "data=README.md")
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in recs if r.get("event") == "start")
    assert start["blocks"] == 4  # GatedConv found as the repeated block
    losses = [r["loss"] for r in recs if "loss" in r and "event" not in r]
    assert losses[-1] < losses[0]
    assert "evaluation is off" in (run / "logs" / "rank-0.log").read_text()  # README is small


def test_the_fine_tuning_example_trains_lora_on_instructions_and_exports_for_from_pretrained(
        tmp_path: Path) -> None:
    """examples/finetune: the local base model and instruction data it makes, LoRA on 2x2
    from init_from with sft data (prompts masked), exported merged with the tokenizer:
    from_pretrained and the tokenizer load from the one directory, and the held-out loss
    fell."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = subprocess.run([sys.executable, "examples/finetune/make_base.py", str(tmp_path)], cwd=ROOT,
                          env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, out = tmp_path / "run", tmp_path / "exported"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "2", "jobs/hf_causal_lm.py", "--run-dir", str(run),
                    "--set", f"init_from={tmp_path / 'base'}", "--set", f"sft={tmp_path / 'data.jsonl'}",
                    "--set", "lora_rank=16", "--set", "lora_targets=q_proj,k_proj,v_proj,o_proj",
                    "--set", "lr=3e-3", "--set", "steps=20", "--set", "warmup_steps=2",
                    "--set", "seq_len=128", "--set", "batch_size=8", "--set", "eval_every=10",
                    "--set", "log_every=10")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in recs if r.get("event") == "start")
    assert "3000 records" in start["data"] and "every 20th held out (150)" in start["data"]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r and "event" not in r]
    assert len(evals) == 2 and evals[-1] < evals[0], evals
    assert hpcshard("ckpt", "export", str(run), "--hf", str(out)).returncode == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # the base checkpoint's
    ids = tok("def loads(s):\n    \"\"\"", return_tensors="pt")["input_ids"]
    generated: Any = model.generate(ids, max_new_tokens=4, do_sample=False)  # type: ignore[misc]
    assert generated.shape[1] > ids.shape[1]
