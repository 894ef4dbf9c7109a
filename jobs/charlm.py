"""The demo job: a small GPT-style byte-level language model.

By default it trains on the running Python's standard-library sources: real text that is on
every machine without a download. Bytes are tokens (vocabulary 256), so there is no
tokenizer to fetch either. `--set data=DIR` trains on other text, `--set tokens=FILE` on a
flat uint16/uint32 token file (nanoGPT's train.bin; `tokens_eval` for the held-out split).

    hpcshard submit --nodes 2 --gpus 2 jobs/charlm.py --set steps=300
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcshard.config import TrainConfig
from hpcshard.runtime import Job
from hpcshard.runtime.data import DataConfig, DataSplits, load_splits


@dataclass(kw_only=True)
class Config(TrainConfig, DataConfig):
    """The demo's defaults take a few minutes on 2 CPU cores."""

    steps: int = 300
    lr: float = 3e-3
    dim: int = 128
    """Model width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads (must divide dim)."""
    dropout: float = 0.0
    """Dropout after attention and MLP."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide dim={self.dim}; "
                             "pick n_heads among the divisors of dim")
        if self.n_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide n_heads={self.n_heads}: each tensor "
                             "parallel rank computes whole heads; pick tp among its divisors")
        if self.seq_len % self.tp:
            raise ValueError(f"tp={self.tp} does not divide seq_len={self.seq_len} (sequence "
                             "parallelism splits the sequence); pick tp among its divisors")


class Attention(nn.Module):
    """Causal self-attention. Under tensor parallelism q, k and v hold this rank's heads
    (their output features), so the head count is read from the tensors."""

    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim, self.dropout = dim // n_heads, dropout
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(a.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, n_heads, dropout)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_layers = cfg.n_layers
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.n_heads, cfg.dropout)
                                    for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def init(root: nn.Module, name: str, module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        residual = name.endswith((".proj", ".out"))
        std = 0.02 / math.sqrt(2 * root.n_layers) if residual else 0.02  # type: ignore[operator]
        nn.init.normal_(module.weight, 0.0, std)
        bias = getattr(module, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def tp_plan(cfg: Config, model: nn.Module) -> dict[str, object]:
    """Tensor parallelism for `--set tp=K` (Megatron-style, with sequence parallelism):
    q, k, v and fc split by output features (a rank computes whole heads, a slice of the
    MLP), proj and out by input features, their sum reduce-scattered back to the sequence
    split; norms and the residual stream hold a slice of the sequence; the embeddings
    split by rows; the head gathers the sequence and returns logits split by vocabulary
    (a `Shard(-1)` DTensor), which the runtime's loss parallelism takes as they are."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (t, dim)
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn": gather,
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.mlp": gather,
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.out": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        # loss parallel: logits stay split by vocabulary, cross entropy works on them there
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def data(cfg: Config) -> DataSplits:
    return load_splits(cfg)


def flops_per_token(cfg: Config, model: nn.Module) -> float:
    """Training FLOPs per token (PaLM appendix B): 6 per parameter (2 forward, 4 backward)
    without the embeddings, which are lookups, not matmuls (`tok` is not tied to `head`,
    which is counted), plus the attention's QK^T and AV (2 * 2 * seq_len * dim per layer
    forward, 3x that with backward; causal masking not taken off, as PaLM counts it)."""
    n = sum(p.numel() for p in model.parameters()) - (cfg.vocab_size + cfg.seq_len) * cfg.dim
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * cfg.seq_len


job = Job(config=Config, model=CharLM, data=data, init=init, flops_per_token=flops_per_token,
          tp_plan=tp_plan)
