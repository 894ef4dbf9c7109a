from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hpcshard.runtime.data import (
    GlobalBatches,
    bytes_splits,
    eval_batches,
    stdlib_sources,
    text_files,
    token_file,
    unigram_entropy,
)

TOKENS = np.arange(10_000, dtype=np.int64) % 251


def batches(rank: int, world: int, micro: int = 0, batch: int = 8) -> GlobalBatches:
    return GlobalBatches(TOKENS, seq_len=16, batch_size=batch, micro=micro or batch // world,
                         rank=rank, world=world, seed=3)


def step_inputs(b: GlobalBatches) -> torch.Tensor:
    return torch.cat([x for x, _ in b.next()])


def test_global_batch_is_the_same_on_any_world_size() -> None:
    one = batches(0, 1)
    four = [batches(r, 4) for r in range(4)]
    for _ in range(5):
        assert torch.equal(step_inputs(one), torch.cat([step_inputs(b) for b in four]))


def test_targets_are_inputs_shifted_by_one() -> None:
    (x, y), = batches(0, 1).next()
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_micro_batches_split_the_rank_share() -> None:
    b = batches(1, 2, micro=2)
    assert [x.shape[0] for x, _ in b.next()] == [2, 2]


def test_state_resumes_exactly_across_epochs() -> None:
    a = batches(0, 1)
    steps = a.steps_per_epoch + 3  # crosses an epoch boundary
    for _ in range(steps):
        a.next()
    b = batches(0, 1)
    b.load_state_dict(a.state_dict())
    assert a.state_dict()["epoch"] == 1
    for _ in range(4):
        assert torch.equal(step_inputs(a), step_inputs(b))


def test_skipped_global_batches_are_never_trained_on_at_any_world_size() -> None:
    """A rollback's skip list: by where a batch starts, the same for 1 or 4 ranks, across
    an epoch's end (the next epoch starts where it would have)."""
    plain = batches(0, 1)
    order: list[tuple[tuple[int, int], torch.Tensor]] = []
    for _ in range(plain.steps_per_epoch + 2):
        position = plain.upcoming()
        order.append((position, step_inputs(plain)))
    last = plain.steps_per_epoch - 1
    skip = {order[2][0], order[last][0]}  # the 3rd batch and the epoch's last
    kept = [x for pos, x in order if pos not in skip]
    one, four = batches(0, 1), [batches(r, 4) for r in range(4)]
    for b in (one, *four):
        b.skip = set(skip)
    for want in kept:
        assert torch.equal(step_inputs(one), want)
        assert torch.equal(torch.cat([step_inputs(b) for b in four]), want)
    assert one.state_dict() == plain.state_dict()  # into the next epoch as without skips


def test_each_epoch_sees_every_sample_once() -> None:
    b = batches(0, 1, batch=1)
    seen = [int(step_inputs(b)[0, 0]) for _ in range(b.steps_per_epoch)]
    starts = [int(TOKENS[i * 16]) for i in range(b.samples)]
    assert sorted(seen) == sorted(starts)


def test_too_little_data_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than one batch"):
        GlobalBatches(TOKENS[:50], seq_len=16, batch_size=8, micro=8, rank=0, world=1, seed=0)


def test_eval_batches_are_fixed_and_sliced() -> None:
    full = list(eval_batches(TOKENS, seq_len=16, batch_size=4, micro=4, rank=0, world=1, count=2))
    parts = [list(eval_batches(TOKENS, seq_len=16, batch_size=4, micro=2, rank=r, world=2,
                               count=2)) for r in range(2)]
    assert torch.equal(full[0][0], torch.cat([parts[0][0][0], parts[1][0][0]]))


def test_token_file_is_memory_mapped(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    toks = token_file(path, "uint16")
    assert isinstance(toks, np.memmap) and toks[999] == 999
    with pytest.raises(ValueError, match="uint32"):
        token_file(path, "int8")
    with pytest.raises(ValueError, match="does not exist"):
        token_file(tmp_path / "nope.bin")


def test_text_files_and_held_out_split(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([65 + i % 26]) * 10)
    files = text_files(tmp_path, "*.txt")
    splits = bytes_splits(files)
    assert len(splits.train) == 380 and len(splits.eval) == 20  # every 20th file held out
    with pytest.raises(ValueError, match="no files match"):
        text_files(tmp_path, "*.md")
    with pytest.raises(ValueError, match="does not exist"):
        text_files(tmp_path / "missing")


def test_stdlib_sources_exclude_installed_packages() -> None:
    files = stdlib_sources()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in p.parts for p in files)


def test_unigram_entropy() -> None:
    assert unigram_entropy(np.zeros(100, dtype=np.uint8), 256) == 0.0
    assert unigram_entropy(np.arange(256, dtype=np.uint8), 256) == pytest.approx(np.log(256))
