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


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads).permute(
            2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


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


def data(cfg: Config) -> DataSplits:
    return load_splits(cfg)


def flops_per_token(cfg: Config, model: nn.Module) -> float:
    """6 * matmul parameters + the attention scores (PaLM appendix B)."""
    n = sum(p.numel() for p in model.parameters()) - cfg.seq_len * cfg.dim  # no FLOPs in pos
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * cfg.seq_len


job = Job(config=Config, model=CharLM, data=data, init=init, flops_per_token=flops_per_token)
