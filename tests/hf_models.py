"""Small Hugging Face checkpoints built locally with `save_pretrained` (no downloads): what
the init_from, LoRA and export tests start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from examples.finetune.make_base import tiny_tokenizer

__all__ = ["tiny_llama", "tiny_tokenizer"]


def tiny_llama(out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 128, vocab: int = 300, positions: int = 64, tie: bool = False,
               dtype: torch.dtype = torch.bfloat16, shard_size: str = "40KB", seed: int = 0) -> Any:
    """A random Llama saved to `out` in `dtype`, split into safetensors files of at most
    `shard_size` (with an index). Returns the model as saved (in `dtype`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, max_position_embeddings=positions,
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    model.save_pretrained(out, max_shard_size=shard_size)
    return model

