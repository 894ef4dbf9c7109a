"""Which modules get their own `fully_shard`, and how modules are named and initialised.
Only `torch.nn`: the preflight and the planner use these without loading FSDP, DTensor
or DCP (about a second and a half of imports on every submit)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from hpcshard.errors import UserError


def repeated_classes(model: nn.Module) -> dict[str, int]:
    """Classes that fill a ModuleList (>= 2 children of one class), with their parameter counts."""
    found: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            kinds = {type(child).__name__ for child in mod}
            if len(kinds) == 1:
                found[kinds.pop()] = sum(p.numel() for p in mod.parameters())
    return found


def _post_order(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(mod: nn.Module) -> None:
        if id(mod) in seen:  # a module shared by two parents: once
            return
        seen.add(id(mod))
        for child in mod.children():
            visit(child)
        out.append(mod)
    visit(model)
    return out


def _size_based(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Innermost-first: a module is wrapped when its not-yet-wrapped parameters reach the bound."""
    chosen: list[nn.Module] = []
    covered: set[int] = set()

    def visit(mod: nn.Module) -> None:
        for child in mod.children():
            visit(child)
        if mod is model or isinstance(mod, nn.ModuleList | nn.ModuleDict):
            return  # containers have no forward for FSDP to hook
        own = sum(p.numel() for p in mod.parameters() if id(p) not in covered)
        if own >= min_params:
            chosen.append(mod)
            covered.update(id(p) for p in mod.parameters())

    visit(model)
    return chosen


def find_blocks(model: nn.Module, block: str = "", min_params: int = 0) -> list[nn.Module]:
    """The modules that get their own `fully_shard`, in model order."""
    if block:  # one class name, or several: "Block,Embedding"
        wanted = [n.strip() for n in block.split(",") if n.strip()]
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in wanted if n not in present]
        if missing:
            raise UserError(f"block={missing[0]!r} is not a class in the model; classes in it: "
                            + ", ".join(sorted(present)))
        # Children before parents (fully_shard goes bottom-up), siblings in model order.
        return [m for m in _post_order(model) if type(m).__name__ in wanted]
    if min_params:
        return _size_based(model, min_params)
    found = repeated_classes(model)
    if not found:
        raise UserError("no repeated block (a ModuleList of one class) found in the model; "
                        "name one with --set block=ClassName or use --set block_min_params=N")
    name = max(found, key=lambda k: found[k])
    return [m for m in model.modules() if type(m).__name__ == name]


WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A module's name without AC/compile wrapper parts, as in its state-dict keys."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "").replace(part.rstrip("."), "")
    return name.rstrip(".")


def module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


InitFn = Callable[[nn.Module, str, nn.Module], None]
"""init(root, name, module): initialise one module's own tensors in place."""


def reset_init(root: nn.Module, name: str, module: nn.Module) -> None:
    """Default initialisation: each module's own `reset_parameters`."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


_RANDOM_FILLS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.log_normal_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_,
    torch.Tensor.random_, torch.Tensor.bernoulli_,
})


def _is_initialiser(func: Any) -> bool:
    """torch.nn.init's in-place initialisers (normal_, kaiming_uniform_, ...)."""
    return getattr(func, "__module__", "") == "torch.nn.init" and func.__name__.endswith("_")


class _SkipMetaInit(TorchFunctionMode):
    """Initialisers on meta tensors do nothing (there are no values), so skip them: on the
    meta device `normal_` runs a Python reference that imports torch._dynamo, 1-2 s of
    CPU in every process that builds a model with an embedding on meta."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes tensor=...
        if (isinstance(target, torch.Tensor) and target.is_meta
                and (func in _RANDOM_FILLS or _is_initialiser(func))):
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """`torch.device("meta")` for building a model: no memory, no initialisation (the
    values come later from `materialize`, or never, for the planner and the preflight)."""
    with torch.device("meta"), _SkipMetaInit():
        yield
