"""`ckpt export --hf`'s pieces that need no checkpoint: sizes and how tensors are cut into
files."""

from __future__ import annotations

import pytest

from hpcshard.runtime.export import _groups, parse_size

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
