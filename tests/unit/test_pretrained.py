"""init_from's checks, in one process on the meta device: a directory that is not a Hugging
Face checkpoint, missing or mis-shaped tensors and a config that disagrees with --set are
each one line (the preflight's, before anything is submitted); tied weights are read once."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from hpcshard.config import build_config
from hpcshard.runtime.job import Job, load_job
from hpcshard.runtime.preflight import preflight
from hpcshard.runtime.pretrained import aliases, match, read_dir
from tests.hf_models import tiny_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HF_JOB = str(ROOT / "jobs" / "hf_causal_lm.py")
DATA = str(Path(sysconfig.get_paths()["stdlib"]) / "json")


@pytest.fixture(scope="module")
def job() -> Job:
    return load_job(HF_JOB)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "llama"
    tiny_llama(out)
    return out


def meta(job: Job, **sets: str) -> torch.nn.Module:
    cfg = build_config(job.config, {"data": DATA, "seq_len": "32", **sets})
    with torch.device("meta"):
        return job.model(cfg)


def check(**sets: str) -> dict:
    return preflight({"job": HF_JOB, "sets": {"data": DATA, "seq_len": "32", **sets}, "nodes": 1, "gpus": 2})


def test_the_model_takes_its_config_and_names_from_the_checkpoint(job: Job, ckpt: Path) -> None:
    model = meta(job, init_from=str(ckpt))
    assert model.config.vocab_size == 300 and model.config.num_key_value_heads == 2  # type: ignore[union-attr]
    stored = read_dir(ckpt)
    names = match(model, stored)
    assert len(list((ckpt).glob("*.safetensors"))) > 1  # sharded, with an index
    assert set(names.values()) == set(stored.shapes) and all(k == v for k, v in names.items())
    assert check(init_from=str(ckpt))["params"] == sum(p.numel() for p in model.parameters())


def test_tied_weights_are_read_once_under_the_checkpoints_name(job: Job, tmp_path: Path) -> None:
    tiny_llama(tmp_path, tie=True)
    stored = read_dir(tmp_path)
    assert "lm_head.weight" not in stored.shapes  # save_pretrained drops the tied copy
    model = meta(job, init_from=str(tmp_path))
    names = match(model, stored)
    assert names["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert "lm_head.weight" not in names and "lm_head.weight" in aliases(model)


def bad_copy(ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(ckpt, out)
    return out


@pytest.mark.parametrize("damage,needle", [
    ("no_dir", "is not a directory"),
    ("no_safetensors", "holds no *.safetensors files"),
    ("bin_only", "pytorch_model.bin: convert it"),
    ("no_config", "has no config.json"),
    ("missing_file", "lacks 1 file(s) its index names"),
    ("corrupt", "is not a readable safetensors file"),
    ("fewer_layers", "lacks 9 of the model's tensors, e.g. 'model.layers.1."),
    ("wider", "differ in shape"),
])
def test_a_bad_checkpoint_is_one_line_before_anything_runs(ckpt: Path, tmp_path: Path, damage: str,
                                                           needle: str) -> None:
    out = bad_copy(ckpt, tmp_path)
    files = sorted(out.glob("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if damage == "no_dir":
        out = tmp_path / "nowhere"
    elif damage in ("no_safetensors", "bin_only"):
        for f in files:
            f.unlink()
        if damage == "bin_only":
            (out / "pytorch_model.bin").write_bytes(b"")
    elif damage == "no_config":
        (out / "config.json").unlink()
    elif damage == "missing_file":
        files[-1].unlink()
    elif damage == "corrupt":
        files[0].write_bytes(b"not a safetensors file")
    elif damage == "fewer_layers":  # the config says 2 layers, the files hold 1
        (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
        tiny_llama(out, layers=1)
        (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    elif damage == "wider":
        (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(ValueError) as err:
        check(init_from=str(out))
    assert "init_from" in str(err.value) and needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("sets,needle", [
    ({"layers": "3"},
     "layers=3 disagrees with init_from's config.json (num_hidden_layers=2); drop --set layers"),
    ({"config_json": "x.json"}, "init_from and config_json both give the model's config"),
])
def test_a_config_that_disagrees_with_the_checkpoint_is_one_line(ckpt: Path, sets: dict[str, str],
                                                                 needle: str) -> None:
    with pytest.raises(ValueError) as err:
        check(init_from=str(ckpt), **sets)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_setting_that_agrees_with_the_checkpoint_is_fine(ckpt: Path) -> None:
    assert check(init_from=str(ckpt), layers="2", vocab_size="300")["params"] > 0
