"""The decisions behind the loss, the schedules, the optimizer and activation checkpointing,
as pure functions: each table is what the trainer does for every case it meets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpcshard.config import TrainConfig, build_config
from hpcshard.errors import UserError
from hpcshard.runtime.data import GlobalBatches
from hpcshard.runtime.device import fused_optimizer
from hpcshard.runtime.job import lm_loss, takes_positions
from hpcshard.runtime.optim import decay_factor, lr_factor
from hpcshard.runtime.order import positions
from hpcshard.runtime.sft import IGNORE, record_starts
from hpcshard.runtime.shard import SAVED_OPS, _save_matmuls
from hpcshard.runtime.train import all_reduce_at, learnt_weights
from hpcshard.sections import OptimizerSection


def factors(sets: dict[str, str], steps: int = 100) -> list[float]:
    cfg = build_config(TrainConfig, {"steps": str(steps), "warmup_steps": "10", "min_lr_ratio": "0.1",
                                     **sets})
    return [lr_factor(s, OptimizerSection.of(cfg)) for s in range(steps + 1)]


@pytest.mark.parametrize("sets,at", [
    # (step: factor); warmup is (step + 1) / warmup_steps in every schedule
    ({"schedule": "constant"}, {0: 0.1, 9: 1.0, 10: 1.0, 50: 1.0, 100: 1.0}),
    ({"schedule": "cosine"}, {0: 0.1, 10: 1.0, 55: 0.55, 100: 0.1}),
    # wsd: stable until the last 20% (step 80), then down to 0.1 at step 100
    ({"schedule": "wsd", "decay_shape": "linear"}, {9: 1.0, 10: 1.0, 79: 1.0, 80: 1.0, 90: 0.55, 100: 0.1}),
    ({"schedule": "wsd", "decay_shape": "1-sqrt"},
     {79: 1.0, 80: 1.0, 85: 0.1 + 0.9 * (1 - math.sqrt(0.25)), 100: 0.1}),
    # a decay longer than what follows the warmup starts right after it, never inside it
    ({"schedule": "wsd", "decay_fraction": "1", "decay_shape": "linear"},
     {9: 1.0, 10: 1.0, 55: 0.55, 100: 0.1}),
    ({"schedule": "wsd", "decay_fraction": "0"}, {10: 1.0, 99: 1.0, 100: 1.0}),
])
def test_schedules(sets: dict[str, str], at: dict[int, float]) -> None:
    got = factors(sets)
    assert {s: got[s] for s in at} == pytest.approx(at)
    assert all(a >= b for a, b in zip(got[10:], got[11:], strict=False))  # never rises after warmup


def test_cosine_is_the_default_and_unchanged() -> None:
    """The built-in default is today's cosine, value for value."""
    assert TrainConfig().schedule == "cosine"
    cfg = OptimizerSection.of(TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1))
    old = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 10) / 90))) for s in range(10, 101)]
    assert [lr_factor(s, cfg) for s in range(10, 101)] == old


@pytest.mark.parametrize("progress,shape,want", [
    (0.0, "linear", 1.0), (0.5, "linear", 0.5), (1.0, "linear", 0.0),
    (0.0, "1-sqrt", 1.0), (0.25, "1-sqrt", 0.5), (1.0, "1-sqrt", 0.0),
])
def test_decay_shapes_go_from_one_to_the_floor(progress: float, shape: str, want: float) -> None:
    assert decay_factor(progress, shape, 0.0) == pytest.approx(want)
    assert decay_factor(progress, shape, 0.2) == pytest.approx(0.2 + 0.8 * want)


@pytest.mark.parametrize("sets,message", [
    ({"schedule": "linear"}, "schedule='linear' is not valid; choose one of: cosine, wsd, constant"),
    ({"decay_shape": "sqrt"}, "decay_shape='sqrt' is not valid; choose one of: linear, 1-sqrt"),
    ({"decay_fraction": "1.5"}, "decay_fraction=1.5 is not valid; it must be between 0 and 1"),
    ({"ac": "some"}, "ac='some' is not valid; choose none, full, selective, or a positive integer K"),
])
def test_bad_choices_are_one_line(sets: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(TrainConfig, sets)


@pytest.mark.parametrize("ac,every,selective", [
    ("none", 0, False), ("full", 1, False), ("selective", 1, True), ("3", 3, False),
])
def test_ac_modes(ac: str, every: int, selective: bool) -> None:
    cfg = TrainConfig(ac=ac)
    assert (cfg.ac_every(), cfg.ac_selective()) == (every, selective)


@pytest.mark.parametrize("mode,count,want", [
    # with accumulation, the replicas' all-reduce runs on the last micro-batch only
    ("hybrid", 3, [False, False, True]),
    ("none", 3, [False, False, True]),
    ("none", 2, [False, True]),
    # nothing to hold back: no replica dimension, or one micro-batch
    ("full", 3, [None, None, None]),
    ("grad-op", 2, [None, None]),
    ("none", 1, [None]),
    ("hybrid", 1, [None]),
])
def test_all_reduce_across_replicas_once_per_step(mode: str, count: int, want: list[bool | None]) -> None:
    assert [all_reduce_at(mode, i, count) for i in range(count)] == want


@pytest.mark.parametrize("counts,summed,world,want", [
    # one rank: the weights are each micro-batch's share of the step's learnt tokens
    ([3, 1], 4, 1, [0.75, 0.25]),
    # two data-parallel ranks, 4 + 12 tokens: FSDP averages over 2, hence the factor 2
    ([3, 1], 16, 2, [3 * 2 / 16, 1 * 2 / 16]),
    # tp=2 on 4 ranks: summed counts each tp pair twice (it shares its data), dp is 2
    ([3, 1], 32, 4, [3 * 2 / 16, 1 * 2 / 16]),
    # nothing learnt anywhere in the step: nothing weighs
    ([0, 0], 0, 2, [0.0, 0.0]),
])
def test_learnt_weights(counts: list[int], summed: int, world: int, want: list[float]) -> None:
    got = learnt_weights(counts, torch.tensor(summed), world)
    assert got.tolist() == pytest.approx(want)


def test_weighted_means_are_the_mean_over_every_learnt_token() -> None:
    """The identity the trainer relies on, on one rank: sum_i mean_i * weight_i is the mean
    over the learnt tokens of all micro-batches, however unevenly they are masked."""
    torch.manual_seed(0)
    logits, y = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    y[0, :4] = IGNORE
    y[2, :] = IGNORE  # a micro-batch with nothing learnt: its mean is nan, its weight 0
    counts = [int((r != IGNORE).sum()) for r in y]
    weights = learnt_weights(counts, torch.tensor(sum(counts)), 1)
    means = [torch.nn.functional.cross_entropy(logits[i], y[i]) for i in range(3)]
    got = sum(m * w for m, w, n in zip(means, weights, counts, strict=True) if n)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert got == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("starts,want", [
    ("......", [0, 1, 2, 3, 4, 5]),  # inside one record: from the window's start
    ("S.....", [0, 1, 2, 3, 4, 5]),
    ("..S...", [0, 1, 0, 1, 2, 3]),  # a record cut by the window, then a new one
    ("..S.SS", [0, 1, 0, 1, 0, 0]),  # one-token records
])
def test_positions_restart_at_each_record(starts: str, want: list[int]) -> None:
    marks = np.array([[c == "S" for c in starts]])
    assert positions(marks).tolist() == [want]


def test_record_starts_mark_each_records_first_token() -> None:
    items = [([1, 2, 3], [IGNORE] * 3), ([4], [4]), ([5, 6], [IGNORE, 6])]
    assert record_starts(items).tolist() == [True, False, False, True, True, False]
    assert record_starts([]).tolist() == []


def test_packed_windows_carry_their_position_ids() -> None:
    """With record starts the batches are (inputs, targets, positions); without, as before."""
    tokens = np.arange(40, dtype=np.uint16)
    targets = np.arange(40, dtype=np.int64)
    starts = np.zeros(40, dtype=bool)
    starts[[0, 5, 21]] = True
    plain = GlobalBatches(tokens, seq_len=8, batch_size=4, micro=4, rank=0, world=1, seed=0, targets=targets)
    packed = GlobalBatches(tokens, seq_len=8, batch_size=4, micro=4, rank=0, world=1, seed=0,
                           targets=targets, starts=starts)
    (x, y), = plain.next()
    (xp, yp, pos), = packed.next()
    assert torch.equal(x, xp) and torch.equal(y, yp)
    for row, p in zip(xp.tolist(), pos.tolist(), strict=True):
        first = row[0]
        want = [t - max([s for s in (0, 5, 21) if s <= t and s >= first] or [first]) for t in row]
        assert p == want


@pytest.mark.parametrize("device,offload,fused", [
    ("cuda", False, True), ("cuda", True, False), ("cpu", False, False), ("meta", False, False),
])
def test_fused_adamw_only_where_the_device_has_it(device: str, offload: bool, fused: bool) -> None:
    assert fused_optimizer(torch.device(device), offload) is fused
    assert not fused_optimizer(torch.device(device), offload, scaled=True)  # fp16's scaler: never


def test_fused_adamw_fails_under_the_sharded_scaler_which_is_why_fp16_never_gets_it() -> None:
    """The reason for `scaled` (pytorch 140514), shown where it can run: CPU has a fused
    AdamW too, and the (1,)-shaped found_inf the sharded scaler hands it fails its step
    (a 0-d one, the plain scaler's, passes)."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for found, fails in ((torch.zeros(1), True), (torch.zeros(()), False)):
        opt = torch.optim.AdamW([p], fused=True)
        opt.grad_scale, opt.found_inf = torch.ones(()), found  # type: ignore[attr-defined]
        if fails:
            with pytest.raises(RuntimeError, match="broadcast shape"):
                opt.step()
        else:
            opt.step()


def test_selective_ac_keeps_matmuls_and_attention_and_recomputes_the_rest() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert op in SAVED_OPS and _save_matmuls(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor):
        assert _save_matmuls(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_a_loss_says_whether_it_takes_positions() -> None:
    def packed(model: object, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None
               ) -> torch.Tensor:
        return x

    assert takes_positions(packed) and not takes_positions(lm_loss)


def test_selective_ac_refuses_an_in_place_change_of_a_saved_matmul_in_one_line() -> None:
    """ReLU(inplace=True) on a Linear's output: full AC takes it, selective AC's cache may
    not be mutated (recomputing `x += b` would apply it twice): one line that names ac=full."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from hpcshard.errors import UserError
    from hpcshard.runtime.shard import selective_context
    from hpcshard.runtime.train import backward

    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    backward(checkpoint(block, x, use_reentrant=False).sum())  # full AC: fine
    out = checkpoint(block, x, use_reentrant=False, context_fn=selective_context)
    with pytest.raises(UserError, match="ac=selective: the model changes a saved matmul output in place"):
        backward(out.sum())
