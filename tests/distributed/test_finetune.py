"""Fine-tuning through the real CLI: LoRA on a Hugging Face checkpoint (init_from) on 2x2,
preempted and resumed, ends bitwise equal to a run never interrupted; its checkpoints hold
the adapters and their optimizer state, not the frozen base weights, which a resume reads
from init_from again (and refuses from another checkpoint)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpcshard.rundir import store
from tests.conftest import hpcshard, sets
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load, preempted_once
from tests.distributed.test_runtime_planner import assert_planned
from tests.hf_models import tiny_llama

pytest.importorskip("peft")

STEPS = 12


def lora(base: Path) -> list[str]:
    return sets(steps=STEPS, ckpt_every=1, keep_last=1000, seq_len=64, warmup_steps=2, lr="1e-2",
                init_from=base, lora_rank=8, lora_targets="q_proj,v_proj,down_proj",
                data=Path(__file__).resolve().parents[2] / "hpcshard", pattern="*.py")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base") / "llama"
    tiny_llama(out, hidden=128, layers=3, intermediate=512, vocab=512, positions=128, shard_size="1MB")
    return out


@pytest.fixture(scope="module")
def reference(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("lora") / "uninterrupted"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "2", "jobs/hf_causal_lm.py", "--run-dir", str(run),
                    *lora(base))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_a_lora_run_preempted_resumes_bitwise_from_small_checkpoints(base: Path, reference: Path,
                                                                     tmp_path: Path) -> None:
    run = tmp_path / "preempted"
    stop = preempted_once(run, "jobs/hf_causal_lm.py", 3, *lora(base))
    assert stop["saved_step"] < STEPS
    mine, theirs = committed(run), committed(reference)
    assert STEPS in mine and stop["saved_step"] in mine
    for step, path in mine.items():  # the adapters, their AdamW state, data position, RNG
        assert_bitwise_equal(load(path), load(theirs[step]), f"step {step}")
    # What a checkpoint holds: the 9 adapters' A and B (3 layers x 3 targets), nothing frozen.
    state = load(mine[STEPS])
    weights = [k for k in state["model"]]
    assert len(weights) == 2 * 9 and all(".lora_" in k for k in weights)
    # The planner counts the frozen weights without gradients or AdamW state, and leaves
    # them out of the checkpoint: its per-rank bytes and checkpoint size match the run's.
    assert_planned(reference, 2, 2)
    ckpt = store.inspect(mine[STEPS])
    assert ckpt.manifest["frozen"] > 0 and ckpt.manifest["frozen_from"]
    # smaller than the base weights in bf16 (they alone, rewritten in fp32, would be twice that)
    assert ckpt.bytes < sum(f.stat().st_size for f in base.glob("*.safetensors"))

    # A resume against another base checkpoint is refused: the frozen weights would differ.
    other = tmp_path / "other"  # the same model, saved in other files
    tiny_llama(other, hidden=128, layers=3, intermediate=512, vocab=512, positions=128, shard_size="2MB")
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    spec = (moved / "spec.json").read_text().replace(str(base), str(other))
    (moved / "spec.json").write_text(spec)
    again = hpcshard("resume", str(moved), "--set", f"steps={STEPS + 2}")
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "is not the checkpoint this run's frozen weights came from" in again.stdout + again.stderr


def test_a_lora_run_exports_merged_and_as_a_peft_adapter(base: Path, reference: Path, tmp_path: Path) -> None:
    """--hf writes the base model with the trained adapters merged into their layers (under
    the base model's names: a plain from_pretrained loads it); --adapter writes PEFT's
    format, which PeftModel puts on the init_from model. Both give the same logits, and
    not the base model's (the adapters trained); --out holds the merged weights too."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

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
