"""A Hugging Face `transformers` causal language model, trained from scratch with FSDP2.

The model is built from a config, never downloaded: by default a tiny Llama (byte
vocabulary, 2 decoder layers), or any causal-LM `config.json` with `--set config_json=FILE`.
The data is charlm's: bytes of the running Python's standard library unless `data` (text)
or `tokens` (a flat token file) says otherwise. Needs the `hf` extra.

    hpcshard submit --nodes 2 --gpus 2 jobs/hf_causal_lm.py --set steps=300
    hpcshard submit --nodes 1 --gpus 2 jobs/hf_causal_lm.py --set model_type=qwen2 --set layers=4

The runtime builds the model on the meta device and materialises it one module at a time.
`init` reproduces what `PreTrainedModel.initialize_weights()` would have done: each module
goes through `_init_weights` of the (sub)model that owns it and then of its ancestors,
as HF's children-first traversal does, which also recomputes the non-persistent buffers
(the rotary `inv_freq`) that the meta device left empty.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcshard.config import TrainConfig
from hpcshard.runtime import Job
from hpcshard.runtime.blocks import canonical_name
from hpcshard.runtime.data import DataConfig, DataSplits, load_splits
from hpcshard.runtime.pretrained import config_file
from hpcshard.runtime.sft import IGNORE

try:
    import transformers
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedModel
except ImportError as _err:
    raise ValueError(f"jobs/hf_causal_lm.py needs Hugging Face transformers ({_err}); "
                     "pip install 'hpcshard[hf]'") from None
if int(transformers.__version__.split(".")[0]) < 5:
    # 4.x initialises with raw tensor ops and does not recompute rotary buffers in
    # `_init_weights`, so a meta-device model would train with garbage positions.
    raise ValueError(f"jobs/hf_causal_lm.py needs transformers>=5, found {transformers.__version__}; "
                     "pip install -U 'hpcshard[hf]' 'transformers>=5'")
from transformers.initialization import guard_torch_init_functions  # noqa: E402 (after the checks)

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(kw_only=True)
class Config(TrainConfig, DataConfig):
    """The defaults train a 0.1M-parameter Llama on bytes in about 30 s on 2 CPU cores, to a
    held-out loss near 2.4 nats/byte (context-free byte frequencies give 3.2)."""

    lr: float = 3e-3
    model_type: str = "llama"
    """A transformers model type with a causal-LM head: llama, mistral, qwen2, gpt2, ..."""
    hidden: int = 64
    """Model width (hidden_size)."""
    layers: int = 2
    """Decoder layers (num_hidden_layers)."""
    heads: int = 4
    """Attention heads (must divide hidden)."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention (must divide heads); 0: heads."""
    intermediate: int = 128
    """MLP width (intermediate_size); model types without that key need the default."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    config_json: str = ""
    """A transformers config.json to build instead; model_type, the sizes above and
    vocab_size then come from the file (setting them too is an error)."""
    attn_implementation: str = "sdpa"
    """sdpa | eager: transformers' attention kernel (both run on CPU and GPU)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation={self.attn_implementation!r} is not valid; "
                             f"choose one of: {', '.join(ATTN_IMPLEMENTATIONS)}")
        if self.init_from and self.config_json:
            raise ValueError("init_from and config_json both give the model's config; drop "
                             "config_json (init_from's config.json is used)")
        if self.init_from:
            return  # the sizes come from init_from's config.json (hf_config checks them)
        if self.config_json:
            changed = [f.name for f in dataclasses.fields(Config)
                       if f.name in ARCH_FIELDS and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{', '.join(changed)} cannot be set with config_json; "
                                 f"edit {self.config_json} instead")
            return
        for name in ("hidden", "layers", "heads", "intermediate", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} is not valid; it must be > 0")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} does not divide hidden={self.hidden}; "
                             "pick heads among the divisors of hidden")
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ValueError(f"kv_heads={self.kv_heads} does not divide heads={self.heads}; "
                             "use 0 (= heads) or a divisor of heads")
        if not self.tokens and not self.sft and self.vocab_size < 256:
            raise ValueError(f"vocab_size={self.vocab_size} is too small for byte tokens; "
                             "use at least 256")


ARCH_KEYS = {"model_type": "model_type", "hidden": "hidden_size", "layers": "num_hidden_layers",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "intermediate": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
             "vocab_size": "vocab_size"}
"""The architecture fields and the transformers config keys they set."""
ARCH_FIELDS = tuple(ARCH_KEYS)


def _agree(cfg: Config, config: Any) -> None:
    """With init_from, an architecture field set on the command line must be the
    checkpoint's own value (one line naming both otherwise)."""
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if f.name in ARCH_KEYS and value != f.default:
            theirs = getattr(config, ARCH_KEYS[f.name], None)
            if value != theirs:
                raise ValueError(f"{f.name}={value} disagrees with init_from's config.json "
                                 f"({ARCH_KEYS[f.name]}={theirs}); drop --set {f.name}")


def _config_keys(config_class: Any) -> set[str]:
    fields = {f.name for f in dataclasses.fields(config_class)} \
        if dataclasses.is_dataclass(config_class) else set()
    return fields | set(getattr(config_class, "attribute_map", {}))


def hf_config(cfg: Config) -> Any:
    """The transformers config: init_from's config.json, `config_json`, or the architecture
    fields."""
    source = str(config_file(cfg.init_from)) if cfg.init_from else cfg.config_json
    if source:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"config_json {cfg.config_json!r} does not exist; give a config.json file")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{source!r} is not valid JSON ({err})") from None
        model_type = values.get("model_type", "")
    else:
        model_type = cfg.model_type
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model_type={model_type!r} is not a transformers model type; "
                         "use e.g. llama, mistral, qwen2 or gpt2")
    config_class = CONFIG_MAPPING[model_type]
    if source:
        config = config_class.from_dict(values)
        if cfg.init_from:
            _agree(cfg, config)
    else:
        wanted: dict[str, Any] = {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads or cfg.heads, "head_dim": cfg.hidden // cfg.heads,
            "intermediate_size": cfg.intermediate,
            "max_position_embeddings": cfg.seq_len, "tie_word_embeddings": cfg.tie_embeddings,
            # Bytes have no special tokens; ids from the model type's tokenizer would be
            # outside a 256-entry vocabulary.
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        }
        known = _config_keys(config_class)
        optional = {"kv_heads": "num_key_value_heads", "intermediate": "intermediate_size"}
        for field, key in optional.items():
            default = next(f.default for f in dataclasses.fields(Config) if f.name == field)
            if key not in known and getattr(cfg, field) != default:
                raise ValueError(f"model_type={model_type!r} has no {key}, so {field} cannot be "
                                 "set; use config_json for its own keys")
        # Every size is passed, derived ones too: the model type's own defaults for them
        # (Qwen2's 32 kv heads, Gemma's head_dim 256) would not fit. Keys it lacks are left out.
        config = config_class(**{k: v for k, v in wanted.items() if k in known})
    config.use_cache = False  # training: no KV cache
    if getattr(config, "is_decoder", None) is False:
        # Encoder families that AutoModelForCausalLM also accepts (BERT, RoBERTa) attend
        # both ways unless told they decode: they would see the token they predict.
        config.is_decoder = True
    vocab = int(config.vocab_size)
    if not cfg.tokens and not cfg.sft and vocab < 256:
        raise ValueError(f"the model's vocab_size={vocab} is too small for byte tokens; use at least 256")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < cfg.seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds the model's max_position_embeddings="
                         f"{positions}; lower seq_len")
    return config


def build_model(cfg: Config) -> nn.Module:
    """Called under `torch.device("meta")`: transformers then skips its own initialisation."""
    return AutoModelForCausalLM.from_config(  # type: ignore[no-any-return]
        hf_config(cfg), attn_implementation=cfg.attn_implementation,
        dtype=torch.float32,  # master weights; `precision` sets the compute dtype
        trust_remote_code=False)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
         positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy on HF's `.logits`, reduced in fp32, over the positions that
    are learnt (fine-tuning data masks prompts with IGNORE; a window with none is 0, not nan).
    `positions`: packed records' position ids, restarting at each record; transformers'
    `create_causal_mask` turns them into a mask that keeps each record to itself (sdpa,
    eager; flash attention reads them as variable-length sequences). No cache: with one,
    transformers would not look for packed records."""
    from torch.distributed.tensor import DTensor

    logits = model(input_ids=x, position_ids=positions, use_cache=False).logits
    total = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
    if isinstance(total, DTensor):  # loss parallel's
        total = total.full_tensor()
    return total / (y != IGNORE).sum().clamp(min=1)


_MODULES: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()


def _modules_by_name(root: nn.Module) -> dict[str, nn.Module]:
    """Canonical name -> module, built once per model. An AC wrapper and the layer it wraps
    share a canonical name; the layer comes later in named_modules() and wins. The root
    itself is left out of the cached values so the entry dies with the model."""
    found = _MODULES.get(root)
    if found is None:
        found = {canonical_name(n): m for n, m in root.named_modules() if n}
        _MODULES[root] = found
    return {"": root, **found}


def _ancestry(name: str) -> Iterator[str]:
    """`a.b.c`, then `a.b`, `a`, and the root `` (children first, as HF initialises)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        yield ".".join(parts[:i])


def _sentinel(t: torch.Tensor) -> float | int | None:
    if t.is_floating_point():
        return float("nan")
    if t.dtype != torch.bool and not t.is_complex():
        return torch.iinfo(t.dtype).min
    return None


def _unset(t: torch.Tensor, value: float | int) -> bool:
    if t.numel() == 0:
        return False
    return bool(t.isnan().all() if isinstance(value, float) else (t == value).all())


@torch.no_grad()
def init(root: nn.Module, name: str, module: nn.Module) -> None:
    """Initialise `module`'s own parameters and buffers exactly as transformers would.

    `initialize_weights()` visits children before parents, and a parent's `_init_weights`
    may overwrite a child's tensors (GPT-2 rescales `c_proj` from its attention module). So
    `module` goes through `_init_weights` of itself and then of each ancestor, each call
    dispatched to the innermost PreTrainedModel that owns it (composite models). Every
    tensor but `module`'s own is flagged `_is_hf_initialized`, which transformers' guarded
    init functions skip: only this module's (full-size, unsharded) tensors are written.
    """
    modules = _modules_by_name(root)
    own = {id(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))}
    flagged = [t for t in (*root.parameters(), *root.buffers())
               if id(t) not in own and not hasattr(t, "_is_hf_initialized")]
    # Buffers are what the meta device loses silently: poison them so one that
    # _init_weights does not recompute fails here instead of training on garbage.
    poisoned = []
    for bname, buf in module.named_buffers(recurse=False):
        value = _sentinel(buf)
        if value is not None:
            buf.fill_(value)
            poisoned.append((bname, buf, value))
    for t in flagged:
        t._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        with guard_torch_init_functions():
            for target in _ancestry(name):
                owner = next(modules[n] for n in _ancestry(target)
                             if isinstance(modules[n], PreTrainedModel))
                owner._init_weights(modules[target])  # type: ignore[operator]
    finally:
        for t in flagged:
            del t._is_hf_initialized  # type: ignore[attr-defined]
    for bname, buf, value in poisoned:
        if _unset(buf, value):
            raise RuntimeError(
                f"buffer {name}.{bname} of {type(module).__name__} is not recomputed by "
                "transformers' `_init_weights`, so this model cannot be built on the meta device")


def data(cfg: Config) -> DataSplits:
    return load_splits(cfg, vocab_size=int(hf_config(cfg).vocab_size))  # config_json's, if given


def flops_per_token(cfg: Config, model: nn.Module) -> float:
    """6 * matmul parameters + the attention scores (PaLM appendix B). The input embedding
    is a lookup, not a matmul, unless it is tied to the output projection."""
    n = sum(p.numel() for p in model.parameters())
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    out = get_out() if callable(get_out) else None
    if isinstance(emb, nn.Embedding) and (out is None or out.weight is not emb.weight):
        n -= emb.weight.numel()
    config = getattr(model, "config", None)
    try:
        layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)  # type: ignore[union-attr]
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return 6.0 * n
    return 6.0 * n + 12.0 * layers * heads * head_dim * cfg.seq_len


def tp_plan(cfg: Config, model: nn.Module) -> dict[str, object]:
    """Tensor parallelism for `--set tp=K` from the model type's own plan in transformers
    (`config.base_model_tp_plan`: Llama, Mistral, Qwen2, ... name their attention q/k/v/o
    and MLP gate/up/down projections colwise or rowwise), under the base model's prefix.
    The input embedding is split by vocabulary rows, the head by vocabulary columns
    (logits come back split by vocabulary, for loss parallelism), and every other module
    with parameters (the norms) is `Replicated`: no sequence parallelism, since the
    decoder computes positions and the causal mask from its input's length."""
    from fnmatch import fnmatch

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hpcshard.runtime.shard import Replicated

    config: Any = model.config
    base = getattr(config, "base_model_tp_plan", None) or {}
    if not base:
        raise ValueError(f"model_type={config.model_type!r} has no tensor parallel plan in transformers; "
                         "use tp=1, or a job with a tp_plan of its own")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % cfg.tp:
            raise ValueError(f"tp={cfg.tp} does not divide the model's {key}={value}; "
                             "pick tp among its divisors")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    if head is not None and head.weight is emb.weight:
        raise ValueError("tie_embeddings with tp > 1: the embedding and the head would split the "
                         "same matrix two ways; set tie_embeddings=false or tp=1")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    plan: dict[str, object] = {}
    for pattern, style in base.items():
        if style not in styles:
            raise ValueError(f"model_type={config.model_type!r}'s tensor parallel plan uses style "
                             f"{style!r} ({pattern}), which hpcshard does not map; use tp=1")
        plan[prefix + pattern] = styles[style]()
    names = {m: n for n, m in model.named_modules()}
    plan[names[emb]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if head is not None:
        # loss parallel: logits stay split by vocabulary (the runtime's cross entropy takes them)
        plan[names[head]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for name, module in model.named_modules():
        owns = next(module.parameters(recurse=False), None) is not None
        if owns and not any(fnmatch(name, p) for p in plan):
            plan[name] = Replicated()  # norms
    return plan


job = Job(config=Config, model=build_model, data=data, loss=loss, init=init,
          flops_per_token=flops_per_token, tp_plan=tp_plan)
