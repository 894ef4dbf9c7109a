"""Float8 training (`float8=true`) through torchao, torchtitan's tensorwise recipe.

Before anything wraps or shards the model, the blocks' plain `nn.Linear` layers whose
dimensions are multiples of 16 (what float8 tensor cores take) become torchao's
`Float8Linear`: each matmul casts its input, weight and output gradient to float8 with a
dynamic per-tensor scale and runs `torch._scaled_mm`. Everything outside the blocks (the
embeddings, the final norm, the output head, whose logits float8 would hurt most) stays
in bf16. Where FSDP shards over more than one rank, the weights are all-gathered in float8
(half of bf16's bytes) and their scales computed for every layer at once after each
optimizer step (`rescale`: one all-reduce, not one per layer in forward).

torchao is imported here only, and only when float8 is on (the `fp8` extra). Versions
checked against: torchao 0.17.0 (`convert_to_float8_training`, `Float8LinearConfig`,
`precompute_float8_dynamic_scale_for_fsdp` from `torchao.float8`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from hpcshard.errors import UserError
from hpcshard.runtime.device import fp8_support

MULTIPLE = 16
"""Both dimensions of a converted weight are multiples of this (float8 tensor cores)."""


def convertible(blocks: list[nn.Module]) -> Callable[[nn.Module, str], bool]:
    """torchao's `module_filter_fn`: a plain `nn.Linear` (not a subclass such as
    MultiheadAttention's, whose weight is read directly) inside one of `blocks`, both of
    whose dimensions are multiples of 16 (torchtitan's filter, with the blocks in place of
    its list of names to skip: the output head is never inside one)."""
    inside = {id(m) for block in blocks for m in block.modules()}

    def take(module: nn.Module, _name: str) -> bool:
        if type(module) is not nn.Linear or id(module) not in inside:
            return False
        out_features, in_features = module.weight.shape
        return out_features % MULTIPLE == 0 and in_features % MULTIPLE == 0

    return take


def count(model: nn.Module, blocks: list[nn.Module]) -> int:
    """How many Linear layers of `model` float8 converts (also the preflight's check, which
    needs no torchao); none is one line."""
    take = convertible(blocks)
    n = sum(take(m, name) for name, m in model.named_modules())
    if not n:
        raise UserError(f"float8=true converts no layer of this model: none of its blocks' "
                        f"nn.Linear layers has both dimensions multiples of {MULTIPLE}")
    return n


def torchao_missing() -> str:
    """"" where torchao's float8 training imports, else the one line to show."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return (f"float8=true needs torchao >= 0.17 (pip install 'hpcshard[fp8]'), which does not "
                f"import here: {err}")
    return ""


def refusal(device: torch.device) -> str:
    """Why this rank cannot train in float8 ("": it can): the device first, then torchao."""
    return fp8_support(device) or torchao_missing()


def convert(model: nn.Module, blocks: list[nn.Module], device: torch.device, *, all_gather: bool,
            emulate: bool = False) -> int:
    """Swap the convertible Linear layers of the (meta) model for `Float8Linear`, in place,
    before tensor parallelism, AC, compile and FSDP touch it; returns how many. `all_gather`:
    FSDP gathers their weights in float8 (torchtitan does so where the shard group has more
    than one rank). `emulate`: torchao computes the float8 matmuls in high precision, for
    tests on CPU only; the device is not checked then."""
    why = torchao_missing() if emulate else refusal(device)
    if why:
        raise UserError(why)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    n = count(model, blocks)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=convertible(blocks))
    return n


def rescale(model: nn.Module) -> None:
    """After each optimizer step (and a restore): the float8 all-gather's scales of every
    converted weight at once, from the weights as they are now. A no-op without float8
    all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
