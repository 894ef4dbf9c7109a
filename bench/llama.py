"""A Llama-shaped job without transformers (for `python -m bench gpu` and the GPU layer's
planner test): RMSNorm, rotary positions, causal attention through SDPA, a SwiGLU MLP,
untied embeddings; the demo's byte data with a vocabulary of `vocab_size` rows (32000 by
default, as Llama 2: the head's matmul is a Llama's, whatever the tokens).

    hpcshard submit --nodes 1 --gpus 1 bench/llama.py --set precision=bf16 --set dim=2048
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
    """Small by default (it runs on CPU); the bench sets a GPU's sizes."""

    vocab_size: int = 32000
    dim: int = 256
    """Model width."""
    n_layers: int = 4
    """Decoder layers."""
    n_heads: int = 4
    """Attention heads (must divide dim)."""
    ffn: int = 0
    """SwiGLU hidden size; 0: Llama's 8/3 * dim rounded up to a multiple of 256."""
    rope_theta: float = 10000.0
    """Rotary base."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim} into an even head "
                             "size; pick n_heads among its divisors")

    def hidden(self) -> int:
        return self.ffn or 256 * math.ceil(8 * self.dim / 3 / 256)


def rotary(t: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (t, head_dim / 2), in fp32 (computed each forward:
    no buffer for the meta device to leave empty)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, t, head_dim), its halves rotated (the GPT-NeoX layout)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(cfg.dim, eps=1e-5), Attention(cfg.dim, cfg.n_heads)
        self.mlp_norm, self.mlp = nn.RMSNorm(cfg.dim, eps=1e-5), MLP(cfg.dim, cfg.hidden())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_layers, self.head_dim, self.theta = cfg.n_layers, cfg.dim // cfg.n_heads, cfg.rope_theta
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(idx.shape[1], self.head_dim, self.theta, idx.device)
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def init(root: nn.Module, name: str, module: nn.Module) -> None:
    """N(0, 0.02); the residual projections (o, down) scaled by 1/sqrt(2 * layers)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        residual = name.endswith((".o", ".down"))
        std = 0.02 / math.sqrt(2 * root.n_layers) if residual else 0.02  # type: ignore[operator]
        nn.init.normal_(module.weight, 0.0, std)
    elif isinstance(module, nn.RMSNorm):
        module.reset_parameters()


def data(cfg: Config) -> DataSplits:
    return load_splits(cfg)


def flops_per_token(cfg: Config, model: nn.Module) -> float:
    """6 * matmul parameters (the embedding is a lookup) + the attention scores (PaLM
    appendix B), as the demo counts."""
    n = sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.dim
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * cfg.seq_len


job = Job(config=Config, model=Llama, data=data, init=init, flops_per_token=flops_per_token)
