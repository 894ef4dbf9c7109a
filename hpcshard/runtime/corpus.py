"""Prepared corpora (`hpcshard data prepare`'s token shards) and mixtures of them.

A prepared corpus is a directory: `manifest.json` ({"format": "hpcshard-tokens", "version":
1, "dtype", "vocab_size", "eos_id", "shards": [{"name", "tokens", "documents"}], ...}),
and per shard `NAME.bin` (the tokens, little-endian, documents concatenated) and `NAME.idx`
(little-endian int64, each document's first token in the shard, then the shard's length).
Every file is memory-mapped and read a window at a time: a rank's memory does not grow
with the corpus, only with its number of shards (a few integers each).

`data` names the sources (`parse_sources`): a prepared directory, or a glob of them (one
source); a mixture `NAME_OR_PATH:WEIGHT,...`; or a TOML file with `[sources.NAME]` tables
(`path`, `weight`). How samples are drawn from them is `runtime.order`'s.
"""

from __future__ import annotations

import glob
import json
import math
import tomllib
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from pathlib import Path

import numpy as np

from hpcshard.errors import UserError

FORMAT, VERSION = "hpcshard-tokens", 1
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DOC_MODES = ("stream", "whole")
IGNORE = -100
"""A target the loss skips (the padding of a short document in `whole` mode; the same
value as fine-tuning's, runtime.sft)."""
HELD_OUT = 1 << 20
"""At most this many tokens at the end of a corpus are held out for evaluation (5% of
its last shard when that is less)."""


def is_prepared(path: Path) -> bool:
    return (path / "manifest.json").is_file()


@dataclass(frozen=True)
class Shard:
    """One shard of a prepared corpus: its files and sizes (read lazily)."""

    bin: Path
    idx: Path
    tokens: int
    documents: int
    dtype: np.dtype

    @cached_property
    def data(self) -> np.ndarray:
        return np.memmap(self.bin, dtype=self.dtype, mode="r", shape=(self.tokens,))

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.memmap(self.idx, dtype="<i8", mode="r", shape=(self.documents + 1,))


def read_manifest(folder: Path) -> dict:
    """A prepared corpus's manifest, checked (one line naming the file and what is wrong)."""
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not a readable manifest ({err}); prepare the corpus again "
                        "with `hpcshard data prepare`") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
                        f"is not {FORMAT!r} version {VERSION}; prepare it with `hpcshard data prepare`")
    if manifest.get("dtype") not in DTYPES:
        raise UserError(f"{path}: dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    return manifest


class Corpus:
    """All the shards of one or more prepared directories, as one token stream whose
    documents are numbered in order. The last HELD_OUT tokens (at most) are held out
    (`held_out`); training reads the rest (`train_tokens`, `train_documents`)."""

    def __init__(self, folders: list[Path], name: str = "") -> None:
        self.name = name or str(folders[0])
        self.shards: list[Shard] = []
        self.vocab_size, self.eos_id = 0, None
        for folder in folders:
            manifest = read_manifest(folder)
            self.vocab_size = max(self.vocab_size, int(manifest["vocab_size"]))
            self.eos_id = manifest.get("eos_id")
            dtype = DTYPES[manifest["dtype"]]
            for entry in manifest["shards"]:
                shard = Shard(folder / f"{entry['name']}.bin", folder / f"{entry['name']}.idx",
                              int(entry["tokens"]), int(entry["documents"]), dtype)
                _check_shard(shard)
                if shard.tokens:
                    self.shards.append(shard)
        if not self.shards:
            raise UserError(f"data source {self.name!r} holds no tokens; prepare it with "
                            "`hpcshard data prepare`")
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards], dtype=np.int64)
        """Each shard's first token in the stream, then the stream's length."""
        self.doc_starts = np.cumsum([0] + [s.documents for s in self.shards], dtype=np.int64)
        self.tokens = int(self.starts[-1])
        last = self.shards[-1].tokens
        held = min(HELD_OUT, last // 20)
        self.train_tokens = self.tokens - held
        self.train_documents = self._documents_before(self.train_tokens)

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
            piece = self.shards[k].data[at: at + length - done]
            out[done: done + len(piece)] = piece
            done, k = done + len(piece), k + 1
        return out

    def document(self, d: int) -> tuple[int, int]:
        """Document d's first token in the stream and its length."""
        k = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        lo, hi = self.shards[k].offsets[d - int(self.doc_starts[k]): d - int(self.doc_starts[k]) + 2]
        return int(self.starts[k]) + int(lo), int(hi - lo)

    def held_out(self) -> np.ndarray:
        return self.read(self.train_tokens, self.tokens - self.train_tokens)


def _check_shard(shard: Shard) -> None:
    expected = ((shard.bin, shard.tokens * shard.dtype.itemsize), (shard.idx, (shard.documents + 1) * 8))
    for path, size in expected:
        if not path.is_file():
            raise UserError(f"{path} is missing; prepare the corpus again with `hpcshard data prepare`")
        if path.stat().st_size != size:
            raise UserError(f"{path} holds {path.stat().st_size} bytes, its manifest says {size}; "
                            "the corpus is damaged or still being written: prepare it again")


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

    @property
    def vocab_size(self) -> int:
        return max(s.corpus.vocab_size for s in self.sources)

    def held_out(self) -> np.ndarray:
        """The held-out tail of every source, one after another."""
        return np.concatenate([s.corpus.held_out() for s in self.sources])

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
    return Fraction(str(weight)).limit_denominator(10**6)


def _folders(pattern: str, base: Path, required: bool = True) -> list[Path]:
    """The prepared directories a source's path (or glob) names, sorted."""
    full = pattern if Path(pattern).is_absolute() else str(base / pattern)
    found = sorted(Path(p) for p in glob.glob(full) if is_prepared(Path(p)))
    if not found and required:
        raise UserError(f"data source {pattern!r} names no prepared corpus (a directory with a "
                        f"manifest.json under {str(base)!r}); prepare it with `hpcshard data prepare` "
                        "or fix the path")
    return found


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


def load_blend(value: str, root: str = "", doc_mode: str = "stream") -> Blend | None:
    """The corpora `data` names, opened (manifests and sizes checked), or None (not corpora)."""
    if doc_mode not in DOC_MODES:
        raise UserError(f"doc_mode={doc_mode!r} is not valid; choose one of: {', '.join(DOC_MODES)}")
    parsed = parse_sources(value, root)
    if parsed is None:
        return None
    total = sum(w for _, _, w in parsed)
    sources = tuple(Source(name, Corpus(folders, name), w / total) for name, folders, w in parsed)
    vocabs = {s.corpus.vocab_size for s in sources}
    if len(vocabs) > 1:
        sizes = ", ".join(map(str, sorted(vocabs)))
        raise UserError(f"the data sources have different vocabulary sizes ({sizes}); prepare every "
                        "source with the same tokenizer")
    return Blend(sources, doc_mode)
