"""`hpcshard data prepare`: every source format, a tokenizer from local files (a tiny BPE
trained here: no downloads), the shards read back with numpy (counts, offsets, checksums,
dtype), the same bytes for 1 or 2 workers and for array tasks, resume, the bound of the
ids (a tokenizer with gaps in them), temporary files (each writer's own name, and only the
interrupted ones removed: real pid namespaces where root may make them), and bad input (one
line, exit 2, nothing written)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from examples.finetune.make_base import byte_bpe
from hpcshard.cli import main
from hpcshard.rundir import files
from hpcshard.rundir.files import side_name
from hpcshard.runtime import prepare as prep
from hpcshard.runtime import sidefiles
from hpcshard.runtime.sources import SourceSpec, Tokenizer

TEXTS = [f"doc {i}: the quick brown fox jumps over the lazy dog, {'again ' * (i % 5)}héllo\nend {i}"
         for i in range(120)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 300 ids with <|endoftext|>, trained on the test's own text."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    byte_bpe(TEXTS, 300, ["<unk>", "<|endoftext|>"], unk="<unk>").save(str(path))
    return path


def corpus(tmp_path: Path, kind: str) -> Path:
    """TEXTS as a source of `kind`."""
    if kind == "text":
        folder = tmp_path / "texts"
        folder.mkdir()
        for i, text in enumerate(TEXTS):
            (folder / f"doc-{i:03d}.txt").write_text(text)
        return folder
    if kind == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" + ("\n" if i == 3 else "")
                                for i, t in enumerate(TEXTS)))
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(TEXTS))), "body": TEXTS})
    if kind == "parquet":
        path = tmp_path / "c.parquet"
        pq.write_table(table, path, row_group_size=17)  # documents across row groups
        return path
    import datasets

    path = tmp_path / "ds"
    datasets.Dataset(table).save_to_disk(str(path))
    return path


def run(tmp_path: Path, source: Path, tok: Path, name: str = "out", **kw: Any) -> tuple[Path, prep.Prepared]:
    out = tmp_path / name
    spec = SourceSpec(path=str(source), **{k: kw.pop(k) for k in ("format", "field") if k in kw})
    cfg = prep.PrepareConfig(source=spec, tokenizer=str(tok), output=str(out), progress=False,
                             **{"shard_tokens": 700, **kw})
    return out, prep.prepare(cfg)


def read_back(out: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The manifest, and every document's tokens, checked against the format as it goes."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "hpcshard-tokens" and manifest["version"] == 1
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    docs: list[np.ndarray] = []
    for shard in manifest["shards"]:
        data = (out / f"{shard['name']}.bin").read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        tokens = np.frombuffer(data, dtype=dtype)
        idx = np.fromfile(out / f"{shard['name']}.idx", dtype="<i8")
        assert len(tokens) == shard["tokens"] and len(idx) == shard["documents"] + 1
        assert idx[0] == 0 and idx[-1] == len(tokens) and np.all(np.diff(idx) > 0)
        docs.extend(tokens[a:b] for a, b in zip(idx[:-1], idx[1:], strict=True))
    assert manifest["documents"] == len(docs) == sum(s["documents"] for s in manifest["shards"])
    assert manifest["tokens"] == sum(len(d) for d in docs)
    return manifest, docs


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "hf"])
def test_each_format_gives_the_documents_tokens(tmp_path: Path, tok: Path, kind: str) -> None:
    fast = Tokenizer(str(tok))
    out, result = run(tmp_path, corpus(tmp_path, kind), tok,
                      **({"field": "body"} if kind in ("parquet", "hf") else {}))
    manifest, docs = read_back(out)
    assert result.manifest and result.written == len(manifest["shards"]) > 3
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 300
    assert manifest["eos_id"] == fast.eos_id == 1 and manifest["source"]["format"] == kind
    sha = hashlib.sha256(b"tokenizer.json\0" + tok.read_bytes()).hexdigest()
    assert manifest["tokenizer"]["sha256"] == sha
    expected = [[*ids, 1] for ids in fast.encode(TEXTS)]
    assert [d.tolist() for d in docs] == expected


def test_training_reads_what_prepare_wrote(tmp_path: Path, tok: Path) -> None:
    """The reader (`runtime.corpus`, what `data=DIR` trains on) sees the same documents."""
    from hpcshard.runtime.corpus import Corpus

    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tok)
    _, docs = read_back(out)
    read = Corpus([out])
    assert read.vocab_size == 300 and read.eos_id == 1 and read.tokens == sum(len(d) for d in docs)
    for d in (0, 7, len(docs) - 1):
        start, length = read.document(d)
        assert read.read(start, length).tolist() == docs[d].tolist()


def test_a_dataset_from_local_files_and_a_transformers_directory(tmp_path: Path, tok: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--format hf on a folder of JSONL (datasets.load_dataset, offline), and the tokenizer
    as a GPT-2 style directory without tokenizer.json (vocab.json, merges.txt: loaded by
    transformers' AutoTokenizer): the same tokens as the JSONL file with tokenizer.json."""
    from tokenizers import Tokenizer as Fast

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "jsonl"
    folder.mkdir()
    shutil.copy(corpus(tmp_path, "jsonl"), folder / "train.jsonl")
    saved = tmp_path / "hf-tok"
    saved.mkdir()
    Fast.from_file(str(tok)).model.save(str(saved))
    (saved / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}))
    a, _ = run(tmp_path, folder, saved, "a", format="hf")
    b, _ = run(tmp_path, folder / "train.jsonl", tok, "b")
    (ma, da), (mb, db) = read_back(a), read_back(b)
    assert ma["source"]["format"] == "hf" and ma["tokens"] == mb["tokens"] and ma["eos_id"] == 1
    assert all(np.array_equal(x, y) for x, y in zip(da, db, strict=True))


def test_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Fast
    from tokenizers import models, pre_tokenizers

    assert prep.dtype_for(65536) == "uint16" and prep.dtype_for(65537) == "uint32"
    big = Fast(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w69999 w5 w65536")
    out, _ = run(tmp_path, tmp_path / "a.txt", tmp_path / "big.json", eos="w42")
    manifest, docs = read_back(out)
    assert manifest["dtype"] == "uint32" and manifest["eos_id"] == 42
    assert docs[0].tolist() == [69999, 5, 65536, 42]


def gapped(tok: Path, folder: Path, eos: int) -> Path:
    """`tok` with its end-of-text token moved to id `eos`, far above its other 299 ids: a
    vocabulary with gaps in its ids (special tokens at the top of a range padded for the
    model's embedding)."""
    saved = json.loads(tok.read_text())
    saved["model"]["vocab"]["<|endoftext|>"] = eos
    for added in saved["added_tokens"]:
        if added["content"] == "<|endoftext|>":
            added["id"] = eos
    path = folder / f"gapped-{eos}.json"
    path.write_text(json.dumps(saved))
    return path


@pytest.mark.parametrize(("eos", "dtype"), [(60000, "uint16"), (70000, "uint32")])
def test_a_tokenizer_with_a_gap_in_its_ids(tmp_path: Path, tok: Path, eos: int, dtype: str) -> None:
    """The manifest's vocab_size bounds every id written: the largest + 1, not the count of
    the tokenizer's 300 entries (a model sized from that failed at the first batch holding
    EOS, at every restart); and the dtype follows the bound (70,000 does not fit uint16:
    refused before)."""
    from hpcshard.runtime.corpus import Corpus

    path = gapped(tok, tmp_path, eos)
    assert Tokenizer(str(path)).eos_id == eos
    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), path)
    manifest, docs = read_back(out)
    assert max(int(d.max()) for d in docs) == eos and manifest["vocab_size"] == eos + 1
    assert manifest["dtype"] == dtype
    read = Corpus([out])
    assert int(read.read(0, read.tokens).max()) == eos < read.vocab_size


def test_an_id_outside_the_tokenizers_vocabulary_is_one_line(tmp_path: Path, tok: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer that gives an id beyond its own vocabulary (custom code): refused when it is
    written, not stored past the manifest's bound."""
    monkeypatch.setattr(Tokenizer, "encode", lambda self, texts: [[5, 299 + len(t) % 2 * 4000]
                                                                   for t in texts])
    with pytest.raises(prep.UserError, match="gave id 4299, outside its vocabulary's ids 0 to 299"):
        run(tmp_path, corpus(tmp_path, "jsonl"), tok)


def test_no_eos(tmp_path: Path, tok: Path) -> None:
    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tok, eos="none")
    manifest, docs = read_back(out)
    assert manifest["eos_id"] is None and [d.tolist() for d in docs] == Tokenizer(str(tok)).encode(TEXTS)


def test_workers_and_array_tasks_write_the_same_shards(tmp_path: Path, tok: Path) -> None:
    source = corpus(tmp_path, "jsonl")
    one, _ = run(tmp_path, source, tok, "one")
    two, result = run(tmp_path, source, tok, "two", workers=2)
    assert result.written > 2
    # array tasks: the plan saved as the command does, then each task's share
    cfg = prep.PrepareConfig(source=SourceSpec(path=str(source)), tokenizer=str(tok),
                             output=str(tmp_path / "arr"), shard_tokens=700, progress=False)
    src, _t, request, bounds = prep.start(cfg)
    prep.save_plan(tmp_path / "arr", request, bounds, src)
    assert not prep.run_task(cfg.output, 0, 3).manifest and not prep.run_task(cfg.output, 2, 3).manifest
    assert prep.run_task(cfg.output, 1, 3).manifest
    for other in (two, tmp_path / "arr"):
        assert (other / "manifest.json").read_text() == (one / "manifest.json").read_text()
        for shard in one.glob("shard-*"):
            assert (other / shard.name).read_bytes() == shard.read_bytes()


def test_an_interrupted_run_resumes_with_the_missing_shards_only(tmp_path: Path, tok: Path) -> None:
    source = corpus(tmp_path, "jsonl")
    out, first = run(tmp_path, source, tok)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # as a kill mid-way leaves it: no manifest, a shard not done, another half-written
    (out / "manifest.json").unlink()
    (out / "shard-00002.bin").unlink()
    (out / ".prepare" / "shard-00004.done").unlink()
    (out / "shard-00003.bin").write_bytes(b"\0" * 5)  # its done file says otherwise: redone
    (out / "shard-00005.bin.tmp-host-1").write_bytes(b"partial")
    os.utime(out / "shard-00005.bin.tmp-host-1", (1, 1))  # another host's, long untouched: stale
    again = CliRunner().invoke(main, ["data", "prepare", str(source), "--tokenizer", str(tok), "-o", str(out),
                                      "--shard-tokens", "700", "--no-progress"])
    assert again.exit_code == 0, again.output
    assert f"{first.shards - 3} of {first.shards} shard(s) already done: skipped" in again.output
    assert "(3 written" in again.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    done = CliRunner().invoke(main, ["data", "prepare", str(source), "--tokenizer", str(tok), "-o", str(out),
                                     "--shard-tokens", "700", "--no-progress"])
    assert "(0 written" in done.output


def test_a_run_stopped_mid_way_finishes_on_a_rerun(tmp_path: Path, tok: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the third shard is written (its .bin half there under its temporary
    name): no manifest, two shards done; the rerun writes the rest, the same bytes."""
    source = corpus(tmp_path, "jsonl")
    whole, _ = run(tmp_path, source, tok, "whole")
    real, calls = prep.write_shard, []

    def stopped(out: Path, k: int, *args: Any) -> dict[str, Any]:
        calls.append(k)
        if len(calls) == 3:  # as a SIGKILL leaves it: this host's, nobody holds it
            side_name(out / f"{prep.shard_name(k)}.bin").write_bytes(b"half")
            raise KeyboardInterrupt
        return real(out, k, *args)

    monkeypatch.setattr(prep, "write_shard", stopped)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, source, tok)
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists() and len(list(out.glob(".prepare/*.done"))) == 2
    monkeypatch.setattr(prep, "write_shard", real)
    _, again = run(tmp_path, source, tok)
    assert again.skipped == 2 and again.written == again.shards - 2 and again.manifest
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == {
        p.name: p.read_bytes() for p in whole.iterdir() if p.is_file()}


def one_line_error(args: list[str], *text: str) -> None:
    result = CliRunner().invoke(main, ["data", "prepare", *args, "--no-progress"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert all(t in lines[0] for t in text), result.output


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, tok: Path) -> None:
    out = tmp_path / "out"
    jsonl = corpus(tmp_path, "jsonl")
    common = ["--tokenizer", str(tok), "-o", str(out)]
    (tmp_path / "c.csv").write_text("a,b\n")
    one_line_error([str(tmp_path / "c.csv"), *common], "cannot tell the format", "--format")
    bad = CliRunner().invoke(main, ["data", "prepare", str(jsonl), "--format", "xml", *common])
    assert bad.exit_code == 2 and "Error: Invalid value for '--format': 'xml'" in bad.output  # click's own
    (tmp_path / "bad.json").write_text("{not json")
    one_line_error([str(jsonl), "--tokenizer", str(tmp_path / "bad.json"), "-o", str(out)],
                   "does not load", "bad.json")
    one_line_error([str(jsonl), "--tokenizer", str(tmp_path / "nope"), "-o", str(out)], "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error([str(tmp_path / "empty"), *common], "no documents")
    (tmp_path / "blank.txt").write_text("")
    one_line_error([str(tmp_path / "blank.txt"), *common], "no text")
    one_line_error([str(jsonl), "--field", "body", *common], "no text field 'body'", "--field")
    one_line_error([str(corpus(tmp_path, "parquet")), *common], "no column 'text'", "--field")
    one_line_error([str(jsonl), "--eos", "<nope>", *common], "--eos", "<nope>")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    one_line_error([str(tmp_path / "junk.parquet"), *common], "does not read as Parquet")
    one_line_error([str(tmp_path / "empty"), "--format", "hf", *common], "does not load as a Hugging Face")
    one_line_error([str(tmp_path / "missing.jsonl"), *common], "does not exist")
    assert not out.exists()


def test_another_request_into_a_used_directory_is_refused(tmp_path: Path, tok: Path) -> None:
    jsonl = corpus(tmp_path, "jsonl")
    out, _ = run(tmp_path, jsonl, tok)
    before = sorted(p.name for p in out.rglob("*"))
    one_line_error([str(jsonl), "--tokenizer", str(tok), "-o", str(out), "--shard-tokens", "900"],
                   "other arguments", "shard_tokens")
    assert sorted(p.name for p in out.rglob("*")) == before
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    one_line_error([str(jsonl), "--tokenizer", str(tok), "-o", str(tmp_path / "full")], "not empty")


@pytest.mark.parametrize("eos", [60000, 70000])
def test_a_resume_of_an_older_versions_bound_says_so(tmp_path: Path, tok: Path, eos: int) -> None:
    """A corpus an older hpcshard started with a tokenizer whose ids have gaps: its request
    says vocab_size 300 (the count of entries; the dtype it gave), this version's 60,001 or
    70,001. The same command was told "they differ in: vocab_size; give the same ones to
    resume": the user gave the same ones. It says an older hpcshard set the bound, and to
    prepare into a new directory; other arguments are refused as they were."""
    source, gap = corpus(tmp_path, "jsonl"), gapped(tok, tmp_path, eos)
    out, _ = run(tmp_path, source, gap)
    saved = out / ".prepare" / "request.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "vocab_size": 300, "dtype": "uint16"}))
    before = sorted(p.name for p in out.rglob("*"))
    args = [str(source), "--tokenizer", str(gap), "-o", str(out), "--shard-tokens", "700"]
    one_line_error(args, f"{out} was started by an older hpcshard", "count of entries (300)",
                   f"largest id + 1 ({eos + 1})", "prepare into a new directory")
    args[-1] = "900"
    one_line_error(args, "other arguments", "shard_tokens")
    assert sorted(p.name for p in out.rglob("*")) == before


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_bad_record_later_on_leaves_nothing(tmp_path: Path, tok: Path, workers: str) -> None:
    """Found while tokenizing (here or in a worker process): one line, and the output
    directory this run made is gone."""
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS) + '{"other": 1}\n')
    one_line_error([str(path), "--tokenizer", str(tok), "-o", str(tmp_path / "out"), "--shard-tokens", "700",
                    "--workers", workers], "document 120 has no text field")
    assert not (tmp_path / "out").exists()


def test_the_array_renders_on_the_site_template_and_writes_nothing(tmp_path: Path, tok: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["data", "prepare", str(corpus(tmp_path, "jsonl")), "--tokenizer",
                                       str(tok), "-o", str(out), "--array", "3", "--workers", "4",
                                       "--render", "--partition", "cpu", "--time", "02:00:00"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "#SBATCH --array=0-2" in text and "#SBATCH --cpus-per-task=4" in text
    assert "#SBATCH --partition=cpu" in text and "--gpus-per-node" not in text
    assert f"{out.resolve()}/.prepare/slurm/task-%a/logs/slurm-%A_%a.out" in text
    assert not out.exists()
    alone = CliRunner().invoke(main, ["data", "prepare", str(tmp_path / "c.jsonl"), "--tokenizer", str(tok),
                                      "-o", str(out), "--render"])
    assert alone.exit_code == 2 and "--render prints the job array's script: give --array N" in alone.output


# -- after review -------------------------------------------------------------------------------


def test_a_tokenizer_that_is_not_one_is_refused(tmp_path: Path, tok: Path) -> None:
    """A folder without tokenizer files (transformers builds an empty tokenizer from a
    config.json), a vocabulary under 256, one that gives only UNK for this text: one line."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import models, pre_tokenizers

    jsonl = corpus(tmp_path, "jsonl")
    out = tmp_path / "out"
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300}))
    one_line_error([str(jsonl), "--tokenizer", str(tmp_path / "cfg"), "-o", str(out)], "no tokenizer files")
    small = Fast(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    small.save(str(tmp_path / "small.json"))
    one_line_error([str(jsonl), "--tokenizer", str(tmp_path / "small.json"), "-o", str(out)],
                   "vocabulary of 10")
    words = Fast(models.WordLevel({"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(300)}},
                                  unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    one_line_error([str(jsonl), "--tokenizer", str(tmp_path / "words.json"), "-o", str(out)],
                   "no token but EOS or UNK")
    assert not out.exists()


def test_a_saved_truncation_or_padding_is_not_applied(tmp_path: Path, tok: Path) -> None:
    from tokenizers import Tokenizer as Fast

    saved = Fast.from_file(str(tok))
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=64, pad_id=0)
    saved.save(str(tmp_path / "trunc.json"))
    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tmp_path / "trunc.json")
    _, docs = read_back(out)
    assert [d.tolist() for d in docs] == [[*ids, 1] for ids in Tokenizer(str(tok)).encode(TEXTS)]


def test_parquet_columns_that_are_not_strings(tmp_path: Path, tok: Path) -> None:
    """Binary: decoded as UTF-8 (the same tokens as strings); int, list<string>: one line;
    nulls: one line with their count (as JSONL refuses a line without its text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([t.encode() for t in TEXTS], pa.binary())}),
                   tmp_path / "bin.parquet", row_group_size=17)
    out, _ = run(tmp_path, tmp_path / "bin.parquet", tok)
    assert [d.tolist() for d in read_back(out)[1]] == [[*ids, 1] for ids in Tokenizer(str(tok)).encode(TEXTS)]
    common = ["--tokenizer", str(tok), "-o", str(tmp_path / "o")]
    pq.write_table(pa.table({"text": list(range(10))}), tmp_path / "int.parquet")
    one_line_error([str(tmp_path / "int.parquet"), *common], "'text' is int64, not text")
    pq.write_table(pa.table({"text": [["a", "b"]] * 3}), tmp_path / "list.parquet")
    one_line_error([str(tmp_path / "list.parquet"), *common], "not text")
    pq.write_table(pa.table({"text": ["a b c", None, "d", None]}), tmp_path / "nulls.parquet")
    one_line_error([str(tmp_path / "nulls.parquet"), *common], "2 document(s)", "null", "document 1")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("binary_name", ["b.parquet", "0-b.parquet"])
def test_parquet_files_whose_text_column_is_string_in_one_and_binary_in_another(
        tmp_path: Path, tok: Path, binary_name: str) -> None:
    """Each file's column is decoded by its own type: the binary file's documents are their
    text, not Python's repr "b'...'" (binary first), and no crash on str.decode (binary last)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"text": pa.array(TEXTS[:2], pa.string())}), folder / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([t.encode() for t in TEXTS[2:4]], pa.binary())}),
                   folder / binary_name)
    out, _ = run(tmp_path, folder, tok)
    texts = [*TEXTS[2:4], *TEXTS[:2]] if binary_name < "a" else TEXTS[:4]
    assert [d.tolist() for d in read_back(out)[1]] == [[*ids, 1] for ids in Tokenizer(str(tok)).encode(texts)]


def test_a_file_name_that_is_not_utf8_is_read(tmp_path: Path, tok: Path) -> None:
    """A Latin-1 name (café.txt as an old archive holds it) is fingerprinted as the file
    system's bytes: no UnicodeEncodeError traceback; a rerun is a resume."""
    folder = tmp_path / "latin1"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXTS[0])
    Path(os.fsdecode(bytes(folder) + b"/caf\xe9.txt")).write_text(TEXTS[1])
    out, result = run(tmp_path, folder, tok)
    assert result.manifest and result.documents == 2
    assert run(tmp_path, folder, tok)[1].skipped == result.shards


def test_parquet_reads_each_row_group_once_and_holds_no_file_open(tmp_path: Path, tok: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpcshard.runtime.sources import open_source

    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"text": TEXTS}), path, row_group_size=len(TEXTS))
    reads: list[Any] = []
    real = pq.ParquetFile.read_row_group

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        reads.append(a)
        return real(self, *a, **k)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    monkeypatch.setattr(prep, "BATCH_DOCS", 8)
    run(tmp_path, path, tok, shard_tokens=10**9)
    assert len(reads) <= 3  # the sizes, the plan's sample, the one shard: not once per batch
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(30):
        pq.write_table(pa.table({"text": TEXTS[i:i + 2]}), folder / f"p{i:02d}.parquet")
    before = len(os.listdir("/proc/self/fd"))
    source = open_source(SourceSpec(path=str(folder)))
    assert source.count() == 60 and len(os.listdir("/proc/self/fd")) < before + 5


def test_resume_with_the_source_spelled_otherwise(tmp_path: Path, tok: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    corpus(tmp_path, "text")
    monkeypatch.chdir(tmp_path)
    out, first = run(tmp_path, Path("texts"), tok)
    (out / "manifest.json").unlink()
    (out / ".prepare" / "shard-00001.done").unlink()
    again = CliRunner().invoke(main, ["data", "prepare", str(tmp_path / "texts"), "--tokenizer", str(tok),
                                      "-o", str(out), "--shard-tokens", "700", "--no-progress"])
    assert again.exit_code == 0 and "(1 written" in again.output, again.output


def test_array_tasks_read_the_planned_files_and_refuse_a_changed_source(tmp_path: Path, tok: Path) -> None:
    source = corpus(tmp_path, "text")
    cfg = prep.PrepareConfig(source=SourceSpec(path=str(source)), tokenizer=str(tok),
                             output=str(tmp_path / "arr"), shard_tokens=700, progress=False)
    src, _t, request, bounds = prep.start(cfg)
    prep.save_plan(tmp_path / "arr", request, bounds, src)
    (source / "doc-000a.txt").write_text("queued while the array waited")  # not planned: not read
    assert not prep.run_task(cfg.output, 0, 2).manifest and prep.run_task(cfg.output, 1, 2).manifest
    _, docs = read_back(tmp_path / "arr")
    assert [d.tolist() for d in docs] == [[*ids, 1] for ids in Tokenizer(str(tok)).encode(TEXTS)]
    (tmp_path / "arr" / ".prepare" / "shard-00000.done").unlink()
    (source / "doc-005.txt").write_text("edited while the array waited")
    with pytest.raises(prep.UserError, match="changed since the corpus was planned"):
        prep.run_task(cfg.output, 0, 2)


@pytest.mark.parametrize("workers", [1, 2])
def test_array_tasks_of_a_plan_with_a_lower_bound_of_the_ids_refuse_an_id_past_it(
        tmp_path: Path, tok: Path, workers: int) -> None:
    """Array tasks queued across the upgrade run a plan an older hpcshard saved, whose bound of
    the ids is the tokenizer's count of entries (300) where its EOS is 60,000: the first id
    past it is one line (they wrote it into shards whose manifest then said vocab_size 300).
    A plan whose bound holds every id the tokenizer gives is written as planned."""
    cfg = prep.PrepareConfig(source=SourceSpec(path=str(corpus(tmp_path, "jsonl"))),
                             tokenizer=str(gapped(tok, tmp_path, 60000)), output=str(tmp_path / "arr"),
                             shard_tokens=700, progress=False)
    src, _t, request, bounds = prep.start(cfg)
    assert request["vocab_size"] == 60001
    prep.save_plan(tmp_path / "arr", {**request, "vocab_size": 300}, bounds, src)  # the older version's
    with pytest.raises(prep.UserError, match=r"gave id 60000, beyond 299, the largest the plan of this "
                                             r"corpus allows .* largest id \+ 1, 60001\); prepare it again"):
        prep.run_task(cfg.output, 0, 1, workers)
    assert not list((tmp_path / "arr").glob("shard-*"))
    prep.save_plan(tmp_path / "arr", {**request, "vocab_size": 60001}, bounds, src)
    assert prep.run_task(cfg.output, 0, 1, workers).manifest


def test_a_second_run_on_one_output_is_refused_and_stale_files_are_only_the_dead_ones(
        tmp_path: Path, tok: Path) -> None:
    """A temporary file is removed when nobody holds it and it is this host's, or when it is
    an hour old by the file system's clock (another host's: a per-node flock cannot show its
    writer; the versions before side names'): never one whose writer holds it."""
    import fcntl
    import socket

    source = corpus(tmp_path, "jsonl")
    out, first = run(tmp_path, source, tok)
    (out / "manifest.json").unlink()
    (out / ".prepare" / "shard-00001.done").unlink()
    args = [str(source), "--tokenizer", str(tok), "-o", str(out), "--shard-tokens", "700"]
    with (out / ".prepare" / "lock").open("a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.truncate(0)
        held.write("node7, pid 42\n")
        held.flush()
        one_line_error(args, "another `data prepare` (node7, pid 42) is writing", "wait for it")
    host, hour = socket.gethostname(), time.time() - sidefiles.STALE_SECONDS - 60

    def side(final: str, writer: str, age: float | None = None, folder: Path = out) -> Path:
        path = folder / f".{final}.{writer}.7.{os.urandom(4).hex()}.tmp"
        path.write_bytes(b"unfinished")
        if age is not None:
            os.utime(path, (age, age))
        return path

    alive = side("shard-00009.bin", host)
    dead = [side("shard-00008.bin", host), side("request.json", host, folder=out / ".prepare"),
            side("clock", host), side("hpcshard-probe", host),
            side("shard-00003.idx", "node7.cluster.org", hour), side("manifest.json", "node7", hour),
            out / "shard-00006.bin.tmp-node7-3", out / "manifest.json.tmp-node7-3",
            out / ".prepare" / "plan.tmp-node7-3.npz"]
    for old in dead[-3:]:
        old.write_bytes(b"of the version before side names")
        os.utime(old, (hour, hour))
    kept = [side("shard-00007.bin", "node7"), side("manifest.json", "node7"),
            out / "shard-00005.bin.tmp-node7-3", side("other.json", host), out / "unrelated.tmp"]
    kept[2].write_bytes(b"the version before's, fresh")
    kept[4].write_bytes(b"not ours")
    with alive.open("r+b") as writing:
        fcntl.flock(writing.fileno(), fcntl.LOCK_EX)  # its writer at work
        again = CliRunner().invoke(main, ["data", "prepare", *args, "--no-progress"])
        assert again.exit_code == 0 and "(1 written" in again.output, again.output
    assert alive.exists() and all(p.exists() for p in kept)
    assert not [p for p in dead if p.exists()]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp") and p not in [alive, *kept]]


def test_a_write_probe_swept_by_the_run_that_holds_the_output_is_not_a_refusal(
        tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second `data prepare` on this host probes the output (a side file, not held) while the
    run that holds it sweeps this host's unheld side files: the sweep may take the probe
    between its touch and its unlink. The write was made: not "cannot be written (No such
    file or directory)", a refusal that names the wrong cause (the lock then names the run)."""
    import pathlib

    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tok)
    real = pathlib.Path.unlink
    swept: list[Path] = []

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if not swept and ".hpcshard-probe." in self.name:
            swept.extend(prep.remove_stale(out))  # the holder's sweep, start to end
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    prep.check_writable(out)
    assert [p.name.startswith(".hpcshard-probe.") for p in swept] == [True]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_two_writers_with_one_pid_write_the_manifest_whole(tmp_path: Path, tok: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two array tasks that find every shard done write the manifest at once, in containers
    whose pid namespaces give them one pid (here: one process, one pid): the second writes it
    whole between the first's write and its rename. Each writes under a name of its own and
    both renames succeed (with one temporary name of host and pid, the second truncated the
    first's, readers saw a short manifest, and the first's rename failed: its task FAILED)."""
    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tok)
    whole = (out / "manifest.json").read_text()
    (out / "manifest.json").unlink()
    rename, second = os.replace, [True]

    def meanwhile(src: Any, dst: Any) -> None:
        if second and Path(dst).name == "manifest.json":
            second.pop()
            assert prep.write_manifest(out)  # the other task, start to end
            assert (out / "manifest.json").read_text() == whole
        rename(src, dst)

    monkeypatch.setattr(os, "replace", meanwhile)
    assert prep.write_manifest(out) and not second
    assert (out / "manifest.json").read_text() == whole
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_every_file_prepare_renames_into_place_is_on_disk_with_its_rename(
        tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards, done files, the request, the plan and the manifest: each rename made durable
    (its directory fsync'd, as write_atomic does), not only the file's bytes."""
    synced: list[Path] = []
    monkeypatch.setattr(files, "fsync_dir", synced.append)
    out, result = run(tmp_path, corpus(tmp_path, "jsonl"), tok)
    shards = result.shards
    assert synced.count(out) == 2 * shards + 1  # .bin and .idx of each shard, the manifest
    assert synced.count(out / ".prepare") == shards + 2  # done files, the request, the plan


def test_a_side_file_taken_by_a_remover_before_its_hold_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remover can find a side file in the instant between its creation and its writer's
    hold (nobody holds it: an interrupted run's, removed): the writer makes another."""
    import socket

    real, removed, first = files.try_flock, [], [True]

    def late(fd: int) -> bool | OSError:
        if first:  # the writer's first hold: a remover comes first
            first.pop()
            made = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            removed.extend(sidefiles.remove_stale([(p, socket.gethostname()) for p in made]))
        return real(fd)

    monkeypatch.setattr(files, "try_flock", late)
    with files.written(tmp_path / "manifest.json", held=True) as f:
        f.write(b"whole")
    assert len(removed) == 1 and (tmp_path / "manifest.json").read_bytes() == b"whole"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_writer_whose_flock_failed_is_judged_by_age_only(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer whose flock fails (NFS lockd out of locks: ENOLCK) writes on without its hold;
    a run on this host whose flock works found its side file "this host's, nobody holds it"
    and removed it at once: the writer's rename failed. Marked unheld, it is judged by its
    age alone: kept while fresh, removed once an hour old."""
    import errno
    import fcntl

    real = fcntl.flock

    def enolck(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    out = tmp_path / "out"
    (out / ".prepare").mkdir(parents=True)
    monkeypatch.setattr(fcntl, "flock", enolck)
    with files.written(out / "shard-00000.bin", held=True) as f:
        f.write(b"tokens")
        monkeypatch.setattr(fcntl, "flock", real)  # the other run's flock works
        writing = [p for p in out.iterdir() if p.name.endswith(".tmp")]
        assert not prep.remove_stale(out)
        assert [p.exists() for p in writing] == [True]
    assert (out / "shard-00000.bin").read_bytes() == b"tokens"
    left = out / writing[0].name.replace("shard-00000.bin", "shard-00001.bin")
    left.write_bytes(b"an interrupted run's")
    hour = time.time() - sidefiles.STALE_SECONDS - 60
    os.utime(left, (hour, hour))
    assert prep.remove_stale(out) == [left]


@pytest.fixture(scope="module")
def pid_namespaces() -> None:
    """Processes in pid namespaces of their own (as a container's), or a skip: it takes
    root and `unshare` (util-linux)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("pid namespaces of their own take root and unshare")
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode:
        pytest.skip("unshare --pid is refused here (a container without CAP_SYS_ADMIN?)")


def in_pid_namespace(script: str, *args: object) -> subprocess.Popen[str]:
    """Python running `script` in a pid namespace of its own on this host (same host name):
    pid 1 there, whatever ours is."""
    return subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", script, *map(str, args)],
                            text=True, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(prep.__file__).parents[2])})


def wait_for(what: str, done: Any, procs: list[subprocess.Popen[str]]) -> None:
    """Until `done()`, while every process runs (60 s at most)."""
    deadline = time.monotonic() + 60
    while not done():
        failed = [p.stderr.read() if p.stderr else "" for p in procs if p.poll() is not None]
        assert not failed and time.monotonic() < deadline, f"waiting for {what}: {failed}"
        time.sleep(0.01)


MANIFESTS = """
import sys, time
from pathlib import Path
from hpcshard.runtime import prepare as prep
out, go, me, times = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
(go.parent / f"ready-{me}").touch()
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.001)
for _ in range(times):
    assert prep.write_manifest(out)
"""


def test_two_array_tasks_with_one_pid_in_their_own_pid_namespaces(tmp_path: Path, tok: Path,
                                                                   pid_namespaces: None) -> None:
    """The real case: two writers of the manifest on one host, each pid 1 of its own pid
    namespace (array tasks in containers), writing it at once again and again: both finish
    and it is whole (with temporary names of host and pid, one's rename failed)."""
    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tok)
    whole = (out / "manifest.json").read_text()
    go = tmp_path / "go"
    tasks = [in_pid_namespace(MANIFESTS, out, go, me, 200) for me in (0, 1)]
    wait_for("both tasks", lambda: all((tmp_path / f"ready-{me}").exists() for me in (0, 1)), tasks)
    go.touch()
    failed = [task.communicate(timeout=120)[1] for task in tasks if task.wait(120)]
    assert not failed, failed[0]
    assert (out / "manifest.json").read_text() == whole
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


WRITER = """
import os, sys, time
from pathlib import Path
out, go, pid = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # this pid namespace's next pid: `pid`
    f.write(str(pid - 1))
child = os.fork()
if child:
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
assert os.getpid() == pid
from hpcshard.runtime import prepare as prep

def tick(documents, tokens):  # the writer at work: it waits for `go` mid-shard
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)

request, bounds, index = prep.load_plan(out)
source, tok = prep._source(request, index), prep._tokenizer(request)
prep.write_shard(out, 0, source, tok, bounds, request["dtype"], tick)
"""


def test_a_live_writer_in_another_pid_namespace_is_not_stale(tmp_path: Path, tok: Path,
                                                              pid_namespaces: None) -> None:
    """An array task in a container of its own pid namespace on this host, writing a shard:
    its pid there is one that is gone in ours. A `data prepare` here keeps its temporary file
    (judged by the pid, it was "this host's, its process gone": removed, and the task's
    rename failed)."""
    out, _ = run(tmp_path, corpus(tmp_path, "jsonl"), tok)
    (out / "manifest.json").unlink()
    (out / ".prepare" / "shard-00000.done").unlink()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    go = tmp_path / "go"
    writer = in_pid_namespace(WRITER, out, go, gone)

    def writing() -> bool:
        return any(p.name != "shard-00000.bin" and "shard-00000.bin" in p.name for p in out.iterdir())

    wait_for("the writer's temporary file", writing, [writer])
    removed = prep.remove_stale(out)
    go.touch()
    assert writer.wait(60) == 0, writer.communicate()[1]
    assert not removed and prep.done_entry(out, 0) is not None
    assert prep.write_manifest(out)
    read_back(out)


def _meanwhile(monkeypatch: pytest.MonkeyPatch, other: Any) -> None:
    """`other()` runs while this run plans (after its checks, before it makes or locks the
    output): another `data prepare` started 0.3 s earlier into the same new output."""
    plan, todo = prep.start, [other]

    def start(cfg: prep.PrepareConfig) -> Any:
        planned = plan(cfg)
        while todo:  # once (A's own start is this one too)
            todo.pop()()
        return planned

    monkeypatch.setattr(prep, "start", start)


def test_a_refused_run_never_removes_the_running_ones_output(tmp_path: Path, tok: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """B starts into a new output, A makes it and takes the lock while B plans: B is refused
    (exit 2) and A's directory stays (B once removed it: it had found no output at its
    start, and removed on any ValueError)."""
    source, out = corpus(tmp_path, "jsonl"), tmp_path / "out"
    held: list[Any] = []

    def a_runs() -> None:
        prep.make_state(out)
        held.append(prep.take_lock(out))
        (out / "shard-00000.bin.tmp-a").write_bytes(b"A's shard, being written")

    _meanwhile(monkeypatch, a_runs)
    args = [str(source), "--tokenizer", str(tok), "-o", str(out), "--shard-tokens", "700"]
    one_line_error(args, "another `data prepare`", "is writing")
    assert (out / "shard-00000.bin.tmp-a").exists() and (out / ".prepare" / "lock").exists()
    held[0].close()


def test_arguments_are_checked_again_under_the_lock(tmp_path: Path, tok: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """B (--eos <unk>) plans while the output is empty; A (--eos auto) runs to the end
    meanwhile; B, holding the lock then, is refused for its other arguments and leaves A's
    corpus as it was (B once skipped A's shards as done and wrote a manifest saying eos_id
    0 over shards ending each document with 1). The array path saves its plan under the
    same lock and check."""
    source = corpus(tmp_path, "jsonl")
    a_out: list[Path] = []
    _meanwhile(monkeypatch, lambda: a_out.append(run(tmp_path, source, tok, eos="auto")[0]))
    with pytest.raises(prep.UserError, match="prepared with other arguments .*eos"):
        run(tmp_path, source, tok, eos="<unk>")
    out = a_out[0]
    before = (out / "manifest.json").read_text()
    manifest, docs = read_back(out)
    assert manifest["eos_id"] == 1 and all(d[-1] == 1 for d in docs)
    assert json.loads((out / ".prepare" / "request.json").read_text())["eos"] == "auto"
    # the same arguments meanwhile: B resumes on A's saved plan, every shard done
    monkeypatch.undo()
    same = tmp_path / "same"
    _meanwhile(monkeypatch, lambda: run(tmp_path, source, tok, name="same"))
    again = run(tmp_path, source, tok, name="same")[1]
    assert again.manifest and again.written == 0 and (same / "manifest.json").is_file()
    assert (out / "manifest.json").read_text() == before


def test_a_file_system_without_flock_takes_a_lock_file(tmp_path: Path, tok: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """flock failing with ENOSYS, EOPNOTSUPP or ENOLCK (Lustre without flock, some FUSE
    mounts) is no "held": a warning, and a lock file with the holder's host and pid keeps a
    second run out (every run was once refused there, naming a holder that did not exist).
    Any other error too (one policy for every flock: only EWOULDBLOCK is "held"); the
    warning names it."""
    import errno
    import fcntl

    from hpcshard.rundir.files import locked

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    source = corpus(tmp_path, "jsonl")
    out, result = run(tmp_path, source, tok)
    assert result.manifest and "without flock" in capfd.readouterr().err
    assert not (out / ".prepare" / "run.lock").exists()  # released
    (out / "manifest.json").unlink()
    # a live run holds it (this process: not gone)
    refused = "another `data prepare` is writing .*run.lock"
    with locked(out / ".prepare" / "run"), pytest.raises(prep.UserError, match=refused):
        run(tmp_path, source, tok)
    assert run(tmp_path, source, tok)[1].manifest

    def eio(fd: int, op: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", eio)
    (out / "manifest.json").unlink()
    capfd.readouterr()
    assert run(tmp_path, source, tok)[1].manifest and "(Input/output error)" in capfd.readouterr().err
    assert not (out / ".prepare" / "run.lock").exists()


def test_the_done_check_needs_the_index_and_the_manifest_the_checksums(tmp_path: Path, tok: Path) -> None:
    source = corpus(tmp_path, "jsonl")
    out, first = run(tmp_path, source, tok)
    (out / "manifest.json").unlink()
    (out / "shard-00001.idx").write_bytes(b"\0" * 8)
    _, again = run(tmp_path, source, tok)
    assert again.written == 1 and again.manifest
    read_back(out)
    (out / "manifest.json").unlink()
    data = bytearray((out / "shard-00002.bin").read_bytes())
    data[0] ^= 1
    (out / "shard-00002.bin").write_bytes(bytes(data))
    with pytest.raises(prep.UserError, match="shard-00002.bin does not match its checksum"):
        run(tmp_path, source, tok)
    assert not (out / "manifest.json").exists()


def test_a_kill_while_the_plan_is_saved_is_not_a_refused_directory(tmp_path: Path, tok: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source = corpus(tmp_path, "jsonl")
    whole, _ = run(tmp_path, source, tok, "whole")

    def killed(*args: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(np, "savez", killed)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, source, tok)
    _, again = run(tmp_path, source, tok)
    assert again.manifest
    (tmp_path / "bare" / ".prepare").mkdir(parents=True)  # killed before even the request
    _, bare = run(tmp_path, source, tok, "bare")
    assert bare.manifest
    assert (tmp_path / "out" / "manifest.json").read_text() == (whole / "manifest.json").read_text()


def test_a_worker_ends_with_its_parent(tmp_path: Path) -> None:
    """Its parent killed, the worker ends (SIGTERM from the kernel). Its own sleep is far
    longer than the wait for its end, so that only that signal can end it in time; the wait
    is generous (it was 5 s: a dying process on a loaded machine takes what it is given)."""
    import subprocess
    import sys

    from tests.conftest import gone
    from tests.conftest import wait_for as wait_until

    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import os, time; "
              "from hpcshard.runtime.prepare import _follow_parent; _follow_parent(os.getppid()); "
              "print(os.getpid(), flush=True); time.sleep(600)'], stdout=subprocess.PIPE, text=True)\n"
              "print(child.stdout.readline().strip(), flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(prep.__file__).parents[2])})
    assert parent.stdout is not None
    worker = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    try:
        wait_until(lambda: gone(worker), 120, "the worker's end with its parent's")
    finally:
        if not gone(worker):
            os.kill(worker, 9)


def test_an_output_that_cannot_be_written_is_one_line_before_the_scan(
        tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jsonl = corpus(tmp_path, "jsonl")
    (tmp_path / "afile").write_text("x")
    one_line_error([str(jsonl), "--tokenizer", str(tok), "-o", str(tmp_path / "afile" / "out")], "is a file")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    monkeypatch.setattr("hpcshard.runtime.sources.open_source", lambda *a: pytest.fail("scanned first"))
    one_line_error([str(jsonl), "--tokenizer", str(tok), "-o", str(tmp_path / "full")], "not empty")


def test_hidden_files_bad_utf8_and_the_cores(tmp_path: Path, tok: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = corpus(tmp_path, "text")
    (folder / ".DS_Store").write_bytes(b"\0\1binary")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main")
    out, result = run(tmp_path, folder, tok)
    assert result.documents == len(TEXTS)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "caf\xe9 ok"}\n' + b"".join(json.dumps({"text": t}).encode() + b"\n"
                                                           for t in TEXTS))
    _, bad = run(tmp_path, path, tok, "bad")
    assert bad.documents == len(TEXTS) + 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert prep.cpus() == 1


def test_the_plan_tokenizes_a_sample_not_a_whole_large_document(tmp_path: Path, tok: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.runtime.sources import open_source

    (tmp_path / "big.txt").write_text(TEXTS[0] * (3 * prep.SAMPLE_BYTES // len(TEXTS[0])))
    tokenizer = Tokenizer(str(tok))
    seen: list[int] = []
    real = tokenizer.encode
    def counted(texts: list[str]) -> list[list[int]]:
        seen.append(sum(map(len, texts)))
        return real(texts)

    monkeypatch.setattr(tokenizer, "encode", counted)
    prep.plan(open_source(SourceSpec(path=str(tmp_path / "big.txt"))), tokenizer, 1000)
    assert seen and max(seen) <= prep.SAMPLE_BYTES


def test_sigterm_stops_the_pool_as_ctrl_c_does() -> None:
    """SIGTERM (kill, Slurm's time limit) in the parent while the pool runs: KeyboardInterrupt,
    so the pool is shut down (nothing more started, the workers terminated); the old handler after."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    previous = prep._on_term(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                __import__("time").sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGTERM) is before
