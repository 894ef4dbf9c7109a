"""What `hpcshard data prepare` reads: documents from text files, JSONL, Parquet or a local
Hugging Face dataset, and the local tokenizer that turns them into token ids.

A source is a sequence of documents with a stable order, read by index range (`read`), so
that any process (a worker, a Slurm array task) reads exactly the documents of its shards.
Its `index` (what planning learned: JSONL line offsets) is saved with the plan and handed
back to `open_source`, so a worker does not scan the corpus again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hpcshard.errors import UserError

MANY_FILES = 1000
"""More files than this: the manifest says how many, not which."""
FORMATS = ("text", "jsonl", "parquet", "hf")
"""What --format takes (besides auto: told by the file names)."""
SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".rst": "text", "": "text",
            ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
"""File name endings whose format is known."""
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `Dataset.save_to_disk` (or `DatasetDict`'s) writes: such a directory is a dataset."""
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
"""End-of-document tokens looked for when the tokenizer's configuration names none."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json")
"""The files of a tokenizer directory that its checksum covers (not a model's weights)."""
VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
               "sentencepiece.bpe.model")
"""Files that hold a vocabulary: a tokenizer directory has one (or a tokenizer_config.json naming one)."""
MIN_VOCAB = 256
"""A smaller vocabulary is not a tokenizer (transformers builds an empty one from a config alone)."""


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """The documents to read, as the command line names them."""

    path: str
    """A file, or a directory (of files, or a saved Hugging Face dataset)."""
    format: str = "auto"
    """auto | text | jsonl | parquet | hf."""
    field: str = "text"
    """The JSONL key, Parquet column or dataset column that holds a document's text."""
    pattern: str = "*"
    """Glob for the files under a directory (recursive: `**/*.txt`)."""
    split: str = "train"
    """The split of a Hugging Face dataset with several."""


class Source:
    """Documents by index: `count` of them, `sizes` (bytes, to plan shards), `read`."""

    def __init__(self, spec: SourceSpec, files: list[Path]) -> None:
        self.spec = spec
        self.files = files

    def count(self) -> int:
        raise NotImplementedError

    def sizes(self) -> np.ndarray:
        """Each document's size in bytes (about its text's): shards are planned on them."""
        raise NotImplementedError

    def read(self, start: int, stop: int) -> list[str]:
        """The texts of documents start..stop-1."""
        raise NotImplementedError

    def index(self) -> dict[str, np.ndarray]:
        """What a worker needs to read without scanning again (saved with the plan): the
        files, as planned (a worker does not glob again), and the format's own index."""
        if not self.files:
            return {}
        return {"paths": np.array([os.fsencode(f) for f in self.files], dtype=np.bytes_)}  # not UTF-32

    def describe(self) -> dict[str, Any]:
        """What was read, for the manifest."""
        one = asdict(self.spec)
        listed = len(self.files) <= MANY_FILES
        return {**one, "files": [str(f) for f in self.files] if listed else len(self.files)}

    def fingerprint(self) -> str:
        """Names, sizes and modification times of what is read: a rerun on changed input is
        not a resume."""
        h = hashlib.sha256()
        for f in self.files or [Path(self.spec.path)]:
            st = f.stat()
            # the name as the file system holds it: a Latin-1 name has no str encoding
            h.update(os.fsencode(f) + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()


class TextSource(Source):
    """One document per file, decoded as UTF-8 (bad bytes replaced)."""

    def count(self) -> int:
        return len(self.files)

    def sizes(self) -> np.ndarray:
        return np.array([f.stat().st_size for f in self.files], dtype=np.int64)

    def read(self, start: int, stop: int) -> list[str]:
        return [f.read_bytes().decode("utf-8", errors="replace") for f in self.files[start:stop]]


class JsonlSource(Source):
    """One document per non-blank line: its `field`."""

    def __init__(self, spec: SourceSpec, files: list[Path], index: dict[str, np.ndarray] | None = None):
        super().__init__(spec, files)
        self._index = index if index is not None else self._scan()

    def _scan(self) -> dict[str, np.ndarray]:
        file_of, offsets, sizes = [], [], []
        for i, path in enumerate(self.files):
            at = 0
            with path.open("rb") as f:
                for line in f:
                    if line.strip():
                        file_of.append(i)
                        offsets.append(at)
                        sizes.append(len(line))
                    at += len(line)
        return {"file": np.array(file_of, dtype=np.int32), "offset": np.array(offsets, dtype=np.int64),
                "size": np.array(sizes, dtype=np.int64)}

    def count(self) -> int:
        return len(self._index["offset"])

    def sizes(self) -> np.ndarray:
        return self._index["size"]

    def index(self) -> dict[str, np.ndarray]:
        return {**super().index(), **self._index}

    def read(self, start: int, stop: int) -> list[str]:
        out: list[str] = []
        handles: dict[int, Any] = {}
        try:
            for i in range(start, stop):
                k = int(self._index["file"][i])
                f = handles.get(k) or handles.setdefault(k, self.files[k].open("rb"))
                f.seek(int(self._index["offset"][i]))
                out.append(self._text(f.read(int(self._index["size"][i])), k, i))
        finally:
            for f in handles.values():
                f.close()
        return out

    def _text(self, line: bytes, k: int, i: int) -> str:
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))  # bad bytes replaced, as text files
        except ValueError:
            raise UserError(f"{self.files[k]}: document {i} is not a JSON object: {line[:60]!r}; "
                            "fix the line or drop it") from None
        if not isinstance(record, dict) or not isinstance(record.get(self.spec.field), str):
            raise UserError(f"{self.files[k]}: document {i} has no text field {self.spec.field!r} "
                            f"(keys: {', '.join(record) if isinstance(record, dict) else '-'}); "
                            "give the key with --field")
        return str(record[self.spec.field])


class ArrowSource(Source):
    """A column of Parquet files, read a row group at a time: each file's row counts are
    kept (not the file: a directory of many would hold as many open), a file is opened
    again where its documents are read, and the last row group read is kept for the next
    batch of the same shard."""

    def __init__(self, spec: SourceSpec, files: list[Path]) -> None:
        super().__init__(spec, files)
        self._binary: list[bool] = []
        """Per file: its column is binary (decoded as UTF-8), not string; files may differ."""
        self._last: tuple[int, Any] | None = None
        self._parts = self._open()
        self._starts = np.cumsum([0, *(n for n, _, _ in self._parts)])

    def _open(self) -> list[tuple[int, int, int]]:
        """(rows, file, row group) for each piece, in order."""
        import pyarrow.parquet as pq

        parts: list[tuple[int, int, int]] = []
        for i, path in enumerate(self.files):
            try:
                pf = pq.ParquetFile(path)
            except Exception as err:  # pyarrow's ArrowInvalid, OSError...: not Parquet it can read
                raise UserError(f"{path} does not read as Parquet ({type(err).__name__}: "
                                f"{str(err)[:200]}); give --format, or a good file") from None
            try:
                _check_field(self.spec.field, pf.schema_arrow.names, path)
                self._binary.append(_check_type(self.spec.field, pf.schema_arrow.field(self.spec.field).type,
                                                path))
                for g in range(pf.metadata.num_row_groups):
                    parts.append((pf.metadata.row_group(g).num_rows, i, g))
            finally:
                pf.close()
        return parts

    def _column(self, p: int) -> Any:
        """Piece p's column (the last one read is kept: a shard's batches read it once)."""
        import pyarrow.parquet as pq

        if self._last is not None and self._last[0] == p:
            return self._last[1]
        _, i, g = self._parts[p]
        with pq.ParquetFile(self.files[i]) as f:
            column = f.read_row_group(g, columns=[self.spec.field]).column(0)
        self._last = (p, column)
        return column

    def count(self) -> int:
        return int(self._starts[-1])

    def sizes(self) -> np.ndarray:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        out, nulls, first = [], 0, -1
        for i, path in enumerate(self.files):
            with pq.ParquetFile(path) as pf:
                for p, (_, j, g) in enumerate(self._parts):
                    if j != i:
                        continue
                    column = pf.read_row_group(g, columns=[self.spec.field]).column(0)
                    if column.null_count and first < 0:
                        first = int(self._starts[p]) + int(pc.index(pc.is_null(column), True).as_py())
                    nulls += column.null_count
                    out.append(pc.binary_length(column).to_numpy(zero_copy_only=False))
        _refuse_nulls(nulls, first, self.spec)
        return np.nan_to_num(np.concatenate(out or [np.zeros(0)]).astype(np.float64)).astype(np.int64)

    def read(self, start: int, stop: int) -> list[str]:
        texts: list[str] = []
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        for p in range(first, len(self._parts)):
            lo, hi = int(self._starts[p]), int(self._starts[p + 1])
            if lo >= stop:
                break
            column = self._column(p).slice(max(start, lo) - lo, min(stop, hi) - max(start, lo))
            binary = self._binary[self._parts[p][1]]  # this piece's file's own column type
            texts.extend(_as_text(t, binary) for t in column.to_pylist())
        return texts


def _check_type(field: str, kind: Any, path: Path) -> bool:
    """A text column: string (False) or binary (True: decoded as UTF-8, bad bytes replaced);
    one line for any other."""
    import pyarrow as pa

    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return False
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return True
    raise UserError(f"{path}: column {field!r} is {kind}, not text (string); give the text column with "
                    "--field")


def _refuse_nulls(nulls: int, first: int, spec: SourceSpec) -> None:
    if nulls:
        raise UserError(f"{spec.path}: {nulls} document(s) of column {spec.field!r} are null (the first: "
                        f"document {first}); drop or fill them (as a JSONL line without its text is refused)")


def _as_text(value: Any, binary: bool) -> str:
    return value.decode("utf-8", errors="replace") if binary else str(value)


class DatasetSource(Source):
    """A Hugging Face dataset from local files: a `save_to_disk` directory, or what
    `datasets.load_dataset` reads from a local directory (offline)."""

    def __init__(self, spec: SourceSpec) -> None:
        super().__init__(spec, [])
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
        import datasets

        path = spec.path
        try:
            if any((Path(path) / m).exists() for m in HF_MARKERS):
                ds = datasets.load_from_disk(path)
            else:
                ds = datasets.load_dataset(path)
        except Exception as err:  # the library's own many kinds: not a dataset, either way
            said = str(err).splitlines()[0] if str(err) else ""
            raise UserError(f"{path} does not load as a Hugging Face dataset ({type(err).__name__}: "
                            f"{said[:200]}); give --format") from None
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise UserError(f"{path} has no split {spec.split!r}; give --split one of: {', '.join(ds)}")
            ds = ds[spec.split]
        _check_field(spec.field, ds.column_names, Path(path))
        self._binary = _check_type(spec.field, ds.data.schema.field(spec.field).type, Path(path))
        self._ds = ds.select_columns([spec.field])

    def count(self) -> int:
        return len(self._ds)

    def sizes(self) -> np.ndarray:
        import pyarrow.compute as pc

        column = self._ds.with_format("arrow")[:][self.spec.field]
        if column.null_count:
            _refuse_nulls(column.null_count, int(pc.index(pc.is_null(column), True).as_py()), self.spec)
        return np.nan_to_num(pc.binary_length(column).to_numpy(zero_copy_only=False)
                             .astype(np.float64)).astype(np.int64)

    def read(self, start: int, stop: int) -> list[str]:
        column = self._ds.with_format("arrow")[start:stop][self.spec.field]
        return [_as_text(t, self._binary) for t in column.to_pylist()]

    def fingerprint(self) -> str:
        return str(self._ds._fingerprint)


def _check_field(field: str, names: list[str], path: Path) -> None:
    if field not in names:
        raise UserError(f"{path} has no column {field!r} (columns: {', '.join(names)}); "
                        "give the text column with --field")


def open_source(spec: SourceSpec, index: dict[str, np.ndarray] | None = None) -> Source:
    """The source `spec` names, its format told by its files unless given; one line
    (UserError) for a path that is missing, a format that is unknown, no documents. With an
    `index` saved by a plan: exactly the files it names (no glob again)."""
    path = Path(spec.path).resolve()  # however it is spelled, from wherever: the same names
    if not path.exists():
        raise UserError(f"source {spec.path} does not exist; give a file or directory to read")
    index = dict(index) if index is not None else None
    planned = index.pop("paths", None) if index is not None else None
    if planned is not None and spec.format in FORMATS:
        kind, files = spec.format, [Path(os.fsdecode(bytes(f))) for f in planned]
        missing = next((f for f in files if not f.is_file()), None)
        if missing is not None:
            raise UserError(f"{missing} (in the plan) is gone; the source changed since it was planned: "
                            "prepare it again into a new directory")
    else:
        kind, files = _detect(spec, path)
    spec = replace(spec, path=str(path), format=kind)
    if kind == "hf":
        source: Source = DatasetSource(spec)
    elif kind == "parquet":
        source = ArrowSource(spec, files)
    elif kind == "jsonl":
        source = JsonlSource(spec, files, index)
    else:
        source = TextSource(spec, files)
    if source.count() == 0:
        raise UserError(f"source {spec.path} ({kind}) has no documents; give a source with text in it")
    return source


def _detect(spec: SourceSpec, path: Path) -> tuple[str, list[Path]]:
    if spec.format not in ("auto", *FORMATS):
        raise UserError(f"--format {spec.format}: unknown; choose from auto, {', '.join(FORMATS)}")
    if spec.format == "hf" or (spec.format == "auto" and path.is_dir()
                               and any((path / m).exists() for m in HF_MARKERS)):
        return "hf", []
    files = sorted(f for f in path.glob(spec.pattern) if f.is_file()
                   and _visible(f.relative_to(path), spec.pattern)) if path.is_dir() else [path]
    if spec.format != "auto":
        return spec.format, files
    kinds = {SUFFIXES.get(f.suffix.lower()) for f in files}
    if None in kinds:
        odd = next(f for f in files if SUFFIXES.get(f.suffix.lower()) is None)
        raise UserError(f"cannot tell the format of {odd} ({odd.suffix}); give --format "
                        f"{'|'.join(FORMATS)} (or --pattern to pick the files)")
    if len(kinds) > 1:
        raise UserError(f"{path} holds files of several formats ({', '.join(sorted(map(str, kinds)))}); "
                        "pick one kind with --pattern or --format")
    kind = kinds.pop() if kinds else None
    return kind or "text", files


def _visible(relative: Path, pattern: str) -> bool:
    """Not hidden (.DS_Store, .git/...), unless the pattern names dot files itself."""
    dotted = [part for part in relative.parts if part.startswith(".")]
    return not dotted or any(part.startswith(".") for part in Path(pattern).parts)


def vocabulary(tok: Any) -> tuple[int, int]:
    """A tokenizer's count of entries (added tokens too) and the bound of its ids: the largest
    + 1, not the count. Ids can have gaps (special tokens at the top of a range padded for
    the embedding: 303 entries, an id of 60,000), and a model sized from the count fails at
    the first batch with such a token. `tok`: a `tokenizers.Tokenizer`, or a transformers
    tokenizer (read through its fast backend where it has one)."""
    fast = tok if hasattr(tok, "get_vocab_size") else getattr(tok, "backend_tokenizer", None)
    if fast is not None:
        vocab = fast.get_vocab(with_added_tokens=True)
        entries, ids = max(len(vocab), fast.get_vocab_size(with_added_tokens=True)), list(vocab.values())
    else:
        try:
            ids = list(tok.get_vocab().values())
        except NotImplementedError:  # a tokenizer class without get_vocab: its count is all there is
            ids = []
        entries = max(len(ids), len(tok))
    return entries, max(entries, max(ids, default=-1) + 1)


class Tokenizer:
    """A local tokenizer: `encode(texts)` (no special tokens added), the bound of its ids
    (`vocab_size`), its end-of-document id, and a checksum of its files."""

    def __init__(self, path: str, eos: str = "auto") -> None:
        self.path = str(Path(path).resolve())
        self._fast: Any = None
        self._slow: Any = None
        self._load(Path(path))
        self.eos_id = self._eos(eos)
        self.sha256 = _tokenizer_sha(Path(path))

    def _load(self, path: Path) -> None:
        if not path.exists():
            raise UserError(f"tokenizer {path} does not exist; give a tokenizer.json or a directory with one")
        if path.is_dir() and not _has_vocabulary(path):
            raise UserError(f"tokenizer {path} holds no tokenizer files (none of {', '.join(VOCAB_FILES)}); "
                            "give a tokenizer.json or a directory saved by save_pretrained")
        try:
            if path.is_file() or (path / "tokenizer.json").is_file():
                from tokenizers import Tokenizer as Fast

                self._fast = Fast.from_file(str(path if path.is_file() else path / "tokenizer.json"))
            else:
                from transformers import AutoTokenizer

                slow = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
                self._fast, self._slow = getattr(slow, "backend_tokenizer", None), slow
            if self._fast is not None:  # a tokenizer.json's saved truncation or padding: never applied
                self._fast.no_truncation()
                self._fast.no_padding()
        except Exception as err:  # tokenizers' and transformers' many errors: it did not load
            said = str(err).splitlines()[0] if str(err) else ""
            raise UserError(f"tokenizer {path} does not load ({type(err).__name__}: {said[:200]}); give a "
                            "tokenizer.json or a directory saved by save_pretrained") from None
        entries, self.vocab_size = vocabulary(self._fast if self._fast is not None else self._slow)
        """The bound of the ids (`vocabulary`), not the count of entries."""
        if entries < MIN_VOCAB:
            raise UserError(f"tokenizer {path} has a vocabulary of {entries} (under {MIN_VOCAB}): not a "
                            "usable tokenizer; give a tokenizer.json or a directory saved by save_pretrained")

    def _eos(self, eos: str) -> int | None:
        if eos == "none":
            return None
        names = [eos] if eos != "auto" else [*self._configured_eos(), *EOS_NAMES]
        for name in names:
            found = self._token_id(name)
            if found is not None:
                return found
        if eos != "auto":
            raise UserError(f"--eos {eos!r} is not a token of tokenizer {self.path}; give one of its "
                            "tokens, or --eos none")
        return None

    def _configured_eos(self) -> list[str]:
        if self._slow is not None and self._slow.eos_token:
            return [str(self._slow.eos_token)]
        config = Path(self.path) / "tokenizer_config.json" if Path(self.path).is_dir() else None
        if config is not None and config.is_file():
            token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(token, dict):
                token = token.get("content")
            return [token] if isinstance(token, str) else []
        return []

    def _token_id(self, name: str) -> int | None:
        if self._fast is not None:
            found = self._fast.token_to_id(name)
            return None if found is None else int(found)
        found = self._slow.convert_tokens_to_ids(name)
        return None if found is None or found == self._slow.unk_token_id else int(found)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, in one batch call (the library's threads: `encode_batch`)."""
        if self._fast is not None:
            batch = getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)
            return [e.ids for e in batch(texts, add_special_tokens=False)]
        return list(self._slow(texts, add_special_tokens=False, truncation=False, padding=False)["input_ids"])

    def unk_id(self) -> int | None:
        """The unknown token's id, if the tokenizer has one."""
        if self._slow is not None and self._slow.unk_token_id is not None:
            return int(self._slow.unk_token_id)
        unk = getattr(self._fast.model, "unk_token", None) if self._fast is not None else None
        return self._token_id(unk) if isinstance(unk, str) and unk else None


def _has_vocabulary(path: Path) -> bool:
    if any((path / n).is_file() for n in VOCAB_FILES) or any(path.glob("*.model")):
        return True
    config = path / "tokenizer_config.json"
    try:
        saved = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except (OSError, ValueError):
        return False
    named = ("vocab", "vocab_file", "added_tokens_decoder")
    return isinstance(saved, dict) and any(k in saved for k in named)


def _tokenizer_sha(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(path / n for n in TOKENIZER_FILES if (path / n).is_file())
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()
