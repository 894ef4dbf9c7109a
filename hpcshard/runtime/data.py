"""Token data: deterministic, distributed, resumable, and independent of the world size.

A dataset is a flat 1-D token stream (bytes of text files, or a uint16/uint32 token file as
nanoGPT-style pipelines write) cut into windows of seq_len + 1 tokens. The order is a
seeded permutation per epoch, and step s takes the global batch perm[s*B:(s+1)*B]; each
rank takes its contiguous slice of it. So the same steps see the same samples on 1 rank or
on 64, and the whole position is two integers (epoch, offset): a checkpoint written on one
shape resumes on another without skipping or repeating a sample.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpcshard.errors import UserError

TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


@dataclass(kw_only=True)
class DataConfig:
    """Where a job's tokens come from: a config mixin (`class Config(TrainConfig, DataConfig)`)
    whose fields become --set keys, read by `load_splits`."""

    data: str = ""
    """A text file or directory read as bytes; empty: the stdlib's .py sources."""
    pattern: str = "*"
    """Glob for files under `data` when it is a directory."""
    tokens: str = ""
    """A flat binary token file for training instead of text."""
    tokens_eval: str = ""
    """Held-out token file (with `tokens`); empty: the last 5% of `tokens`."""
    token_dtype: str = "uint16"
    """uint16 | uint32, the element type of the token files."""
    vocab_size: int = 256
    """Vocabulary size; 256 for bytes (at least), the tokenizer's size for token files."""
    sft: str = ""
    """Fine-tuning data instead: a JSONL file of {"prompt", "completion"} or {"messages"}
    records, tokenized with `tokenizer`, the loss on completions / assistant turns only."""
    sft_eval: str = ""
    """Held-out JSONL for `sft`; empty: every 20th good record of `sft`."""
    tokenizer: str = ""
    """A local tokenizer directory for `sft`; empty: init_from's."""


def load_splits(cfg: DataConfig, vocab_size: int | None = None) -> DataSplits:
    """Fine-tuning records when `sft` is set, token files when `tokens` is, else the bytes
    of `data` (or the stdlib sources)."""
    if cfg.sft:
        from hpcshard.runtime.sft import load_sft

        if vocab_size is None:
            raise UserError("sft data needs the model's vocabulary size; this job does not pass it")
        sft = load_sft(cfg, vocab_size)
        return DataSplits(train=sft.train, eval=sft.eval, vocab_size=vocab_size,
                          train_targets=sft.train_targets, eval_targets=sft.eval_targets,
                          train_starts=sft.train_starts, eval_starts=sft.eval_starts,
                          report=sft.report)
    if cfg.tokens:
        train = token_file(cfg.tokens, cfg.token_dtype)
        vocab = vocab_size or cfg.vocab_size
        if cfg.tokens_eval:
            return DataSplits(train=train, eval=token_file(cfg.tokens_eval, cfg.token_dtype),
                              vocab_size=vocab)
        cut = int(len(train) * 0.95)
        return DataSplits(train=train[:cut], eval=train[cut:], vocab_size=vocab)
    return bytes_splits(text_files(cfg.data, cfg.pattern) if cfg.data else stdlib_sources())


@dataclass(frozen=True)
class DataSplits:
    """A job's data: the training stream and a held-out stream for evaluation."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int
    train_targets: np.ndarray | None = None
    """Fine-tuning data: what each token predicts, position for position (IGNORE where the
    loss is masked); None: the next token, everywhere."""
    eval_targets: np.ndarray | None = None
    report: str = ""
    """What was read and skipped, for the log."""
    train_starts: np.ndarray | None = None
    """Packed records (fine-tuning data): True at the first token of each record. A window
    then carries position ids that restart at each record (`positions`), for a loss that
    passes them on so records do not attend across their boundaries; None: one stream."""
    eval_starts: np.ndarray | None = None


def stdlib_sources() -> list[Path]:
    """The running Python's own standard-library `.py` files, sorted: text on every machine.

    Third-party packages and the (huge, repetitive) test suite are left out so the data
    does not change with what is installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    found = []
    for folder, subdirs, files in os.walk(root):  # pruned: never walks site-packages
        subdirs[:] = [d for d in subdirs if d not in skip]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def text_files(path: str | Path, pattern: str = "*") -> list[Path]:
    """A file, or the files under a directory that match `pattern`, sorted."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise UserError(f"data path {str(root)!r} does not exist; give a text file or directory")
    files = sorted(p for p in root.rglob(pattern) if p.is_file())
    if not files:
        raise UserError(f"no files match {pattern!r} under {str(root)!r}")
    return files


def bytes_splits(files: list[Path], eval_every: int = 20) -> DataSplits:
    """Bytes of the files as tokens (vocab 256). Every `eval_every`-th file is held out, so
    the evaluation text is spread over the corpus rather than one corner of it."""
    if len(files) < 2:
        data = np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8)
        cut = int(len(data) * (1 - 1 / eval_every))
        return DataSplits(train=data[:cut], eval=data[cut:], vocab_size=256)
    held = {i for i in range(len(files)) if i % eval_every == eval_every - 1}
    train = b"".join(p.read_bytes() for i, p in enumerate(files) if i not in held)
    test = b"".join(p.read_bytes() for i, p in enumerate(files) if i in held)
    return DataSplits(train=np.frombuffer(train, dtype=np.uint8),
                      eval=np.frombuffer(test, dtype=np.uint8), vocab_size=256)


def token_file(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """A flat binary token file (nanoGPT's train.bin), memory-mapped, never read whole."""
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"token dtype {dtype!r} is not valid; choose one of: {', '.join(TOKEN_DTYPES)}")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"token file {str(p)!r} does not exist")
    return np.memmap(p, dtype=TOKEN_DTYPES[dtype], mode="r")


def unigram_entropy(tokens: np.ndarray, vocab_size: int, limit: int = 50_000_000) -> float:
    """Entropy (nats/token) of the token frequencies: the loss of the best model that
    ignores context. A language model that learns anything beats it."""
    counts = np.bincount(np.asarray(tokens[:limit]), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


Micro = tuple[torch.Tensor, ...]
"""One micro-batch: (inputs, targets), and for packed records (inputs, targets, positions)."""


def positions(starts: np.ndarray) -> np.ndarray:
    """Position ids of windows (rows) of packed records: counted from 0 at a window's first
    token and again at each record's first token (`starts` True), so a record cut by the
    window's start begins at 0, as if truncated there."""
    idx = np.arange(starts.shape[-1])
    return idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)


def _windows(tokens: np.ndarray, seq_len: int, index: Iterable[int],
             targets: np.ndarray | None = None, starts: np.ndarray | None = None) -> Micro:
    """Windows of seq_len + 1 tokens: inputs, and the next tokens (or `targets`' values
    there, where fine-tuning masks the loss); with `starts`, the inputs' position ids too."""
    index = list(index)
    rows = np.stack([np.asarray(tokens[i * seq_len: i * seq_len + seq_len + 1]) for i in index])
    t = torch.from_numpy(rows.astype(np.int64))
    if targets is None:
        return t[:, :-1], t[:, 1:]
    ys = np.stack([np.asarray(targets[i * seq_len + 1: i * seq_len + seq_len + 1]) for i in index])
    if starts is None:
        return t[:, :-1], torch.from_numpy(ys.astype(np.int64))
    marks = np.stack([np.asarray(starts[i * seq_len: i * seq_len + seq_len]) for i in index])
    return t[:, :-1], torch.from_numpy(ys.astype(np.int64)), torch.from_numpy(positions(marks))


class GlobalBatches:
    """The training batches of one rank, in a world-size independent order.

    State is `(epoch, offset)`: the epoch's permutation is rebuilt from the seed, and
    `offset` samples of it were consumed. A trailing partial batch of an epoch is dropped.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, micro: int,
                 rank: int, world: int, seed: int, targets: np.ndarray | None = None,
                 starts: np.ndarray | None = None) -> None:
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.targets, self.starts = targets, starts
        self.micro, self.rank, self.world, self.seed = micro, rank, world, seed
        self.samples = (len(tokens) - 1) // seq_len
        if self.samples < batch_size:
            raise UserError(f"the training data has {self.samples} sequences of {seq_len + 1} "
                            f"tokens, fewer than one batch ({batch_size}); lower batch_size or seq_len")
        self.epoch, self.offset = 0, 0
        self._perm: torch.Tensor | None = None
        self.skip: set[tuple[int, int]] = set()
        """Global batches never to train on, by the (epoch, offset) they start at (a
        rollback after a non-finite loss skips the batches that led to it)."""

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.batch_size

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(self.samples, generator=gen)
        return self._perm

    def upcoming(self) -> tuple[int, int]:
        """Where the next global batch starts, (epoch, offset): the same on every rank and
        for every world size."""
        while True:
            if self.offset + self.batch_size > self.samples:
                self.epoch, self.offset, self._perm = self.epoch + 1, 0, None
            if (self.epoch, self.offset) not in self.skip:
                return self.epoch, self.offset
            self.offset += self.batch_size

    def next(self) -> list[Micro]:
        """This rank's micro-batches for the next optimizer step."""
        self.upcoming()
        per_rank = self.batch_size // self.world
        start = self.offset + self.rank * per_rank
        mine = self._permutation()[start:start + per_rank].tolist()
        self.offset += self.batch_size
        return [_windows(self.tokens, self.seq_len, mine[i:i + self.micro], self.targets, self.starts)
                for i in range(0, per_rank, self.micro)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset, self._perm = int(state["epoch"]), int(state["offset"]), None


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, micro: int, rank: int,
                 world: int, count: int, targets: np.ndarray | None = None,
                 starts: np.ndarray | None = None) -> Iterator[Micro]:
    """The first `count` global batches of the held-out stream, in order, this rank's slice."""
    samples = (len(tokens) - 1) // seq_len
    count = min(count, samples // batch_size)
    per_rank = batch_size // world
    for b in range(count):
        start = b * batch_size + rank * per_rank
        for i in range(start, start + per_rank, micro):
            yield _windows(tokens, seq_len, range(i, min(i + micro, start + per_rank)), targets, starts)


def eval_batch_count(tokens: np.ndarray, seq_len: int, batch_size: int, count: int) -> int:
    return min(count, ((len(tokens) - 1) // seq_len) // batch_size)
