"""jobs/hf_causal_lm.py in one process: block detection, and meta-device materialisation
that matches a model transformers builds and initialises itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hpcshard.config import build_config
from hpcshard.runtime.blocks import canonical_name, find_blocks
from hpcshard.runtime.job import Job, load_job
from hpcshard.runtime.shard import ShardPlan, materialize, shard_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.unit

JOB = Path(__file__).resolve().parents[2] / "jobs" / "hf_causal_lm.py"


@pytest.fixture(scope="module")
def job() -> Job:
    return load_job(str(JOB))


def meta_model(job: Job, cfg: Any) -> Any:  # a transformers model: .config, .logits
    with torch.device("meta"):
        return job.model(cfg)


def reference(job: Job, cfg: Any) -> Any:
    """The same model built the ordinary way: on CPU, initialised by transformers."""
    hf_config = job.model.__globals__["hf_config"]
    return transformers.AutoModelForCausalLM.from_config(
        hf_config(cfg), attn_implementation="sdpa", dtype=torch.float32)


def materialized(job: Job, cfg: Any, ac_every: int = 0) -> Any:
    model = meta_model(job, cfg)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    shard_model(model, mesh, ShardPlan(mode="full", ac_every=ac_every))
    materialize(model, torch.device("cpu"), seed=0, init=job.init)
    return model


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()}


def test_block_is_the_decoder_layer(job: Job) -> None:
    cfg = build_config(job.config, {"layers": "3"})
    blocks = find_blocks(meta_model(job, cfg))
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 3


def test_attention_is_sdpa(job: Job) -> None:
    model = meta_model(job, build_config(job.config, {}))
    assert model.config._attn_implementation == "sdpa"
    assert model.config.use_cache is False


@pytest.mark.parametrize("ac_every", [0, 1])
def test_materialize_recomputes_rotary_buffers(job: Job, world_of_one: None, ac_every: int) -> None:
    cfg = build_config(job.config, {})
    model = materialized(job, cfg, ac_every)
    ref = reference(job, cfg)
    ours = {canonical_name(n): b for n, b in model.named_buffers()}
    theirs = dict(ref.named_buffers())
    assert set(theirs) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    for name, buf in theirs.items():
        assert torch.equal(ours[name], buf), name


def test_materialize_matches_hf_initialisation(job: Job, world_of_one: None) -> None:
    cfg = build_config(job.config, {})
    model = materialized(job, cfg)
    params = full_params(model)
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # nn.Linear and nn.Embedding: N(0, initializer_range = 0.02)
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
    # The sharded model computes what the ordinary model computes with the same weights.
    ref = reference(job, cfg)
    ref.load_state_dict(params, strict=True)
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits)
    assert not any(hasattr(p, "_is_hf_initialized") for p in model.parameters())


def test_parent_init_overrides_child_init(job: Job, world_of_one: None) -> None:
    """GPT-2's attention and MLP rescale their child c_proj (1/sqrt(2 * layers)): the
    parent's _init_weights has to reach a child that materialize initialises alone."""
    cfg = build_config(job.config, {"model_type": "gpt2", "layers": "2", "hidden": "128"})
    params = full_params(materialized(job, cfg))
    residual = 0.02 / math.sqrt(2 * 2)
    assert params["transformer.h.0.attn.c_proj.weight"].std().item() == pytest.approx(residual, rel=0.1)
    assert params["transformer.h.1.mlp.c_proj.weight"].std().item() == pytest.approx(residual, rel=0.1)
    assert params["transformer.h.0.attn.c_attn.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_tied_embeddings_stay_tied(job: Job, world_of_one: None) -> None:
    cfg = build_config(job.config, {"tie_embeddings": "true"})
    model = materialized(job, cfg)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize(("sets", "message"), [
    ({"heads": "3"}, "does not divide hidden"),
    ({"kv_heads": "3"}, "does not divide heads"),
    ({"vocab_size": "100"}, "too small for byte tokens"),
    ({"attn_implementation": "flash"}, "attn_implementation"),
    ({"config_json": "x.json", "hidden": "32"}, "cannot be set with config_json"),
])
def test_bad_config_is_a_value_error(job: Job, sets: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config(job.config, sets)


def test_bad_model_is_a_value_error(job: Job, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a transformers model type"):
        job.model(build_config(job.config, {"model_type": "nope"}))
    with pytest.raises(ValueError, match="does not exist"):
        job.model(build_config(job.config, {"config_json": str(tmp_path / "missing.json")}))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=128,
                                          max_position_embeddings=64)
        path = tmp_path / "config.json"
        path.write_text(config.to_json_string())
        job.model(build_config(job.config, {"config_json": str(path), "seq_len": "128"}))


def test_config_json_builds_that_model(job: Job, tmp_path: Path) -> None:
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, max_position_embeddings=256,
                                      dtype="bfloat16")
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    model = meta_model(job, build_config(job.config, {"config_json": str(path)}))
    assert [type(b).__name__ for b in find_blocks(model)] == ["Qwen2DecoderLayer"] * 3
    assert model.config.vocab_size == 300
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights


def test_the_tensor_parallel_plan_comes_from_transformers(job: Job) -> None:
    """Llama's own plan (q/k/v and gate/up by output features, o and down by input), under
    the base model's prefix; the embedding and the head by vocabulary; the norms whole."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hpcshard.runtime.shard import Replicated

    cfg = build_config(job.config, {"tp": "2"})
    assert job.tp_plan is not None
    plan = job.tp_plan(cfg, meta_model(job, cfg))
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    head = plan["lm_head"]
    assert isinstance(head, ColwiseParallel)  # loss parallel: logits split by vocabulary
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert isinstance(plan["model.norm"], Replicated)
    assert isinstance(plan["model.layers.1.post_attention_layernorm"], Replicated)


@pytest.mark.parametrize(("sets", "message"), [
    ({"tp": "4", "kv_heads": "2"}, "tp=4 does not divide the model's num_key_value_heads=2"),
    ({"tp": "2", "tie_embeddings": "true"}, "tie_embeddings with tp > 1"),
    ({"tp": "2", "model_type": "gpt2"}, "model_type='gpt2' has no tensor parallel plan"),
])
def test_bad_tensor_parallel_shapes_are_one_line(job: Job, sets: dict[str, str], message: str) -> None:
    cfg = build_config(job.config, sets)
    assert job.tp_plan is not None
    with pytest.raises(ValueError, match=message):
        job.tp_plan(cfg, meta_model(job, cfg))
