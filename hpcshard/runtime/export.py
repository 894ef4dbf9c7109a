"""`hpcshard ckpt export`: a sharded DCP checkpoint -> full weights for inference or another
framework, in one process without a process group (DCP reads the shards of any mesh and
reassembles full tensors; only the model is read, not the optimizer state).

- `--out FILE`: one state dict (`.safetensors` or `torch.save`) that a plain model loads
  with `load_state_dict`; the whole model in memory at once, for small models.
- `--hf DIR`: a Hugging Face directory that `from_pretrained` loads: config.json, the
  tokenizer the run used, safetensors files of at most `--shard-size` with their index.
  Streamed file by file: peak memory is about one output file, not the model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hpcshard.config import build_config
from hpcshard.rundir import store
from hpcshard.rundir.spec import RunSpec
from hpcshard.runtime.blocks import on_meta
from hpcshard.runtime.job import load_job

FORMATS = (".safetensors", ".pt", ".pth", ".bin")


def _checkpoint(run_dir: Path, step: int | None) -> tuple[store.Checkpoint, Any, torch.nn.Module]:
    """The checkpoint to export, the run's config and its model on the meta device."""
    ckpt, _ = store.select(run_dir / store.CHECKPOINTS, "auto" if step is None else str(step))
    if ckpt is None:
        raise ValueError(f"no committed checkpoint in {run_dir / store.CHECKPOINTS}")
    store.check_safe(ckpt)
    spec = RunSpec.read(run_dir)
    job = load_job(spec.job)
    cfg = build_config(job.config, spec.sets)
    if getattr(cfg, "lora_rank", 0) or getattr(cfg, "freeze", ""):
        # Their checkpoints hold the trainable tensors alone; merging them with init_from's
        # frozen ones (and PEFT's adapter format) is the next part of this export.
        raise ValueError("this run has frozen parameters or LoRA adapters, whose export (merged, "
                         "or as a PEFT adapter) is not built yet; export a run without them")
    with on_meta():
        model = job.model(cfg)
    return ckpt, cfg, model


def export(run_dir: Path, step: int | None, out: Path) -> store.Checkpoint:
    if out.suffix not in FORMATS:
        raise ValueError(f"--out {str(out)!r}: unknown format; end it in one of {', '.join(FORMATS)}")
    if out.exists():
        raise ValueError(f"--out {str(out)!r} exists; choose a new file (nothing is overwritten)")
    ckpt, _, model = _checkpoint(run_dir, step)
    model.to_empty(device="cpu")  # every saved tensor is overwritten by the load
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt.path), no_dist=True)
    tensors = {k: v.contiguous() for k, v in state["model"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("writing .safetensors needs the safetensors package (pip install "
                             "'hpcshard[hf]' or pip install safetensors); or export to a .pt file") from None
        save_file(tensors, str(out), metadata={"step": str(ckpt.step)})
    else:
        torch.save(tensors, out)
    return ckpt


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STORED = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes; one line for anything else."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30}
    value = text.strip().upper()
    number = value.rstrip("KMGIB")
    try:
        size = int(float(number) * units[value[len(number):]])
    except (KeyError, ValueError):
        size = 0
    if size <= 0:
        raise ValueError(f"--shard-size {text!r} is not a size; give e.g. 5GB or 500MB")
    return size


def _default_dtype(cfg: Any) -> str:
    """The dtype the run started from (init_from's most common), else fp32 (as trained)."""
    if getattr(cfg, "init_from", ""):
        from hpcshard.runtime.pretrained import read_dir

        try:
            dtypes = list(read_dir(cfg.init_from).dtypes.values())
        except ValueError:
            return "fp32"  # the checkpoint moved on: export what training holds
        common = max(set(dtypes), key=dtypes.count)
        return STORED.get(common, "fp32")
    return "fp32"


def _groups(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, limit: int) -> list[list[str]]:
    """Names in state-dict order, cut into files of at most `limit` bytes (a larger tensor
    gets a file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def export_hf(run_dir: Path, step: int | None, out: Path, dtype: str = "", shard_size: str = "5GB",
              done: Callable[[int, int], None] = lambda i, n: None) -> tuple[store.Checkpoint, int]:
    """Write the checkpoint as a Hugging Face model directory at `out`; `done(i, n)` after
    each of the n files. Returns the checkpoint and the number of files. The directory
    appears whole or not at all (written beside it, then renamed)."""
    from safetensors.torch import save_file

    from hpcshard.runtime.pretrained import wanted

    if out.exists():
        raise ValueError(f"--hf {str(out)!r} exists; choose a new directory (nothing is overwritten)")
    if dtype and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not valid; choose one of: {', '.join(DTYPES)}")
    limit = parse_size(shard_size)
    ckpt, cfg, model = _checkpoint(run_dir, step)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(f"--hf needs a transformers model; this run's is {type(model).__name__}; "
                         "export it with --out FILE.safetensors instead")
    dtype = dtype or _default_dtype(cfg)
    torch_dtype = DTYPES[dtype]
    shapes = [(name, shape) for name, (_, shape) in wanted(model).items()]
    groups = _groups(shapes, torch_dtype.itemsize, limit)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    try:
        full = dict(shapes)
        for i, names in enumerate(groups, 1):
            n = len(groups)
            file = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            state = {f"model.{name}": torch.empty(full[name], dtype=torch_dtype) for name in names}
            dcp.load(state, checkpoint_id=str(ckpt.path), no_dist=True)  # cast as read, shard by shard
            tensors = {name: state[f"model.{name}"] for name in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
            total += sum(t.nbytes for t in tensors.values())
            del state, tensors
            done(i, len(groups))
        if len(groups) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        config.use_cache = True  # trained without a KV cache; inference wants it
        config.dtype = torch_dtype
        config.save_pretrained(tmp)
        _copy_tokenizer(cfg, tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt, len(groups)


def _copy_tokenizer(cfg: Any, out: Path) -> None:
    """The tokenizer the run read its data with, and the generation config it started
    from, so the directory is complete for inference."""
    source = getattr(cfg, "tokenizer", "") or getattr(cfg, "init_from", "")
    if not source:
        return
    src = Path(source)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out / "generation_config.json")
    if any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
