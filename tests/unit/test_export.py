"""`ckpt export --hf`'s pieces that need no checkpoint: sizes, how tensors are cut into
files, and the streaming safetensors writer against safetensors' own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcshard.runtime.export import _groups, parse_size, write_safetensors

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                       ("60KB", 60_000), ("1000", 1000), ("1.5gb", 1_500_000_000)])
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "-5GB", "0", "5XB"])
def test_a_bad_size_is_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="--shard-size .* is not a size; give e.g. 5GB or 500MB"):
        parse_size(text)


def test_files_hold_at_most_the_limit_in_order_and_a_large_tensor_alone() -> None:
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("a", (10,)), ("b", (10,)), ("c", (30,)), ("d", (5,)), ("e", (5,))]
    assert _groups(shapes, 2, 40) == [["a", "b"], ["c"], ["d", "e"]]  # c: 60 bytes, alone
    assert _groups(shapes, 2, 10**9) == [["a", "b", "c", "d", "e"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_streamed_safetensors_file_is_what_safetensors_reads(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 3, generator=g), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "odd": torch.randn(5, generator=g), "t": torch.randn(3, 4, generator=g).t()}  # not contiguous
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    layout = [(k, tuple(v.shape)) for k, v in tensors.items()]
    batches = iter([{k: tensors[k] for k in ("w", "scalar")}, {k: tensors[k] for k in ("empty", "odd", "t")}])
    size = write_safetensors(tmp_path / "mine.safetensors", layout, dtype, batches, {"format": "pt"})
    back = load_file(tmp_path / "mine.safetensors")
    assert back.keys() == tensors.keys() and size == sum(v.nbytes for v in tensors.values())
    for k, v in tensors.items():
        assert back[k].dtype == dtype and torch.equal(back[k], v), k
    with safe_open(tmp_path / "mine.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = (tmp_path / "mine.safetensors").read_bytes()  # nothing after the data, header aligned
    header = int.from_bytes(raw[:8], "little")
    assert len(raw) == 8 + header + size and header % 8 == 0


def test_a_tensor_out_of_the_layout_is_a_bug_not_a_bad_file(tmp_path: Path) -> None:
    layout: list[tuple[str, tuple[int, ...]]] = [("a", (2,)), ("b", (3,))]
    with pytest.raises(AssertionError, match="b .* out of the layout's order"):
        write_safetensors(tmp_path / "x.safetensors", layout, torch.float32,
                          iter([{"b": torch.zeros(3)}]), {})
    with pytest.raises(AssertionError, match="fewer tensors than its header lists"):
        write_safetensors(tmp_path / "y.safetensors", layout, torch.float32,
                          iter([{"a": torch.zeros(2)}]), {})
