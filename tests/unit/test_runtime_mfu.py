"""MFU's numerator: the demo's training FLOPs per token against a count by hand from the
model's shape (docs/user/metrics.md gives the formula). The multi-rank run that checks a
record's mfu against it is tests/distributed/test_step_time.py."""

from __future__ import annotations

from typing import Any

import pytest

from hpcshard.runtime.blocks import on_meta
from hpcshard.runtime.job import load_job
from tests.conftest import ROOT

DEMO = load_job(str(ROOT / "jobs" / "charlm.py"))


def hand_flops(dim: int, layers: int, seq_len: int, vocab: int) -> float:
    """6 FLOPs (2 forward, 4 backward) per weight a token meets in a matmul, biases and
    norms alike, the embeddings' lookups none; plus attention's two matmuls per layer,
    QK^T and AV, 2 * seq_len * dim each forward, 3x with backward (PaLM appendix B)."""
    d = dim
    attention = 4 * (d * d + d)  # q, k, v, proj: weights and biases
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)  # fc, out
    norms = 2 * 2 * d  # ln1, ln2: weight and bias
    params = layers * (attention + mlp + norms) + 2 * d + vocab * d  # + ln_f, head (no bias)
    return 6.0 * params + layers * 3 * (2 * seq_len * d + 2 * seq_len * d)


def demo_flops(**sets: Any) -> float:
    cfg = DEMO.config(**sets)
    with on_meta():
        model = DEMO.model(cfg)
    return DEMO.flops_per_token(cfg, model)


@pytest.mark.parametrize("sets", [{}, {"dim": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32},
                                  {"dim": 96, "n_layers": 3, "n_heads": 3, "seq_len": 256}])
def test_the_demos_flops_per_token_are_the_hand_count(sets: dict[str, Any]) -> None:
    cfg: Any = DEMO.config(**sets)
    assert demo_flops(**sets) == hand_flops(cfg.dim, cfg.n_layers, cfg.seq_len, cfg.vocab_size)


def test_the_default_demo_in_numbers() -> None:
    """dim 128, 4 layers, seq_len 128, 256 bytes: 793,088 block parameters, 256 of ln_f,
    32,768 of the head; 4 * 12 * 128 * 128 of attention. (Before the token embedding was
    left out as a lookup: 5,939,712, 3.4% more.)"""
    assert demo_flops() == 6.0 * (793_088 + 256 + 32_768) + 786_432 == 5_743_104.0
