"""The fine-tuning example end to end through the real CLI (examples/finetune: a local Llama,
its tokenizer, instruction records): LoRA from init_from on sft data on 1 node of 2 ranks,
preempted and resumed, ends bitwise equal to a run never interrupted; its checkpoints hold
the adapters and their optimizer state, not the frozen base weights, which a resume reads
from init_from again (and refuses from another checkpoint); it exports merged
(from_pretrained, with the tokenizer) and as a PEFT adapter, with the same logits.
(1 x 2, sharded: every rank imports transformers, so a 2 x 2 start costs about 20 CPU-s
more; LoRA's adapters and frozen weights on 2 x 2 HSDP are test_pretrained's.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcshard.rundir import store
from tests.conftest import ROOT, hpcshard, metrics, quiet_env, sets
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load, preempted_once
from tests.distributed.test_runtime_planner import assert_planned
from tests.hf_models import tiny_llama

pytest.importorskip("peft")

STEPS = 12
ADAPTED = 4 * 3  # 4 layers x q, v, down


def lora(root: Path) -> list[str]:
    return sets(steps=STEPS, ckpt_every=1, keep_last=1000, seq_len=128, batch_size=8, warmup_steps=2,
                lr="3e-3", eval_every=6, init_from=root / "base", sft=root / "data.jsonl", lora_rank=8,
                lora_targets="q_proj,v_proj,down_proj")


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What examples/finetune/make_base.py writes: ROOT/base (Llama, tokenizer), ROOT/data.jsonl."""
    root = tmp_path_factory.mktemp("finetune")
    proc = subprocess.run([sys.executable, "examples/finetune/make_base.py", str(root)], cwd=ROOT,
                          env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def reference(example: Path) -> Path:
    run = example / "uninterrupted"
    proc = hpcshard("submit", "--nodes", "1", "--gpus", "2", "jobs/hf_causal_lm.py", "--run-dir", str(run),
                    *lora(example))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_lora_on_instruction_data_learns(reference: Path) -> None:
    """The data report (3000 records, every 20th held out) and a falling held-out loss."""
    recs = metrics(reference)
    start = next(r for r in recs if r.get("event") == "start")
    assert "3000 records" in start["data"] and "every 20th held out (150)" in start["data"], start["data"]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r and "event" not in r]
    assert len(evals) == 2 and evals[-1] < evals[0], evals


def test_a_lora_run_preempted_resumes_bitwise_from_small_checkpoints(example: Path, reference: Path,
                                                                     tmp_path: Path) -> None:
    base = example / "base"
    run = tmp_path / "preempted"
    stop = preempted_once(run, "jobs/hf_causal_lm.py", 3, *lora(example), nodes=1)
    assert stop["saved_step"] < STEPS
    mine, theirs = committed(run), committed(reference)
    assert STEPS in mine and stop["saved_step"] in mine
    for step, path in mine.items():  # the adapters, their AdamW state, data position, RNG
        assert_bitwise_equal(load(path), load(theirs[step]), f"step {step}")
    # What a checkpoint holds: the adapters' A and B, nothing frozen.
    state = load(mine[STEPS])
    weights = [k for k in state["model"]]
    assert len(weights) == 2 * ADAPTED and all(".lora_" in k for k in weights)
    # The planner counts the frozen weights without gradients or AdamW state, and leaves
    # them out of the checkpoint: its per-rank bytes and checkpoint size match the run's.
    # (Its checkpoint estimate to 10%: at 0.4 MB of adapters, DCP's per-item framing, which
    # the planner takes as an average, is half the bytes.)
    assert_planned(reference, 1, 2, ckpt_rel=0.1)
    ckpt = store.inspect(mine[STEPS])
    assert ckpt.manifest["frozen"] > 0 and ckpt.manifest["frozen_from"]
    # smaller than the base weights in bf16 (they alone, rewritten in fp32, would be twice that)
    assert ckpt.bytes < sum(f.stat().st_size for f in base.glob("*.safetensors"))

    # A resume against another base checkpoint is refused: the frozen weights would differ.
    other = tmp_path / "other"  # another model of the same names and shapes
    tiny_llama(other, hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, vocab=512, positions=256,
               shard_size="2MB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, other / f)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    spec = (moved / "spec.json").read_text().replace(str(base), str(other))
    (moved / "spec.json").write_text(spec)
    again = hpcshard("resume", str(moved), "--set", f"steps={STEPS + 2}")
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "is not the checkpoint this run's frozen weights came from" in again.stdout + again.stderr


def test_a_lora_run_exports_merged_and_as_a_peft_adapter(example: Path, reference: Path,
                                                         tmp_path: Path) -> None:
    """--hf writes the base model with the trained adapters merged into their layers (under
    the base model's names: a plain from_pretrained loads it); --adapter writes PEFT's
    format, which PeftModel puts on the init_from model. Both give the same logits, and
    not the base model's (the adapters trained); --out holds the merged weights too."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = example / "base"
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    for flag, out in (("--hf", merged_dir), ("--adapter", adapter_dir)):
        proc = hpcshard("ckpt", "export", str(reference), flag, str(out), "--dtype", "fp32")
        assert proc.returncode == 0, proc.stderr[-3000:]
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))

    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=x).logits.float()  # type: ignore[no-any-return]

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    tok = AutoTokenizer.from_pretrained(merged_dir)  # the run's tokenizer came along
    assert tok.eos_token == "<|eos|>" and tok.chat_template
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 8
    plain = logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    on_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = logits(PeftModel.from_pretrained(on_base, adapter_dir))
    torch.testing.assert_close(logits(merged), adapted, rtol=1e-4, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-3
    out = tmp_path / "w.safetensors"
    assert hpcshard("ckpt", "export", str(reference), "--out", str(out)).returncode == 0
    weights = load_file(out)
    for name, t in merged.state_dict().items():
        assert torch.equal(weights[name], t), name
