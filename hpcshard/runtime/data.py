"""Token data: deterministic, distributed, resumable, and independent of the world size.

A dataset is a flat 1-D token stream (bytes of text files, or a uint16/uint32 token file as
nanoGPT-style pipelines write) cut into windows of seq_len + 1 tokens, or prepared corpora
and mixtures of them (`runtime.corpus`). The order is a keyed permutation per epoch,
computed per index (`runtime.order`), and step s takes the global batch at positions
[s*B, (s+1)*B); each rank takes its contiguous slice of it. So the same steps see the same
samples on 1 rank or on 64, and the whole position is two integers (epoch, offset): a
checkpoint written on one shape resumes on another without skipping or repeating a sample.
The next steps' batches are prepared in a background thread (`runtime.loader`).
"""

from __future__ import annotations

import os
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpcshard.errors import UserError
from hpcshard.runtime.corpus import DOC_MODES, Blend, HeldOut, load_blend
from hpcshard.runtime.loader import Ahead
from hpcshard.runtime.order import Flat, sampler

TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
DATA_CHANGED = ("refuse", "accept")


@dataclass(kw_only=True)
class DataConfig:
    """Where a job's tokens come from: a config mixin (`class Config(TrainConfig, DataConfig)`)
    whose fields become --set keys, read by `load_splits`."""

    data: str = ""
    """Prepared corpora (`hpcshard data prepare`'s directories): a directory or a glob of
    them; a weighted mixture `NAME_OR_PATH:WEIGHT,...` (e.g. `web:0.7,code:0.2,math:0.1`,
    weights normalised); or a TOML file of `[sources.NAME]` tables with `path` and `weight`.
    Otherwise a text file or directory read as bytes; empty: the stdlib's .py sources."""
    data_root: str = ""
    """Where the relative paths and names of `data` are looked up; empty: the working
    directory (a TOML file's own paths: its folder)."""
    doc_mode: str = "stream"
    """How prepared documents become samples: stream (windows over the concatenated tokens,
    across documents) | whole (one sample per document, from its start: a document longer
    than seq_len + 1 tokens is truncated, its remaining tokens never trained on in any epoch;
    a shorter one is padded, its padding masked from the loss)."""
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
    held_out: str = "source"
    """How much of each prepared source is held out for evaluation (its last tokens, never
    trained on): source (5% of the source, at most 2^24 tokens) | last-shard (5% of its last
    shard, at most 2^20 tokens: the rule before, which a run resolved before this setting
    keeps, its checkpoints' positions meaning that split's samples)."""
    data_changed: str = "refuse"
    """What a resume does when the prepared corpora differ from what its checkpoint was
    trained on (a glob matches another directory, a weight or doc_mode was edited, a
    source grew): refuse (one line saying what changed) | accept (train on from the saved
    position; the samples from there differ from those the run would have trained)."""


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
    if cfg.data_changed not in DATA_CHANGED:
        raise UserError(f"data_changed={cfg.data_changed!r} is not valid; choose one of: "
                        f"{', '.join(DATA_CHANGED)}")
    vocab = vocab_size or cfg.vocab_size  # the ids the model embeds: those its corpora may hold
    blend = load_blend(cfg.data, cfg.data_root, cfg.doc_mode, cfg.held_out, vocab) if cfg.data else None
    if blend is not None:
        if blend.vocab_size > vocab:
            fix = (f"set vocab_size={blend.vocab_size}" if vocab_size is None
                   else "prepare it with the model's tokenizer")
            raise UserError(f"data {cfg.data!r} was prepared with a vocabulary of {blend.vocab_size} "
                            f"tokens, more than the model's {vocab}; {fix}")
        first = blend.sources[0].corpus
        return DataSplits(train=first.shards[0].data, eval=blend.held_out(), vocab_size=vocab,
                          source=blend, report=blend.report(), accept_changed=cfg.data_changed == "accept")
    if cfg.doc_mode != "stream":
        if cfg.doc_mode not in DOC_MODES:
            raise UserError(f"doc_mode={cfg.doc_mode!r} is not valid; choose one of: {', '.join(DOC_MODES)}")
        raise UserError(f"doc_mode={cfg.doc_mode} needs prepared corpora (documents); data={cfg.data!r} "
                        "is text read as bytes: use doc_mode=stream or prepare it")
    return bytes_splits(text_files(cfg.data, cfg.pattern) if cfg.data else stdlib_sources())


@dataclass(frozen=True)
class DataSplits:
    """A job's data: the training stream and a held-out stream for evaluation."""

    train: np.ndarray
    """The training stream; with `source`, its first shard only (for the unigram baseline)."""
    eval: np.ndarray | HeldOut
    """The held-out stream; prepared corpora's is read where evaluation reads it (`HeldOut`)."""
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
    source: Blend | None = None
    """Prepared corpora or their mixture: the batches come from it, not from `train`."""
    accept_changed: bool = False
    """data_changed=accept: a resume trains on when the corpora differ from its checkpoint's."""

    @property
    def train_tokens(self) -> int:
        if self.source is None:
            return len(self.train)
        return sum(s.corpus.train_tokens for s in self.source.sources)


def data_fingerprint(splits: DataSplits, seq_len: int, order: str) -> dict | None:
    """What decides a run's samples from prepared corpora, for its checkpoints' manifests
    (None for other data: its checkpoints record none)."""
    if splits.source is None:
        return None
    return {**splits.source.fingerprint(), "seq_len": seq_len, "data_order": order}


def data_fingerprint_v1(splits: DataSplits, seq_len: int, order: str) -> dict | None:
    """The same in the first format (no "version"), for a checkpoint written in it."""
    if splits.source is None:
        return None
    return {**splits.source.fingerprint_v1(), "seq_len": seq_len, "data_order": order}


def data_changes(saved: dict | None, now: dict | None, now_v1: dict | None = None) -> str:
    """What differs between a checkpoint's data fingerprint and this start's, in words
    ("" when nothing does, or the checkpoint recorded none: one written before it was).
    A fingerprint of the first format (no "version": spelled paths and counts) is compared
    with `now_v1`, this start's in that format, as it was then: a run resumes across the
    upgrade on the terms it was checked on."""
    if saved is None:
        return ""
    if now is not None and "version" not in saved and now_v1 is not None:
        return _changes_v1(saved, now_v1)
    if saved == now:
        return ""
    if now is None:
        return "it trained on prepared corpora, this start reads other data"
    said = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if k != "sources" and saved.get(k) != now[k]]
    old, new = saved.get("sources", []), now["sources"]
    if len(old) != len(new):
        said.append(f"sources {[s.get('name') for s in old]} -> {[s['name'] for s in new]}")
    for was, source in zip(old, new, strict=False):  # told apart by their place, as the order salts them
        said += [f"source {source['name']!r} {_said(k, was.get(k), v, source)}"
                 for k, v in source.items() if k not in ("name", "dirs") and was.get(k) != v]
    return "; ".join(said)


def _said(key: str, was: object, now: object, source: dict) -> str:
    if key == "content":
        return f"tokens differ (other shards, tokenizer or eos_id in {', '.join(source['dirs'])})"
    return f"{key} {was!r} -> {now!r}"


def _changes_v1(saved: dict, now: dict) -> str:
    if saved == now:
        return ""
    said = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if k != "sources" and saved.get(k) != now[k]]
    old = {s.get("name"): s for s in saved.get("sources", [])}
    new = {s["name"]: s for s in now["sources"]}
    said += [f"source {n!r} gone" for n in old if n not in new]
    said += [f"source {n!r} added" for n in new if n not in old]
    for n in (n for n in new if n in old):
        said += [f"source {n!r} {k} {old[n].get(k)!r} -> {v!r}"
                 for k, v in new[n].items() if old[n].get(k) != v]
    return "; ".join(said) or "the sources' order"


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


def _windows(tokens: np.ndarray | HeldOut, seq_len: int, index: Iterable[int],
             targets: np.ndarray | None = None, starts: np.ndarray | None = None) -> Micro:
    """Windows of seq_len + 1 tokens: inputs, and the next tokens (or `targets`' values
    there, where fine-tuning masks the loss); with `starts`, the inputs' position ids too
    (`order.Flat.rows`, as training's batches)."""
    rows = Flat(tokens, seq_len, targets, starts).rows(np.asarray(list(index), dtype=np.int64))
    return tuple(torch.from_numpy(a) for a in rows)


Batch = list[Micro]


class GlobalBatches:
    """The training batches of one rank, in a world-size independent order.

    State is `(epoch, offset)`: the epoch's order is computed from the seed, and `offset`
    samples of it were consumed. A trailing partial batch of an epoch is dropped (a
    mixture's epoch never ends: its sources wrap around on their own). `prefetch`: the
    next steps prepared in a background thread (`runtime.loader`), pinned when `pin` (a
    GPU copies them without blocking); the same batches either way.
    """

    def __init__(self, tokens: np.ndarray | Blend, *, seq_len: int, batch_size: int, micro: int,
                 rank: int, world: int, seed: int, targets: np.ndarray | None = None,
                 starts: np.ndarray | None = None, order: str = "feistel", prefetch: int = 0,
                 pin: bool = False) -> None:
        self.seq_len, self.batch_size = seq_len, batch_size
        self.micro, self.rank, self.world, self.seed = micro, rank, world, seed
        self.sampler = sampler(tokens, seq_len=seq_len, seed=seed, order=order, targets=targets,
                               starts=starts)
        self.samples = self.sampler.samples
        if self.samples < batch_size:
            raise UserError(f"the training data has {self.samples} sequences of {seq_len + 1} "
                            f"tokens, fewer than one batch ({batch_size}); lower batch_size or seq_len")
        self.epoch, self.offset = 0, 0
        self.skip: set[tuple[int, int]] = set()
        """Global batches never to train on, by the (epoch, offset) they start at (a
        rollback after a non-finite loss skips the batches that led to it)."""
        self.prefetch, self.pin = prefetch, pin
        self.ahead: Ahead[Batch] | None = Ahead(self.fetch) if prefetch else None
        self.waited = 0.0
        """Seconds `next` blocked for its batches since `wait_taken` last read them."""

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.batch_size

    def _settle(self, epoch: int, offset: int) -> tuple[int, int]:
        """The first global batch at or after (epoch, offset) that is whole and not skipped."""
        while True:
            if offset + self.batch_size > self.samples:
                epoch, offset = epoch + 1, 0
            if (epoch, offset) not in self.skip:
                return epoch, offset
            offset += self.batch_size

    def upcoming(self) -> tuple[int, int]:
        """Where the next global batch starts, (epoch, offset): the same on every rank and
        for every world size."""
        self.epoch, self.offset = self._settle(self.epoch, self.offset)
        return self.epoch, self.offset

    def fetch(self, epoch: int, offset: int) -> Batch:
        """This rank's micro-batches of the global batch at (epoch, offset): a pure function
        of it (safe in the loader's thread)."""
        per_rank = self.batch_size // self.world
        start = offset + self.rank * per_rank
        # inputs, targets (and packed records' position ids)
        parts = [torch.from_numpy(a) for a in self.sampler.rows(epoch, np.arange(start, start + per_rank,
                                                                                dtype=np.int64))]
        out = [tuple(t[i:i + self.micro] for t in parts) for i in range(0, per_rank, self.micro)]
        if self.pin:  # page-locked: the copy to the GPU does not block the host
            out = [tuple(t.pin_memory() for t in micro) for micro in out]
        return out

    def next(self) -> Batch:
        """This rank's micro-batches for the next optimizer step."""
        key = self.upcoming()
        began = time.perf_counter()
        batch = self.ahead.take(key) if self.ahead is not None else self.fetch(*key)
        self.waited += time.perf_counter() - began
        self.offset += self.batch_size
        if self.ahead is not None:
            keys, at = [], (self.epoch, self.offset)
            for _ in range(self.prefetch):
                at = self._settle(*at)
                keys.append(at)
                at = (at[0], at[1] + self.batch_size)
            self.ahead.plan(keys)
        return batch

    def wait_taken(self) -> float:
        """Seconds the loop waited for data since the last call (then zero again)."""
        waited, self.waited = self.waited, 0.0
        return waited

    def close(self) -> None:
        """Stop the loader's thread (what it prepared is dropped)."""
        if self.ahead is not None:
            self.ahead.close()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def eval_batches(tokens: np.ndarray | HeldOut, *, seq_len: int, batch_size: int, micro: int, rank: int,
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


def eval_batch_count(tokens: np.ndarray | HeldOut, seq_len: int, batch_size: int, count: int) -> int:
    return min(count, ((len(tokens) - 1) // seq_len) // batch_size)
