"""A job of your own: your model, your data, your loss; hpcshard does the rest
(mesh, sharding, mixed precision, checkpointing of activations, the loop, metrics).

    hpcshard submit --nodes 2 --gpus 2 examples/custom_job/job.py --set data=README.md

A tiny byte-level model made of gated convolution blocks, trained on any text file with a
label-smoothed loss: nothing here is a transformer, and the block is still found by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcshard.config import TrainConfig
from hpcshard.runtime import Job
from hpcshard.runtime.data import DataSplits, bytes_splits, stdlib_sources, text_files


@dataclass(kw_only=True)
class Config(TrainConfig):
    dim: int = 64
    """Channels."""
    depth: int = 4
    """Gated convolution blocks."""
    kernel: int = 4
    """Causal convolution width."""
    data: str = ""
    """A text file or directory; empty: the stdlib's sources."""


class GatedConv(nn.Module):
    def __init__(self, dim: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.norm = nn.LayerNorm(dim)
        self.conv = nn.Conv1d(dim, 2 * dim, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.norm(x).transpose(1, 2), (self.kernel - 1, 0))  # causal: pad the past
        a, b = self.conv(h).chunk(2, dim=1)
        return x + (a * torch.sigmoid(b)).transpose(1, 2)


class ConvLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, cfg.dim)
        self.blocks = nn.ModuleList(GatedConv(cfg.dim, cfg.kernel) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.dim, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(cfg: Config) -> DataSplits:
    return bytes_splits(text_files(cfg.data) if cfg.data else stdlib_sources())


def smoothed_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy with 5% label smoothing; logits upcast so bf16 runs reduce in fp32."""
    logits = model(x).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=0.05)


job = Job(config=Config, model=ConvLM, data=data, loss=smoothed_loss)
