"""`hpcshard ckpt export`: a sharded DCP checkpoint -> full weights for inference or another
framework, in one process without a process group (DCP reads the shards of any mesh and
reassembles full tensors; only the model is read, not the optimizer state).

- `--out FILE`: one state dict (`.safetensors` or `torch.save`) that a plain model loads
  with `load_state_dict`; the whole model in memory at once, for small models.
- `--hf DIR`: a Hugging Face directory that `from_pretrained` loads: config.json, the
  tokenizer the run used, safetensors files of at most `--shard-size` with their index.
  Streamed: each file is written as its tensors are read, a few at a time, so peak
  memory is about the largest tensor, not a file and not the model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hpcshard.config import build_config, kept_sets
from hpcshard.rundir import store
from hpcshard.rundir.spec import RunSpec, trusted_gid
from hpcshard.runtime.blocks import on_meta
from hpcshard.runtime.job import load_job
from hpcshard.runtime.pretrained import Stored
from hpcshard.runtime.shard import TORCH_DTYPES

FORMATS = (".safetensors", ".pt", ".pth", ".bin")


def _checkpoint(run_dir: Path, step: int | None) -> tuple[store.Checkpoint, Any, Any, torch.nn.Module]:
    """The checkpoint to export, the run's config, its job, and its model on the meta device
    as training built it (LoRA adapters and frozen parameters included)."""
    from hpcshard.runtime.adapters import apply_freeze, apply_lora

    ckpt, _ = store.select(run_dir / store.CHECKPOINTS, "auto" if step is None else str(step))
    if ckpt is None:
        raise ValueError(f"no committed checkpoint in {run_dir / store.CHECKPOINTS}")
    store.check_safe(ckpt, trusted_gid(run_dir))
    spec = RunSpec.read(run_dir)
    spec.use_code()
    job = load_job(spec.job)
    cfg = build_config(job.config, kept_sets(spec.sets, spec.resolved.config))
    with on_meta():
        model = job.model(cfg)
    apply_lora(model, cfg)
    apply_freeze(model, cfg.freeze)
    return ckpt, cfg, job, model


class Sources:
    """Where each weight of a run is, read whole and one group at a time: the checkpoint
    (what trained), init_from (frozen weights of a run that started from one) or the seed
    (frozen weights of a run from scratch, recomputed as every rank did). LoRA layers come
    out merged (base + scaling * B @ A), under the base model's names."""

    def __init__(self, ckpt: store.Checkpoint, cfg: Any, job: Any, model: torch.nn.Module) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        from hpcshard.runtime.adapters import lora_layers, with_adapters
        from hpcshard.runtime.blocks import canonical_name
        from hpcshard.runtime.pretrained import read_dir

        self.ckpt, self.cfg, self.model = ckpt, cfg, model
        self.init = with_adapters(job.init) if cfg.lora_rank else job.init
        meta = FileSystemReader(str(ckpt.path)).read_metadata().state_dict_metadata
        self.saved = {k[len("model."):] for k in meta if k.startswith("model.")}
        self.init_from = read_dir(cfg.init_from) if cfg.init_from else None
        self.state = {canonical_name(n): t for n, t in model.state_dict(keep_vars=True).items()}
        self.lora = lora_layers(model) if cfg.lora_rank else {}

    def outputs(self, ties: bool) -> list[tuple[str, str]]:
        """(name in the output, name in the model) of every weight, adapters folded in;
        `ties`: a weight shared by two modules under each name (else the first only)."""
        from hpcshard.runtime.adapters import base_name, is_adapter

        seen: set[int] = set()
        pairs = []
        for name, t in self.state.items():
            if is_adapter(name) or (not ties and id(t) in seen):
                continue
            seen.add(id(t))
            pairs.append((base_name(name), name))
        return pairs

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Model names -> whole tensors in `dtype`."""
        from hpcshard.runtime.adapters import base_name

        out: dict[str, torch.Tensor] = {}
        saved = [n for n in names if n in self.saved]
        if saved:  # DCP casts as it reads, one stored shard at a time
            state = {f"model.{n}": torch.empty(self.shape(n), dtype=dtype) for n in saved}
            with warnings.catch_warnings():  # "assuming ... a single process": yes
                warnings.simplefilter("ignore")
                dcp.load(state, checkpoint_id=str(self.ckpt.path), no_dist=True)
            out.update({n: state[f"model.{n}"] for n in saved})
        for n in names:
            if n in out:
                continue
            if self.init_from is not None and base_name(n) in self.init_from.shapes:
                out[n] = self.init_from.tensor(base_name(n)).to(dtype)
            else:
                out[n] = self._seeded(n).to(dtype)
        return out

    def _seeded(self, name: str) -> torch.Tensor:
        from hpcshard.runtime.shard import seeded_init

        module_name, _, pname = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        module.to_empty(device="cpu", recurse=False)  # its buffers, which the init may write
        return seeded_init(self.model, module_name, module, self.cfg.seed, self.init,
                           torch.device("cpu"))[pname]

    def merged(self, pairs: list[tuple[str, str]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Output name -> tensor in `dtype`, LoRA layers merged in fp32 first."""
        from hpcshard.runtime.adapters import merge

        lora = {}
        for _, n in pairs:
            layer = n.removesuffix(".base_layer.weight")
            if layer != n and layer in self.lora:
                lora[n] = (layer, f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight")
        plain = [n for _, n in pairs if n not in lora]
        out = self.read(plain, dtype)
        if lora:
            parts = self.read([x for _, a, b in lora.values() for x in (a, b)] + list(lora), torch.float32)
            for n, (layer, a, b) in lora.items():
                out[n] = merge(parts[n], parts[a], parts[b], *self.lora[layer]).to(dtype)
        return {o: out[n].contiguous() for o, n in pairs}


def export(run_dir: Path, step: int | None, out: Path) -> store.Checkpoint:
    if out.suffix not in FORMATS:
        raise ValueError(f"--out {str(out)!r}: unknown format; end it in one of {', '.join(FORMATS)}")
    if out.exists():
        raise ValueError(f"--out {str(out)!r} exists; choose a new file (nothing is overwritten)")
    ckpt, cfg, job, model = _checkpoint(run_dir, step)
    sources = Sources(ckpt, cfg, job, model)
    tensors = sources.merged(sources.outputs(ties=True), torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ValueError("writing .safetensors needs the safetensors package (pip install "
                             "'hpcshard[hf]' or pip install safetensors); or export to a .pt file") from None
        # a tied weight is one tensor under two names: safetensors wants each stored once
        save_file({k: v.clone() for k, v in tensors.items()}, str(out), metadata={"step": str(ckpt.step)})
    else:
        torch.save(tensors, out)
    return ckpt


STORED = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
"""safetensors' dtype names -> hpcshard's."""
SAFETENSORS_DTYPES = {TORCH_DTYPES[ours]: theirs for theirs, ours in STORED.items()}
"""torch dtypes -> safetensors' names (what write_safetensors puts in a header)."""


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


def _default_dtype(stored: Stored | None) -> str:
    """The dtype the run started from (init_from's most common), else fp32 (as trained)."""
    if stored is None:
        return "fp32"
    dtypes = list(stored.dtypes.values())
    return STORED.get(max(set(dtypes), key=dtypes.count), "fp32")


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


@contextmanager
def _staged(out: Path, flag: str) -> Iterator[Path]:
    """A directory written beside `out` and renamed into place: it appears whole or not at
    all; nothing existing is overwritten."""
    if out.exists():
        raise ValueError(f"{flag} {str(out)!r} exists; choose a new directory (nothing is overwritten)")
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hf_model(run_dir: Path, step: int | None, dtype: str, flag: str,
              ) -> tuple[store.Checkpoint, Any, Sources, Any, torch.dtype]:
    if dtype and dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not valid; choose one of: {', '.join(TORCH_DTYPES)}")
    ckpt, cfg, job, model = _checkpoint(run_dir, step)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(f"{flag} needs a transformers model; this run's is {type(model).__name__}; "
                         "export it with --out FILE.safetensors instead")
    sources = Sources(ckpt, cfg, job, model)  # reads init_from's headers once, for both
    return ckpt, cfg, sources, config, TORCH_DTYPES[dtype or _default_dtype(sources.init_from)]


def export_hf(run_dir: Path, step: int | None, out: Path, dtype: str = "", shard_size: str = "5GB",
              done: Callable[[int, int], None] = lambda i, n: None) -> tuple[store.Checkpoint, int]:
    """Write the checkpoint as a Hugging Face model directory at `out` (LoRA adapters merged
    into their layers); `done(i, n)` after each of the n files. Returns the checkpoint and
    the number of files.

    Each file is written as its tensors are read, a few at a time (`READ_SHARE` of a file,
    or one larger tensor alone): peak memory is that batch plus the largest stored shard DCP
    reads into it, whatever the file size."""
    if out.exists():
        raise ValueError(f"--hf {str(out)!r} exists; choose a new directory (nothing is overwritten)")
    limit = parse_size(shard_size)
    ckpt, cfg, sources, config, torch_dtype = _hf_model(run_dir, step, dtype, "--hf")
    pairs = dict(sources.outputs(ties=False))  # output name -> model name
    shapes = {o: sources.shape(n) for o, n in pairs.items()}
    groups = _groups(list(shapes.items()), torch_dtype.itemsize, limit)
    weight_map: dict[str, str] = {}
    total = 0
    with _staged(out, "--hf") as tmp:
        for i, names in enumerate(groups, 1):
            n = len(groups)
            file = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            batches = _groups([(o, shapes[o]) for o in names], torch_dtype.itemsize, limit // READ_SHARE)
            tensors = (sources.merged([(o, pairs[o]) for o in batch], torch_dtype) for batch in batches)
            total += write_safetensors(tmp / file, [(o, shapes[o]) for o in names], torch_dtype, tensors,
                                       {"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
            done(i, n)
        if len(groups) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        config.use_cache = True  # trained without a KV cache; inference wants it
        config.dtype = torch_dtype
        config.save_pretrained(tmp)
        _copy_tokenizer(cfg, tmp)
    return ckpt, len(groups)


READ_SHARE = 4
"""export_hf reads at most a quarter of an output file before writing it."""


def write_safetensors(path: Path, layout: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                      batches: Iterator[dict[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """A safetensors file whose tensors (`layout`: names and shapes, in file order, all of
    `dtype`) arrive in `batches`, each written as it comes: the header first (every offset
    is known from the shapes), then the bytes straight from each tensor's memory.
    safetensors' own `save_file` wants every tensor at once and copies them into one buffer.
    Returns the bytes of tensor data written."""
    import math
    import struct

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    expected = iter(layout)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for batch in batches:
            for name, t in batch.items():
                if (name, tuple(t.shape)) != next(expected) or t.dtype != dtype:
                    raise AssertionError(f"{name} {tuple(t.shape)} {t.dtype} out of the layout's order")
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del batch
    if next(expected, None) is not None:
        raise AssertionError(f"{path.name}: fewer tensors than its header lists")
    return offset


def export_adapter(run_dir: Path, step: int | None, out: Path, dtype: str = "") -> store.Checkpoint:
    """A LoRA run's adapter in PEFT's format (adapter_config.json, adapter_model.safetensors),
    which `PeftModel.from_pretrained(base, out)` loads onto the init_from model."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    ckpt, cfg, sources, _, torch_dtype = _hf_model(run_dir, step, dtype, "--adapter")
    if not cfg.lora_rank:
        raise ValueError("--adapter needs a LoRA run (lora_rank > 0); export this one with --hf")
    names = [f"{layer}.lora_{ab}.default.weight" for layer in sources.lora for ab in "AB"]
    tensors = sources.read(names, torch_dtype)
    targets = sorted({layer.rsplit(".", 1)[-1] for layer in sources.lora})
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM",
                        base_model_name_or_path=str(cfg.init_from) or None)
    with _staged(out, "--adapter") as tmp:
        peft_names = {n: f"base_model.model.{n.replace('.default.', '.')}" for n in tensors}
        save_file({peft_names[n]: t.contiguous() for n, t in tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        _copy_tokenizer(cfg, tmp)
    return ckpt


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
