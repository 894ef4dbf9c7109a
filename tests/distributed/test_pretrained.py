"""init_from on 4 ranks: a Hugging Face checkpoint (bf16, several safetensors files) read into
2x2 HSDP and into tp=2 gives transformers' own logits; no rank ever holds the model whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import quiet_env
from tests.hf_models import tiny_llama

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("pretrained_worker.py")
BUFFER = 8192 * 256 * 2  # the largest tensor, the embedding, in bf16: one read buffer at most


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pretrained")
    tiny_llama(root / "small")
    # ~8M parameters (33 MB in fp32, 16 MB of bf16 files): large enough to see memory
    tiny_llama(root / "big", hidden=256, layers=4, intermediate=1024, vocab=8192, shard_size="5MB")
    out = root / "facts.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=4", str(WORKER), str(root / "small"), str(root / "big"),
                           str(out)], env=quiet_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_a_hugging_face_checkpoint_loads_into_the_sharded_model(facts: dict[str, Any], tp: str) -> None:
    """The sharded model's logits are transformers' own for the same files (bf16 weights
    cast into fp32 masters); 2x2 HSDP and 2 nodes x (1 shard x 2 tp)."""
    assert facts[tp]["pretrained"] is not None
    assert facts[tp]["max_diff"] < 1e-5


def test_no_rank_holds_the_whole_model_while_loading(facts: dict[str, Any]) -> None:
    """Peak resident memory from building the model to loaded, on every rank (the pages
    of the memory-mapped files it read included): at most 1.5 x its fp32 shard plus one
    read buffer, and less than the model in fp32."""
    mem = facts["memory"]
    for rise, shard in zip(mem["peak_rise"], mem["shard"], strict=True):
        assert shard * 2 == pytest.approx(mem["full_fp32"], rel=0.01)  # 2x2 HSDP: half each
        assert rise <= 1.5 * shard + BUFFER, (rise, shard)
        assert rise < mem["full_fp32"]


def test_frozen_parameters_stay_bitwise_and_get_no_optimizer_state(facts: dict[str, Any]) -> None:
    """freeze=model.embed_tokens.*,model.layers.0.* on 2x2 HSDP: after 3 steps the frozen
    weights are bit for bit init_from's, every other one moved, and only those are in the
    optimizer (with state)."""
    f = facts["freeze"]
    assert f["frozen"] == 1 + 9 and f["frozen_unchanged"]  # the embedding, layer 0's 9
    assert f["trainable_changed"] == f["trainable"] == 2 + 9  # layer 1's 9, norm, head
    assert f["optimizer_params"] == f["optimizer_state"] == f["trainable"]
    assert not f["frozen_in_optimizer"]
    assert f["start_max_diff"] < 1e-5


def test_lora_starts_from_the_base_model_and_trains_only_its_adapters(facts: dict[str, Any]) -> None:
    """lora_rank=4 on q_proj and v_proj of both layers (PEFT, applied before sharding): B is
    zero, so the first logits are the base model's; A and B of 4 layers train, every base
    weight stays bit for bit, and the optimizer holds the adapters alone."""
    f = facts["lora"]
    assert f["start_max_diff"] < 1e-5
    assert f["trainable"] == 2 * 2 * 2 and f["frozen_unchanged"]
    assert f["trainable_changed"] == f["trainable"]
    assert f["optimizer_params"] == f["optimizer_state"] == f["trainable"]
