"""Weights from a Hugging Face checkpoint directory (`config.json` and safetensors, one file
or sharded with an index) into the sharded model: `--set init_from=DIR`.

The model is built on the meta device and sharded first, as always; then each rank reads
only the slices of each tensor it holds, through DCP's `HuggingFaceStorageReader`
(safetensors memory-maps its files, `get_slice` reads the requested rows). No rank ever
holds the whole model, or even one whole matrix of it. Checkpoint tensors in bf16 or fp16
are cast into the fp32 master weights as they are read.

Names are the model's own state-dict keys (canonical: no activation-checkpointing or
compile wrapper parts), which for a `transformers` model are the checkpoint's. A weight
shared by two modules (tied embeddings) is read once, under whichever of its names the
checkpoint has.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from hpcshard.errors import UserError

log = logging.getLogger("hpcshard")

SUFFIX = ".safetensors"


@dataclass(frozen=True)
class Stored:
    """What a checkpoint directory holds: every tensor's shape and dtype, by name."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    files: dict[str, Path]
    """Which file holds each tensor."""

    def tensor(self, name: str) -> torch.Tensor:
        """One whole tensor, read from its file (for export, which works tensor by tensor)."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)  # type: ignore[no-any-return]

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.files.values()))

    @property
    def fingerprint(self) -> str:
        """Names, shapes, dtypes and file sizes: what a resume checks before it reads frozen
        weights from the checkpoint again (cheap; a rewritten file of the same layout is
        not caught)."""
        import hashlib

        sizes = sorted((f.name, f.stat().st_size) for f in set(self.files.values()))
        text = json.dumps([sorted((k, list(v), self.dtypes[k]) for k, v in self.shapes.items()), sizes])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_file(path: str | Path) -> Path:
    """A checkpoint directory's config.json, or one line saying what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"init_from={str(path)!r} is not a directory; give a Hugging Face "
                        "checkpoint directory (config.json and *.safetensors)")
    if not (root / "config.json").is_file():
        raise UserError(f"init_from={str(path)!r} has no config.json; give a directory "
                        "written by save_pretrained")
    return root / "config.json"


def read_dir(path: str | Path) -> Stored:
    """The headers of a Hugging Face checkpoint directory (cheap: no tensor data is read).
    One line for anything that is not one."""
    config_file(path)
    root = Path(path)
    files = sorted(root.glob(f"*{SUFFIX}"))
    if not files:
        found = sorted(p.name for p in root.iterdir())[:5]
        hint = (" (pytorch_model.bin: convert it to safetensors with save_pretrained)"
                if any(n.endswith(".bin") for n in found) else "")
        raise UserError(f"init_from={str(path)!r} holds no *.safetensors files{hint}; "
                        "give a directory written by save_pretrained")
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    piece = f.get_slice(key)
                    shapes[key], dtypes[key] = tuple(piece.get_shape()), piece.get_dtype()
                    where[key] = file
        except OSError:  # the storage's trouble, not the file's: a fault a restart may mend
            raise
        except Exception as err:  # safetensors raises its own error types
            raise UserError(f"init_from: {file} is not a readable safetensors file ({err})") from None
    index = root / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: every file it names must be there
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(n for n in names if not (root / n).is_file())
        if missing:
            raise UserError(f"init_from={str(path)!r} lacks {len(missing)} file(s) its index "
                            f"names, e.g. {missing[0]}; copy the whole checkpoint")
    return Stored(root, shapes, dtypes, where)


def wanted(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor the model's state dict holds that a checkpoint must supply, as
    {its first name: (every name, full shape)}: tied weights appear once, LoRA adapters
    not at all."""
    from hpcshard.runtime.adapters import is_adapter
    from hpcshard.runtime.blocks import canonical_name

    by_tensor: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if is_adapter(name):  # LoRA's own: the run creates them
            continue
        by_tensor.setdefault(id(t), []).append(canonical_name(name))
        shapes[id(t)] = tuple(t.shape)
    return {names[0]: ("|".join(names), shapes[key]) for key, names in by_tensor.items()}


def match(model: nn.Module, stored: Stored) -> dict[str, str]:
    """{model name: checkpoint name} for every tensor, or one line naming what is missing
    or mis-shaped (and how many)."""
    found: dict[str, str] = {}
    missing, mismatched = [], []
    from hpcshard.runtime.adapters import base_name

    for first, (names, shape) in wanted(model).items():
        name = next((base_name(n) for n in names.split("|") if base_name(n) in stored.shapes), None)
        if name is None:
            missing.append(first)
        elif stored.shapes[name] != shape:
            mismatched.append(f"{name} is {list(stored.shapes[name])} in the checkpoint, "
                              f"{list(shape)} in the model")
        else:
            found[first] = name
    where = f"init_from={str(stored.path)!r}"
    if missing:
        raise UserError(f"{where} lacks {len(missing)} of the model's tensors, e.g. {missing[0]!r}; "
                        "is it a checkpoint of this architecture?")
    if mismatched:
        raise UserError(f"{where}: {len(mismatched)} tensor(s) differ in shape, e.g. {mismatched[0]}; "
                        "the model's config must be the checkpoint's")
    extra = set(stored.shapes) - set(found.values())
    if extra:
        log.warning("init_from: %d checkpoint tensor(s) are not in the model and are not read, "
                    "e.g. %s", len(extra), sorted(extra)[0])
    return found


def aliases(model: nn.Module) -> frozenset[str]:
    """Every name of every tensor a checkpoint supplies (tied weights under each name)."""
    return frozenset(n for names, _ in wanted(model).values() for n in names.split("|"))


@torch.no_grad()
def load_pretrained(model: nn.Module, stored: Stored, names: dict[str, str]) -> None:
    """Read the checkpoint into the (sharded, materialised) model, each rank its own slices,
    in place (the state dict's tensors share the parameters' storage). `names`: `match`'s,
    taken on the same model before it was sharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = model.state_dict()
    dcp.load({stored_name: state[name] for name, stored_name in names.items()},
             storage_reader=HuggingFaceStorageReader(str(stored.path)))
