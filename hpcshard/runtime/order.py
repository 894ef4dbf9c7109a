"""The order samples are trained in, computed per index: no table, whatever the corpus size.

`Permutation` is a keyed bijection of [0, n): a 4-round Feistel network on the smallest
even number of bits that covers n, cycle-walking the values that land outside [0, n)
(each walk stays on the permutation's cycle, so it ends, on average in under 4 rounds).
Memory is a few integers; today's alternative, a `torch.randperm` table, is 8 bytes per
sample (80 GB for 1e13 tokens in windows of 1024).

`Mixed` interleaves weighted sources deterministically: global sample g goes to source 0
or to the rest by g's place in the sequence floor(g * p + 1/2) (p: source 0's share of
what is left), and so on down the sources. Each is an exact integer formula, so the source
of sample g and its index in that source cost O(sources), and among the first g samples
source i's count is within (sources - 1) of g * w_i. A source's own samples then run
through its epochs, each a fresh permutation: everything is a function of g.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Protocol

import numpy as np
import torch

from hpcshard.errors import UserError
from hpcshard.runtime.corpus import Blend, HeldOut, Windows

M64 = (1 << 64) - 1
ROUNDS = 4
ENDLESS = 1 << 62
"""A mixture's epoch length: its sources wrap around on their own (each its epochs)."""


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key_of(*parts: int) -> int:
    """One 64-bit key from a few integers (seed, source, epoch)."""
    h = np.zeros(1, dtype=np.uint64)
    for p in parts:
        h = mix64(h ^ np.array([p & M64], dtype=np.uint64))
    return int(h[0])


class Permutation:
    """A bijection of [0, n) keyed by `key`: `perm(np.arange(n))` is a shuffle of it."""

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(key_of(key, r)) for r in range(ROUNDS)]

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & self.mask)
        return (left << shift) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        """The images of `index` (values in [0, n)), as int64."""
        x = np.asarray(index, dtype=np.uint64).reshape(-1)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} of a permutation of {self.n}")
        x = self._rounds(x)
        out = x >= np.uint64(self.n)
        while out.any():  # cycle-walk: apply again until inside [0, n)
            x[out] = self._rounds(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)


class Sampler(Protocol):
    """Samples by their place in the global order: an epoch and positions within it."""

    samples: int
    """Samples per epoch."""

    def rows(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, ...]:
        """Inputs and targets of these positions, (len(positions), seq_len) int64 each, and
        packed records' position ids where the data marks its records' starts."""
        ...


class Flat:
    """A flat token array (and fine-tuning's targets, and its packed records' starts) in
    windows of seq_len + 1."""

    def __init__(self, tokens: np.ndarray | HeldOut, seq_len: int, targets: np.ndarray | None = None,
                 starts: np.ndarray | None = None) -> None:
        self.tokens, self.seq_len, self.targets, self.starts = tokens, seq_len, targets, starts
        self.count = (len(tokens) - 1) // seq_len

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        s = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * s: i * s + s + 1]) for i in ids.tolist()])
        rows = rows.astype(np.int64)
        if self.targets is None:
            return rows[:, :-1], rows[:, 1:]
        ys = np.stack([np.asarray(self.targets[i * s + 1: i * s + s + 1]) for i in ids.tolist()])
        if self.starts is None:
            return rows[:, :-1], ys.astype(np.int64)
        marks = np.stack([np.asarray(self.starts[i * s: i * s + s]) for i in ids.tolist()])
        return rows[:, :-1], ys.astype(np.int64), positions(marks)


def positions(starts: np.ndarray) -> np.ndarray:
    """Position ids of windows (rows) of packed records: counted from 0 at a window's first
    token and again at each record's first token (`starts` True), so a record cut by the
    window's start begins at 0, as if truncated there."""
    idx = np.arange(starts.shape[-1])
    return idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)


class Samples(Protocol):
    count: int

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, ...]: ...


class Ordered:
    """One source, shuffled anew each epoch: a Feistel `Permutation` keyed by the seed and
    the epoch, or (order="randperm") the table earlier releases used, for the exact resume
    of a run they started. `salt` tells a mixture's sources apart (0: a lone source, whose
    order is the one earlier releases drew)."""

    def __init__(self, source: Samples, seed: int, order: str = "feistel", salt: int = 0) -> None:
        self.source, self.seed, self.order, self.salt = source, seed, order, salt
        self.samples = source.count
        self._perm: tuple[int, Permutation | torch.Tensor] | None = None

    def permutation(self, epoch: int) -> Permutation | torch.Tensor:
        cached = self._perm  # one read: the loader's thread may replace it meanwhile
        if cached is not None and cached[0] == epoch:
            return cached[1]
        if self.order == "randperm":  # salt 0 (one source): the seed earlier releases used
            seed = (self.seed * 1_000_003 + epoch if not self.salt
                    else key_of(self.seed, self.salt, epoch) & ((1 << 63) - 1))
            gen = torch.Generator().manual_seed(seed)
            perm: Permutation | torch.Tensor = torch.randperm(self.samples, generator=gen)
        else:
            perm = Permutation(self.samples, key_of(self.seed, self.salt, epoch))
        self._perm = epoch, perm
        return perm

    def ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        perm = self.permutation(epoch)
        if isinstance(perm, torch.Tensor):
            return perm[torch.from_numpy(np.asarray(positions, dtype=np.int64))].numpy()
        return perm(positions)

    def rows(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.source.rows(self.ids(epoch, positions))


def split(g: int, share: Fraction) -> tuple[bool, int]:
    """Whether sample g of a sequence goes to the first of two parts that get `share` of it
    (floor(g * share + 1/2) of the first g), and its index within the part it goes to."""
    a, b = share.numerator, share.denominator
    before = (2 * g * a + b) // (2 * b)
    if (2 * (g + 1) * a + b) // (2 * b) > before:
        return True, before
    return False, g - before


class Mixed:
    """Weighted sources interleaved by `split`, each source on its own epochs. Its epoch is
    ENDLESS: the position is one integer, the global sample index."""

    def __init__(self, parts: list[Ordered], weights: list[Fraction]) -> None:
        self.parts = parts
        rest = [sum(weights[i:], Fraction(0)) for i in range(len(weights))]
        self.shares = [w / r for w, r in zip(weights, rest, strict=True)]
        self.samples = ENDLESS

    def locate(self, g: int) -> tuple[int, int]:
        """(source, index within the source's endless stream) of global sample g."""
        for i, share in enumerate(self.shares[:-1]):
            first, g = split(g, share)
            if first:
                return i, g
        return len(self.shares) - 1, g

    def rows(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        where = [self.locate(epoch * ENDLESS + int(g)) for g in positions]
        xs: list[np.ndarray] = [np.empty(0)] * len(where)
        ys: list[np.ndarray] = [np.empty(0)] * len(where)
        for i, part in enumerate(self.parts):
            mine = [r for r, (s, _) in enumerate(where) if s == i]
            by_epoch: dict[int, list[int]] = {}
            for r in mine:
                by_epoch.setdefault(where[r][1] // part.samples, []).append(r)
            for e, rs in sorted(by_epoch.items()):
                x, y = part.rows(e, np.array([where[r][1] % part.samples for r in rs], dtype=np.int64))
                for k, r in enumerate(rs):
                    xs[r], ys[r] = x[k], y[k]
        return np.stack(xs), np.stack(ys)


def sampler(source: np.ndarray | Blend, *, seq_len: int, seed: int, order: str = "feistel",
            targets: np.ndarray | None = None, starts: np.ndarray | None = None) -> Ordered | Mixed:
    """The sampler of a job's training data: a flat token array, or prepared corpora."""
    if not isinstance(source, Blend):
        return Ordered(Flat(source, seq_len, targets, starts), seed, order)
    parts = [Ordered(Windows(s.corpus, seq_len, source.doc_mode), seed, order, salt=i + 1)
             for i, s in enumerate(source.sources)]
    for s, part in zip(source.sources, parts, strict=True):
        if part.samples < 1:
            raise UserError(f"data source {s.name!r} holds no sample of {seq_len + 1} tokens "
                            f"({s.corpus.train_tokens} training tokens); lower seq_len or drop it")
    if len(parts) == 1:
        return parts[0]
    return Mixed(parts, [s.weight for s in source.sources])
