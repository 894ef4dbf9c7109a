"""Prepared corpora (`hpcshard data prepare`'s token shards) and mixtures of them.

A prepared corpus is a directory: `manifest.json` ({"format": "hpcshard-tokens", "version":
1, "dtype", "vocab_size", "eos_id", "shards": [{"name", "tokens", "documents"}], ...}),
and per shard `NAME.bin` (the tokens, little-endian, documents concatenated) and `NAME.idx`
(little-endian int64, each document's first token in the shard, then the shard's length).
Every file is memory-mapped and read a window at a time: a rank's memory does not grow
with the corpus, only with its number of shards (a few integers each). At most MAX_OPEN
files are mapped at once (the least recently read is unmapped), so a corpus of any number
of shards stays within the open-file and map-count limits; each file is checked against its
manifest when first opened, not all at startup.

`data` names the sources (`parse_sources`): a prepared directory, or a glob of them (one
source); a mixture `NAME_OR_PATH:WEIGHT,...`; or a TOML file with `[sources.NAME]` tables
(`path`, `weight`). How samples are drawn from them is `runtime.order`'s.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import threading
import tomllib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from hpcshard.errors import UserError

FORMAT, VERSION = "hpcshard-tokens", 1
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DOC_MODES = ("stream", "whole")
IGNORE = -100
"""A target the loss skips (the padding of a short document in `whole` mode; the same
value as fine-tuning's, runtime.sft)."""
HELD_OUT = 1 << 24
"""At most this many tokens at the end of a source are held out for evaluation (5% of the
source when that is less): enough for eval_batches=4 at 4M tokens a step (8192 x 512), and
at most 64 MB of uint32 per rank."""
HELD_OUT_SHARE = 20
"""A source holds out 1/20 of its tokens (up to HELD_OUT)."""
HELD_OUT_RULES = ("source", "last-shard")
"""How much of a source is held out (`DataConfig.held_out`): source (5% of the whole source,
at most HELD_OUT) | last-shard (5% of its last shard, at most 2^20 tokens: the rule of runs
resolved before the setting, whose data positions mean that split)."""
LAST_SHARD_HELD_OUT = 1 << 20
"""The last-shard rule's cap."""
EVAL_CHUNK = 1024
"""A mixture's held-out tails are interleaved this many tokens at a time (`Blend.held_out`)."""


MAX_OPEN = 64
"""At most this many shard files are memory-mapped at once (each map holds a file
descriptor and a map: a corpus of 1e5 shards would pass both limits)."""


def is_prepared(path: Path) -> bool:
    """A directory `hpcshard data prepare` wrote (a manifest.json that names our format; a
    stray manifest.json of something else leaves a text directory text)."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        with manifest.open("rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return True  # ours or not, reading it fails: read_manifest says so in one line
    return FORMAT.encode() in head


class _Maps:
    """The shard files mapped now, least recently read first (at most MAX_OPEN; the loader's
    thread reads too, hence the lock). A file is checked against its manifest the first
    time it is opened."""

    def __init__(self) -> None:
        self.open: OrderedDict[tuple[Shard, str], np.ndarray] = OrderedDict()
        self.checked: set[tuple[Shard, str]] = set()
        self.lock = threading.Lock()

    def get(self, shard: Shard, kind: str) -> np.ndarray:
        key = (shard, kind)
        with self.lock:
            found = self.open.get(key)
            if found is not None:
                self.open.move_to_end(key)
                return found
        array = shard.map(kind, check=key not in self.checked)
        with self.lock:
            self.checked.add(key)
            self.open[key] = array
            while len(self.open) > MAX_OPEN:
                self.open.popitem(last=False)  # unmapped once the last reader drops it
        return array


MAPS = _Maps()


@dataclass(frozen=True)
class Shard:
    """One shard of a prepared corpus: its files and sizes (mapped lazily, `MAPS`)."""

    bin: Path
    idx: Path
    tokens: int
    documents: int
    dtype: np.dtype

    @property
    def data(self) -> np.ndarray:
        return MAPS.get(self, "data")

    @property
    def offsets(self) -> np.ndarray:
        return MAPS.get(self, "offsets")

    def map(self, kind: str, check: bool) -> np.ndarray:
        """The tokens or the document offsets, memory-mapped, their size checked against the
        manifest each time (a file mapped again after the LRU dropped it may have been
        re-prepared under the run: one line, not a larger file read silently or numpy's
        ValueError for a smaller one); `check`: the offsets' values too (first map only: a
        read of the whole index)."""
        path, dtype, count = ((self.bin, self.dtype, self.tokens) if kind == "data"
                              else (self.idx, np.dtype("<i8"), self.documents + 1))
        try:  # (a stat: cheap next to the map itself)
            size = path.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{path} is missing; prepare the corpus again with "
                            "`hpcshard data prepare`") from None
        if size != count * dtype.itemsize:
            raise UserError(f"{path} holds {size} bytes, its manifest says {count * dtype.itemsize}; "
                            "the corpus is damaged or still being written: prepare it again")
        array = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        if check and kind == "offsets":
            first, last = int(array[0]), int(array[-1])
            if first != 0 or last != self.tokens or bool((np.diff(array) < 0).any()):
                raise UserError(f"{path}: its document offsets are not 0, non-decreasing, up to the "
                                f"shard's {self.tokens} tokens (first {first}, last {last}); the corpus is "
                                "damaged: prepare it again")
        return array


def read_manifest(folder: Path) -> dict:
    """A prepared corpus's manifest, checked (one line naming the file and what is wrong)."""
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not a readable manifest ({err}); prepare the corpus again "
                        "with `hpcshard data prepare`") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: a {type(manifest).__name__}, not an object; the corpus is damaged: "
                        "prepare it again with `hpcshard data prepare`")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
                        f"is not {FORMAT!r} version {VERSION}; prepare it with `hpcshard data prepare`")
    if manifest.get("dtype") not in DTYPES:
        raise UserError(f"{path}: dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    _field(path, manifest, "vocab_size", _count, "a positive integer", positive=True)
    _field(path, manifest, "tokens", _count, "an integer")
    if manifest.get("eos_id") is not None:
        _field(path, manifest, "eos_id", _count, "an integer or null")
    shards = _field(path, manifest, "shards", lambda v: isinstance(v, list), "a list")
    for k, entry in enumerate(shards):
        where = f"shards[{k}]"
        if not isinstance(entry, dict):
            raise UserError(f"{path}: {where} is {entry!r}, not an object; the corpus is damaged: "
                            "prepare it again")
        _field(path, entry, "name", lambda v: isinstance(v, str) and bool(v) and "/" not in v and v[0] != ".",
               "a file name", where=where)
        _field(path, entry, "tokens", _count, "an integer", where=where)
        _field(path, entry, "documents", _count, "an integer", where=where)
    if sum(e["tokens"] for e in shards) != manifest["tokens"]:
        raise UserError(f"{path}: its shards hold {sum(e['tokens'] for e in shards)} tokens, its "
                        f"`tokens` says {manifest['tokens']}; the corpus is damaged: prepare it again")
    return manifest


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _field(path: Path, table: dict, name: str, valid: Callable[[Any], bool], what: str, where: str = "",
           positive: bool = False) -> Any:
    """table[name], or one line naming the file and the field when it is missing or not `what`."""
    label = f"{where}.{name}" if where else name
    if name not in table:
        raise UserError(f"{path}: {label} is missing; the corpus is damaged: prepare it again with "
                        "`hpcshard data prepare`")
    value = table[name]
    if not valid(value) or (positive and not value):
        raise UserError(f"{path}: {label} is {json.dumps(value)}, not {what}; the corpus is damaged: "
                        "prepare it again with `hpcshard data prepare`")
    return value


class Corpus:
    """All the shards of one or more prepared directories, as one token stream whose
    documents are numbered in order. Its last tokens (`held_tokens`: by the `held_out`
    rule) are held out; training reads the rest (`train_tokens`, `train_documents`)."""

    def __init__(self, folders: list[Path], name: str = "", held_out: str = "source",
                 bound: int | None = None) -> None:
        self.name = name or str(folders[0])
        self.shards: list[Shard] = []
        self.folders = [Path(os.path.realpath(f)) for f in folders]
        """The directories as the file system resolves them (for display: the content decides)."""
        content = hashlib.sha256()
        self.vocab_size, self.eos_id = 0, None
        self.tokenizer: Tokenization | None = None
        """What every folder was prepared with (`same_tokenizer`), and the first folder."""
        for folder in folders:
            manifest = read_manifest(folder)
            mine = Tokenization.of(manifest, folder)
            if self.tokenizer is None:
                self.tokenizer = mine
            self.tokenizer.same_as(mine)
            self.vocab_size, self.eos_id = mine.vocab_size, mine.eos_id
            content.update(_content(manifest).encode() + b"\n")
            dtype = DTYPES[manifest["dtype"]]
            for entry in manifest["shards"]:  # files checked when first read (`Shard.map`)
                shard = Shard(folder / f"{entry['name']}.bin", folder / f"{entry['name']}.idx",
                              int(entry["tokens"]), int(entry["documents"]), dtype)
                if shard.tokens:
                    self.shards.append(shard)
        if not self.shards:
            raise UserError(f"data source {self.name!r} holds no tokens; prepare it with "
                            "`hpcshard data prepare`")
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards], dtype=np.int64)
        """Each shard's first token in the stream, then the stream's length."""
        self.doc_starts = np.cumsum([0] + [s.documents for s in self.shards], dtype=np.int64)
        self.tokens = int(self.starts[-1])
        self.content = content.hexdigest()
        """What the tokens are, whatever the path's spelling: each directory's tokenizer,
        eos_id, dtype and shards (names, sizes, checksums), in order (`_content`)."""
        self.train_tokens = self.tokens - held_tokens(self.tokens, self.shards[-1].tokens, held_out)
        self.train_documents = self._documents_before(self.train_tokens)
        self.bound, self.bound_is = ((bound, "the model's vocab_size") if bound is not None
                                     else (self.vocab_size, "the manifest's vocab_size"))
        """Ids at or above it are refused where they are read (`_ids`): the model's vocab_size
        (its embedding's rows; `load_splits` refuses one below the manifest's), else the
        manifest's."""

    def _documents_before(self, token: int) -> int:
        """How many documents start before `token`."""
        k = int(np.searchsorted(self.starts, token, side="right")) - 1
        if k >= len(self.shards):
            return int(self.doc_starts[-1])
        local = int(np.searchsorted(self.shards[k].offsets[:-1], token - self.starts[k], side="left"))
        return int(self.doc_starts[k]) + local

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, across shards, as int64."""
        out = np.empty(length, dtype=np.int64)
        k, done = int(np.searchsorted(self.starts, start, side="right")) - 1, 0
        while done < length:
            at = start + done - int(self.starts[k])
            piece = self._ids(k, at, self.shards[k].data[at: at + length - done])
            out[done: done + len(piece)] = piece
            done, k = done + len(piece), k + 1
        return out

    def _ids(self, k: int, at: int, piece: np.ndarray) -> np.ndarray:
        """Tokens read from shard k at `at`, refused in one line naming the shard when one is
        not below `bound` (a damaged shard, or a tokenizer's gap id that an older `data
        prepare` wrote past the bound it gave): such an id would fail in the model's
        embedding (on a GPU: a device-side assert, at every restart). The model's vocab_size,
        not the manifest's: a corpus an older `data prepare` wrote past its manifest's bound
        trained with a model that holds its ids (an embedding padded above the tokenizer's
        ids, or vocab_size set above them), and goes on training. Checked where tokens are
        read, not by reading a whole shard when it is first mapped: a rank reads windows,
        and every rank reading every shard it touches whole would read the corpus at each
        start."""
        if len(piece) and int(piece.max()) >= self.bound:
            bad = int(np.argmax(piece >= self.bound))
            raise UserError(f"{self.shards[k].bin}: token {at + bad} is id {int(piece[bad])}, not below "
                            f"{self.bound_is} {self.bound}; the corpus is damaged or was prepared with a "
                            "wrong bound: prepare it again with `hpcshard data prepare`")
        return piece

    def document(self, d: int) -> tuple[int, int]:
        """Document d's first token in the stream and its length."""
        k = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        lo, hi = self.shards[k].offsets[d - int(self.doc_starts[k]): d - int(self.doc_starts[k]) + 2]
        return int(self.starts[k]) + int(lo), int(hi - lo)

    def read_raw(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) in the shards' own dtype (a view when in one shard)."""
        if length <= 0:
            return np.empty(0, dtype=self.shards[-1].dtype)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        at = start - int(self.starts[k])
        if at + length <= self.shards[k].tokens:
            return self._ids(k, at, self.shards[k].data[at: at + length])
        return self.read(start, length).astype(self.shards[k].dtype)

    def held_out(self) -> HeldOut:
        """Its held-out tail, read where evaluation takes a window (`HeldOut`)."""
        held = self.tokens - self.train_tokens
        return HeldOut([self], np.zeros(1, np.int64), np.array([self.train_tokens]), np.array([held]),
                       self.shards[-1].dtype)


class HeldOut:
    """Held-out tokens: pieces of corpora (piece i: tokens [first[i], first[i] + lengths[i])
    of `corpora[which[i]]`; a source's tail, or a mixture's tails interleaved), read where
    evaluation takes a window, through `Corpus.read_raw`: their ids are checked there as
    training's are (`Corpus._ids`), and nothing is read at the start. A tail read and checked
    whole at every start read a 2^24 token tail (64 MB of uint32) per node and per source
    from shared storage, every source's whole tail in a mixture that keeps 2^24 tokens in
    all. Evaluation takes slices of it (`order.Flat`), each in `dtype` (a view of a shard's
    map where the slice is in one)."""

    def __init__(self, corpora: list[Corpus], which: np.ndarray, first: np.ndarray, lengths: np.ndarray,
                 dtype: np.dtype) -> None:
        self.corpora, self.which, self.first, self.dtype = corpora, which, first, np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        """Where each piece starts in the held-out stream; the last: its length."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        """Tokens [start, stop) of the held-out stream (a slice of step 1)."""
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("held-out tokens are read in slices of step 1")
        parts, at = [], start
        k = int(np.searchsorted(self.starts, at, side="right")) - 1
        while at < stop:
            offset = at - int(self.starts[k])
            take = min(int(self.starts[k + 1]) - at, stop - at)
            parts.append(self.corpora[self.which[k]].read_raw(int(self.first[k]) + offset, take))
            at, k = at + take, k + 1
        if len(parts) == 1:
            return parts[0].astype(self.dtype, copy=False)
        return np.concatenate(parts, dtype=self.dtype) if parts else np.empty(0, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """All of it, read now (np.asarray)."""
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def held_tokens(tokens: int, last_shard: int, rule: str) -> int:
    """How many tokens at a source's end are held out for evaluation. `source`: 5% of the
    source, at most HELD_OUT (evaluation's batches of 1M+ tokens fit). `last-shard`, the
    rule before: 5% of the last shard (data prepare's remainder: often tiny), at most
    2^20 tokens; kept for runs resolved before the setting, whose checkpoints' positions
    mean the samples of that split."""
    if rule == "last-shard":
        return min(LAST_SHARD_HELD_OUT, last_shard // HELD_OUT_SHARE)
    return min(HELD_OUT, tokens // HELD_OUT_SHARE)


def _content(manifest: dict) -> str:
    """A prepared directory's tokens as its manifest vouches for them (the checksums data
    prepare wrote), in a stable text."""
    tok = manifest.get("tokenizer")
    shards = [[e["name"], e["tokens"], e["documents"], e.get("sha256")] for e in manifest["shards"]]
    return json.dumps([tok.get("sha256") if isinstance(tok, dict) else None, manifest.get("eos_id"),
                       manifest["dtype"], manifest["vocab_size"], shards], sort_keys=True)


@dataclass(frozen=True)
class Tokenization:
    """What a prepared folder's tokens mean: its vocabulary, tokenizer and end of text."""

    folder: Path
    vocab_size: int
    sha256: object
    eos_id: object

    @classmethod
    def of(cls, manifest: dict, folder: Path) -> Tokenization:
        tok = manifest.get("tokenizer")
        return cls(folder, int(manifest["vocab_size"]), tok.get("sha256") if isinstance(tok, dict) else None,
                   manifest.get("eos_id"))

    def same_as(self, other: Tokenization) -> None:
        """One line naming both folders when `other` was prepared otherwise: the same ids
        would mean different text."""
        for what, a, b in (("vocabulary size", self.vocab_size, other.vocab_size),
                           ("tokenizer (sha256)", self.sha256, other.sha256),
                           ("eos_id", self.eos_id, other.eos_id)):
            if a != b:
                raise UserError(f"{self.folder} and {other.folder} were prepared with a different {what} "
                                f"({a!r} and {b!r}); prepare every source with the same tokenizer")


class Windows:
    """A corpus cut into training samples of seq_len + 1 tokens: `stream` (windows over the
    concatenated tokens, across documents) or `whole` (one sample per document, starting at
    its first token: truncated when longer, padded with the loss masked when shorter)."""

    def __init__(self, corpus: Corpus, seq_len: int, mode: str) -> None:
        self.corpus, self.seq_len, self.mode = corpus, seq_len, mode
        self.count = ((corpus.train_tokens - 1) // seq_len if mode == "stream"
                      else corpus.train_documents)

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples `ids`: inputs and targets, (len(ids), seq_len) int64 each."""
        n = self.seq_len + 1
        rows = np.zeros((len(ids), n), dtype=np.int64)
        targets = np.empty((len(ids), self.seq_len), dtype=np.int64)
        for r, i in enumerate(ids.tolist()):
            if self.mode == "stream":
                rows[r] = self.corpus.read(i * self.seq_len, n)
                targets[r] = rows[r, 1:]
                continue
            start, length = self.corpus.document(i)
            length = min(length, n, self.corpus.train_tokens - start)
            rows[r, :length] = self.corpus.read(start, length)
            targets[r] = rows[r, 1:]
            targets[r, max(0, length - 1):] = IGNORE
        return rows[:, :-1], targets


@dataclass(frozen=True)
class Source:
    """One named source of a mixture and its weight (normalised by `Blend`)."""

    name: str
    corpus: Corpus
    weight: Fraction


@dataclass(frozen=True)
class Blend:
    """What `data` names when it names prepared corpora: the sources, their weights and how
    documents become samples. `runtime.order.sampler` draws from it."""

    sources: tuple[Source, ...]
    doc_mode: str = "stream"
    held_rule: str = "source"
    """The held-out rule the sources were opened with (`held_tokens`)."""

    @property
    def vocab_size(self) -> int:
        return max(s.corpus.vocab_size for s in self.sources)

    def held_out(self) -> HeldOut:
        """The held-out tails of the sources interleaved EVAL_CHUNK tokens at a time while
        each lasts (a short tail runs out, the others go on: one small source once cut every
        tail to its own length, and evaluation off), at most HELD_OUT tokens in all: however
        little evaluation reads, every source is in it alike. One source: its tail as it is;
        none left: empty. Read where evaluation reads it (`HeldOut`)."""
        if len(self.sources) == 1:
            return self.sources[0].corpus.held_out()
        corpora = [s.corpus for s in self.sources if s.corpus.tokens > s.corpus.train_tokens]
        if not corpora:
            dtype = self.sources[0].corpus.shards[-1].dtype
            return HeldOut([], np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), dtype)
        train = np.array([c.train_tokens for c in corpora])
        held = np.array([c.tokens for c in corpora]) - train
        at = np.arange(0, held.max(), EVAL_CHUNK)[:, None]  # each round's place in every tail
        lengths = np.clip(held - at, 0, EVAL_CHUNK).ravel()  # round by round, source by source
        keep = (lengths > 0) & (np.cumsum(lengths) - lengths < HELD_OUT)  # while under HELD_OUT
        which = np.tile(np.arange(len(corpora)), len(at))[keep]
        return HeldOut(corpora, which, (train + at).ravel()[keep], lengths[keep],
                       np.result_type(*(c.shards[-1].dtype for c in corpora)))

    def fingerprint(self) -> dict:
        """What decides the samples (with seq_len and the order), by content: each source's
        tokens (`Corpus.content`), sizes and weight, in order (a mixture's sources are told
        apart by their place: names and directories are shown, not compared), doc_mode and
        the held-out rule. A checkpoint records it; a resume compares it."""
        return {"version": 2, "doc_mode": self.doc_mode, "held_out": self.held_rule, "sources": [
            {"name": s.name, "dirs": [str(f) for f in s.corpus.folders], "content": s.corpus.content,
             "tokens": s.corpus.tokens, "documents": int(s.corpus.doc_starts[-1]),
             "weight": f"{s.weight.numerator}/{s.weight.denominator}"} for s in self.sources]}

    def fingerprint_v1(self) -> dict:
        """The fingerprint's first format (spelled names and directories, sizes): what a
        checkpoint written before version 2 holds, compared as it was then."""
        return {"doc_mode": self.doc_mode, "sources": [
            {"name": s.name, "dirs": sorted({str(sh.bin.parent) for sh in s.corpus.shards}),
             "tokens": s.corpus.tokens, "documents": int(s.corpus.doc_starts[-1]),
             "weight": f"{s.weight.numerator}/{s.weight.denominator}"} for s in self.sources]}

    def report(self) -> str:
        return ", ".join(f"{s.name} ({s.corpus.tokens:,} tokens, weight {float(s.weight):.3g})"
                         for s in self.sources) + f"; documents: {self.doc_mode}"


def parse_sources(value: str, root: str = "") -> list[tuple[str, list[Path], Fraction]] | None:
    """The sources `data` names as (name, directories, weight), or None when it names no
    prepared corpus (text files, read as bytes). Relative paths are looked up under `root`
    (the working directory when empty; a TOML file's folder for its own paths)."""
    base = Path(root or ".")
    if value.endswith(".toml") and (base / value).is_file():
        return _toml_sources(base / value)
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.exists() and Path(value).exists():  # text is read from the working directory
        path = Path(value)
    if path.exists():  # a path first: a comma or a ":2" in its name makes no mixture
        if path.is_dir() and is_prepared(path):
            return [(value, [path], Fraction(1))]
        _unfinished(path)
        return None
    if "," in value or _weighted(value):
        out = []
        for entry in value.split(","):
            name, _, weight = entry.strip().rpartition(":")
            if not name:
                raise UserError(f"data source {entry.strip()!r} has no weight; write NAME_OR_PATH:WEIGHT, "
                                "e.g. data=web:0.7,code:0.3")
            out.append((name, _folders(name, base), _weight(name, weight)))
        return _unique(out)
    folders = _folders(value, base, required=False)
    return [(value, folders, Fraction(1))] if folders else None


def _weighted(value: str) -> bool:
    _, sep, tail = value.rpartition(":")
    try:
        return bool(sep) and math.isfinite(float(tail))
    except ValueError:
        return False


def _weight(name: str, text: object) -> Fraction:
    try:
        weight = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise UserError(f"data source {name!r} has weight {text!r}; a weight must be a positive "
                        "number (weights are normalised: web:7,code:3 is web:0.7,code:0.3)")
    return Fraction(str(weight))  # exact: normalising never rounds a small weight to 0


def _folders(pattern: str, base: Path, required: bool = True) -> list[Path]:
    """The prepared directories a source's path (or glob) names, sorted."""
    full = pattern if Path(pattern).is_absolute() else str(base / pattern)
    matches = [Path(p) for p in glob.glob(full)]
    found = sorted(p for p in matches if is_prepared(p))
    for p in matches:
        if p not in found:
            _unfinished(p)
    if not found and required:
        raise UserError(f"data source {pattern!r} names no prepared corpus (a directory with a "
                        f"manifest.json under {str(base)!r}); prepare it with `hpcshard data prepare` "
                        "or fix the path")
    return found


def _unfinished(path: Path) -> None:
    """One line when a directory without a manifest is a corpus being prepared (or whose
    preparation stopped: the manifest is written last) or holds prepared corpora below it:
    read as text, its tokens would train as bytes."""
    if not path.is_dir():
        return
    if (path / ".prepare").exists() or any(path.glob("shard-*.bin")) or any(path.glob("shard-*.idx")):
        raise UserError(f"data directory {str(path)!r} has no manifest.json: its preparation did not "
                        "finish; run `hpcshard data prepare` again (it goes on where it stopped), then train")
    below = sorted(p.parent.name for p in path.glob("*/manifest.json") if is_prepared(p.parent))
    if below:
        raise UserError(f"data directory {str(path)!r} is no prepared corpus, its subdirectories "
                        f"{', '.join(below[:3])}{', ...' if len(below) > 3 else ''} are: name them "
                        f"(data={str(path)}/* for all as one source, or a mixture NAME:WEIGHT,...)")


def _toml_sources(path: Path) -> list[tuple[str, list[Path], Fraction]]:
    try:
        tables = tomllib.loads(path.read_text()).get("sources")
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"{path}: not readable TOML ({err})") from None
    if not isinstance(tables, dict) or not tables:
        raise UserError(f"{path} has no [sources.NAME] tables; write e.g. [sources.web] with "
                        "path = \"corpora/web\" and weight = 0.7")
    out = []
    for name, table in tables.items():
        if not isinstance(table, dict) or "path" not in table:
            raise UserError(f"{path}: [sources.{name}] needs a path (a prepared directory or a glob)")
        out.append((name, _folders(str(table["path"]), path.parent), _weight(name, table.get("weight", 1))))
    return _unique(out)


def _unique(sources: list[tuple[str, list[Path], Fraction]]) -> list[tuple[str, list[Path], Fraction]]:
    names = [name for name, _, _ in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"data source {twice[0]!r} is named twice; give each source once")
    return sources


def load_blend(value: str, root: str = "", doc_mode: str = "stream",
               held_out: str = "source", bound: int | None = None) -> Blend | None:
    """The corpora `data` names, opened (manifests and sizes checked), or None (not corpora).
    `bound`: the model's vocab_size, the ids its corpora may hold (`Corpus.bound`)."""
    if doc_mode not in DOC_MODES:
        raise UserError(f"doc_mode={doc_mode!r} is not valid; choose one of: {', '.join(DOC_MODES)}")
    if held_out not in HELD_OUT_RULES:
        raise UserError(f"held_out={held_out!r} is not valid; choose one of: {', '.join(HELD_OUT_RULES)}")
    parsed = parse_sources(value, root)
    if parsed is None:
        return None
    total = sum(w for _, _, w in parsed)
    sources = tuple(Source(name, Corpus(folders, name, held_out, bound), w / total)
                    for name, folders, w in parsed)
    for s in sources[1:]:
        assert sources[0].corpus.tokenizer is not None and s.corpus.tokenizer is not None
        sources[0].corpus.tokenizer.same_as(s.corpus.tokenizer)
    return Blend(sources, doc_mode, held_out)
