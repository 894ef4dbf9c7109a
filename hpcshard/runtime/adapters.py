"""Frozen parameters and LoRA adapters, applied to the meta-device model before it is split
or sharded: `--set freeze=PATTERNS` and `--set lora_rank=R`.

LoRA comes from PEFT (`inject_adapter_in_model`: the model keeps its class and its other
names; an adapted `q_proj` holds `base_layer` and `lora_A`/`lora_B`), which freezes every
base weight. Only trainable parameters reach the optimizer, get gradients or are reduced
by FSDP, and only they are written at each save: the frozen ones are the `init_from`
checkpoint's (read again on resume) or the seed's (rebuilt the same)."""

from __future__ import annotations

import math
from fnmatch import fnmatch
from typing import Any

import torch
import torch.nn as nn

from hpcshard.errors import UserError
from hpcshard.runtime.blocks import InitFn, canonical_name

ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.",
                 ".lora_magnitude_vector.")


def is_adapter(name: str) -> bool:
    """A LoRA parameter or module (PEFT's names): never in a base checkpoint."""
    return any(part in f".{name}." for part in ADAPTER_PARTS)


def base_name(name: str) -> str:
    """A name as the base model has it: PEFT's `q_proj.base_layer.weight` is `q_proj.weight`."""
    return f".{name}.".replace(".base_layer.", ".")[1:-1]


def apply_lora(model: nn.Module, cfg: Any) -> None:
    """Wrap the chosen linear layers in LoRA adapters (PEFT) when `lora_rank` > 0."""
    if not cfg.lora_rank:
        return
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise UserError("lora_rank needs the peft package: pip install 'hpcshard[lora]'") from None
    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    if not targets and getattr(getattr(model, "config", None), "model_type", None) is None:
        raise UserError("lora_targets is empty and the model is no transformers model: name the "
                        "layers to adapt, e.g. --set lora_targets=attn.q,attn.v")
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targets or None)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as err:  # no module matched, or one PEFT cannot adapt
        raise UserError(f"lora_targets={cfg.lora_targets!r}: {str(err).splitlines()[0]}") from None


def apply_freeze(model: nn.Module, patterns: str) -> None:
    """Freeze parameters whose names match any of the comma-separated fnmatch patterns."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    names = {canonical_name(n): p for n, p in model.named_parameters()}
    for pattern in wanted:
        hits = [n for n in names if fnmatch(n, pattern) or fnmatch(base_name(n), pattern)]
        if not hits:
            raise UserError(f"freeze={pattern!r} matches no parameter; names look like "
                            f"{next(iter(names))!r} (fnmatch patterns, comma-separated)")
        for n in hits:
            names[n].requires_grad_(False)


def frozen(model: nn.Module) -> frozenset[str]:
    return frozenset(canonical_name(n) for n, p in model.named_parameters() if not p.requires_grad)


def with_adapters(init: InitFn) -> InitFn:
    """The job's init, except for LoRA layers: A as PEFT initialises it (Kaiming uniform),
    B zero, so training starts from the base model's function exactly."""

    @torch.no_grad()
    def adapted(root: nn.Module, name: str, module: nn.Module) -> None:
        if not is_adapter(name):
            init(root, name, module)
            return
        dotted = f".{name}."
        for p in module.parameters(recurse=False):
            if ".lora_B." in dotted or ".lora_embedding_A." in dotted:
                nn.init.zeros_(p)
            elif ".lora_embedding_B." in dotted:
                nn.init.normal_(p)
            else:
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
    return adapted


def lora_layers(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """PEFT's adapted layers by canonical name: (scaling, fan_in_fan_out). The layer's own
    weight is `NAME.base_layer.weight`, its adapter `NAME.lora_A.default.weight` and
    `NAME.lora_B.default.weight`; merged, the weight is base + scaling * B @ A."""
    from peft.tuners.lora import LoraLayer

    return {canonical_name(n): (float(m.scaling["default"]), bool(getattr(m, "fan_in_fan_out", False)))
            for n, m in model.named_modules() if isinstance(m, LoraLayer) and "default" in m.lora_A}


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
          fan_in_fan_out: bool) -> torch.Tensor:
    """A LoRA layer's weight with its adapter folded in (fp32), as PEFT's `merge` computes it."""
    delta = (b.float() @ a.float()) * scaling
    return base.float() + (delta.T if fan_in_fan_out else delta)
