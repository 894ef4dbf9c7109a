"""Prepared corpora, mixtures, the per-index order and the background loader: deterministic,
world-size independent, resumable, and the same batches with or without the loader."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcshard.config import TrainConfig
from hpcshard.errors import UserError
from hpcshard.runtime.corpus import HELD_OUT, IGNORE, Corpus, Windows, load_blend, parse_sources
from hpcshard.runtime.data import (
    DataConfig,
    GlobalBatches,
    data_changes,
    data_fingerprint,
    data_fingerprint_v1,
    eval_batch_count,
    eval_batches,
    load_splits,
)
from hpcshard.runtime.loader import Ahead
from hpcshard.runtime.order import Mixed, Ordered, Permutation, split


def write_corpus(folder: Path, docs: list[list[int]], per_shard: int = 3, dtype: str = "uint16",
                 vocab: int = 1000, tok_sha: str = "") -> Path:
    """A prepared corpus in the format `hpcshard data prepare` writes (no tokenizer)."""
    folder.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    for k in range(0, len(docs), per_shard):
        mine = docs[k:k + per_shard]
        name = f"shard-{k // per_shard:05d}"
        flat = np.array([t for d in mine for t in d], dtype=np.dtype(f"<{dtype[0]}{int(dtype[4:]) // 8}"))
        flat.tofile(folder / f"{name}.bin")
        np.cumsum([0] + [len(d) for d in mine], dtype="<i8").tofile(folder / f"{name}.idx")
        shards.append({"name": name, "tokens": len(flat), "documents": len(mine),
                       "sha256": hashlib.sha256(flat.tobytes()).hexdigest()})
    manifest = {"format": "hpcshard-tokens", "version": 1, "dtype": dtype, "vocab_size": vocab,
                "eos_id": 0, "tokenizer": {"path": "", "sha256": tok_sha}, "source": {},
                "tokens": sum(s["tokens"] for s in shards), "documents": len(docs), "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def documents(n: int, base: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[base + (i % 97)] * int(rng.integers(5, 60)) + [0] for i in range(n)]


@pytest.fixture
def corpora(tmp_path: Path) -> Path:
    for name, base in (("web", 100), ("code", 300), ("math", 500)):
        write_corpus(tmp_path / name, documents(400, base, seed=base))
    return tmp_path


def rows(b: GlobalBatches) -> torch.Tensor:
    return torch.cat([x for x, _ in b.next()])


# -- the permutation --------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_permutation_is_a_bijection(n: int) -> None:
    image = Permutation(n, key=7)(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    if n > 64:
        assert not np.array_equal(image, Permutation(n, key=8)(np.arange(n)))  # the key shuffles
        assert not np.array_equal(image, np.arange(n))


def test_the_permutation_needs_no_table_at_any_size() -> None:
    tracemalloc.start()
    perm = Permutation(10**13 // 1024, key=1)
    out = perm(np.array([0, 1, 10**9, 10**13 // 1024 - 1]))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024  # a few integers and a 4-element work array, not 80 GB
    assert len(set(out.tolist())) == 4 and all(0 <= v < 10**13 // 1024 for v in out.tolist())


# -- the corpus -------------------------------------------------------------------------

def test_stream_windows_read_across_shards(tmp_path: Path) -> None:
    docs = documents(10, 100)
    corpus = Corpus([write_corpus(tmp_path / "c", docs, per_shard=3, dtype="uint32")])
    flat = np.array([t for d in docs for t in d])
    assert corpus.tokens == len(flat) and len(corpus.shards) == 4
    assert np.array_equal(corpus.read(0, corpus.tokens), flat)
    windows = Windows(corpus, 16, "stream")
    x, y = windows.rows(np.arange(windows.count))
    assert np.array_equal(x[3], flat[48:64]) and np.array_equal(y[3], flat[49:65])


def test_whole_documents_start_at_a_document_and_mask_their_padding(tmp_path: Path) -> None:
    docs = [[1, 2, 3, 0], list(range(10, 40)) + [0], [5, 0]] * 40
    corpus = Corpus([write_corpus(tmp_path / "c", docs)])
    windows = Windows(corpus, 8, "whole")
    assert windows.count == corpus.train_documents <= len(docs)
    x, y = windows.rows(np.array([0, 1, 2]))
    assert x[0].tolist() == [1, 2, 3, 0, 0, 0, 0, 0] and y[0].tolist() == [2, 3, 0] + [IGNORE] * 5
    assert x[1].tolist() == list(range(10, 18)) and y[1].tolist() == list(range(11, 19))  # truncated
    assert y[2].tolist() == [0] + [IGNORE] * 7


def test_the_held_out_tail_is_not_trained_on(tmp_path: Path) -> None:
    corpus = Corpus([write_corpus(tmp_path / "c", documents(60, 100), per_shard=60)])
    assert 0 < corpus.tokens - corpus.train_tokens == corpus.tokens // 20
    stream = Windows(corpus, 16, "stream")
    assert stream.count * 16 + 1 <= corpus.train_tokens
    start, _ = corpus.document(corpus.train_documents - 1)
    assert start < corpus.train_tokens


# -- mixtures ---------------------------------------------------------------------------

def test_split_is_exact_and_every_index_is_taken_once() -> None:
    firsts: list[int] = []
    rests: list[int] = []
    for g in range(1000):
        first, j = split(g, Fraction(7, 10))
        (firsts if first else rests).append(j)
    assert firsts == list(range(700)) and rests == list(range(300))


def test_weights_are_honoured_over_many_steps(corpora: Path) -> None:
    blend = load_blend("web:0.7,code:0.2,math:0.1", str(corpora))
    assert blend is not None
    mixed = GlobalBatches(blend, seq_len=16, batch_size=8, micro=8, rank=0, world=1, seed=0).sampler
    assert isinstance(mixed, Mixed)
    counts = [0, 0, 0]
    seen: list[list[int]] = [[], [], []]
    for g in range(20_000):
        i, j = mixed.locate(g)
        counts[i] += 1
        seen[i].append(j)
        if g % 997 == 0:
            assert all(abs(c - (g + 1) * w) <= 2 for c, w in zip(counts, (0.7, 0.2, 0.1), strict=True))
    assert all(s == list(range(len(s))) for s in seen)  # each source's stream, in order


def test_a_source_wraps_into_a_new_shuffled_epoch(corpora: Path) -> None:
    blend = load_blend("web:1,code:1", str(corpora))
    assert blend is not None
    mixed = GlobalBatches(blend, seq_len=16, batch_size=8, micro=8, rank=0, world=1, seed=0).sampler
    assert isinstance(mixed, Mixed)
    part = mixed.parts[0]
    first, second = part.ids(0, np.arange(part.samples)), part.ids(1, np.arange(part.samples))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(part.samples))
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("spec", ["web:0.7,code:0.2,math:0.1", "mix.toml", "web"])
def test_a_step_is_the_same_on_1_2_and_4_ranks(corpora: Path, spec: str) -> None:
    (corpora / "mix.toml").write_text('[sources.web]\npath = "web"\nweight = 0.7\n'
                                      '[sources.code]\npath = "c*"\nweight = 0.3\n')
    blend = load_blend(spec, str(corpora), doc_mode="whole")
    assert blend is not None

    def make(rank: int, world: int) -> GlobalBatches:
        return GlobalBatches(blend, seq_len=16, batch_size=8, micro=2, rank=rank, world=world, seed=5)

    one, two, four = [make(0, 1)], [make(r, 2) for r in range(2)], [make(r, 4) for r in range(4)]
    for _ in range(30):
        expect = rows(one[0])
        assert torch.equal(expect, torch.cat([rows(b) for b in two]))
        assert torch.equal(expect, torch.cat([rows(b) for b in four]))


def test_resume_after_a_preemption_and_a_crash_is_bitwise(corpora: Path) -> None:
    blend = load_blend("web:0.7,code:0.2,math:0.1", str(corpora))
    assert blend is not None

    def make(world: int = 2, prefetch: int = 2) -> list[GlobalBatches]:
        return [GlobalBatches(blend, seq_len=16, batch_size=8, micro=4, rank=r, world=world, seed=1,
                              prefetch=prefetch) for r in range(world)]

    def step(ranks: list[GlobalBatches]) -> torch.Tensor:
        return torch.cat([rows(b) for b in ranks])

    straight = make(prefetch=0)
    expected = [step(straight) for _ in range(40)]
    run = make()
    for s in range(25):
        assert torch.equal(step(run), expected[s])
        if s == 9:
            saved = run[0].state_dict()  # a checkpoint after step 10; the loader is ahead
    preempted = run[0].state_dict()  # a stop saves where it is
    for b in run:
        b.close()
    resumed = make(world=4)  # requeued on another shape
    for b in resumed:
        b.load_state_dict(preempted)
    assert all(torch.equal(step(resumed), expected[s]) for s in range(25, 40))
    crashed = make(world=1)  # killed at step 25: back to the checkpoint of step 10
    crashed[0].load_state_dict(saved)
    assert all(torch.equal(step(crashed), expected[s]) for s in range(10, 40))


# -- the loader -------------------------------------------------------------------------

def test_the_background_loader_gives_the_same_batches_and_reports_its_wait(corpora: Path) -> None:
    blend = load_blend("web:0.5,math:0.5", str(corpora))
    assert blend is not None
    sync = GlobalBatches(blend, seq_len=16, batch_size=8, micro=4, rank=1, world=2, seed=3)
    ahead = GlobalBatches(blend, seq_len=16, batch_size=8, micro=4, rank=1, world=2, seed=3, prefetch=2)
    ahead.skip.add((0, 40))  # a rollback's skipped batch is skipped by the prepared ones too
    sync.skip.add((0, 40))
    for s in range(12):
        a, b = sync.next(), ahead.next()
        assert len(a) == len(b) == 1
        pairs = [(p, q) for (x, y), (u, v) in zip(a, b, strict=True) for p, q in ((x, u), (y, v))]
        assert all(torch.equal(p, q) for p, q in pairs)
        if s == 6:  # a restore moves the position: what was prepared is dropped
            for g in (sync, ahead):
                g.load_state_dict({"epoch": 0, "offset": 16})
    assert ahead.ahead is not None and len(ahead.ahead.queued) == 2
    assert ahead.wait_taken() >= 0 and ahead.waited == 0.0
    ahead.close()


def test_old_checkpoints_resume_and_randperm_keeps_their_order() -> None:
    tokens = np.arange(5000) % 251
    old = GlobalBatches(tokens, seq_len=16, batch_size=8, micro=8, rank=0, world=1, seed=3,
                        order="randperm")
    old.load_state_dict({"epoch": 2, "offset": 24})  # what releases before this one saved
    (x, _), = old.next()
    perm = torch.randperm((5000 - 1) // 16, generator=torch.Generator().manual_seed(3 * 1_000_003 + 2))
    assert [int(r[0]) for r in x] == [int(tokens[i * 16]) for i in perm[24:32]]
    new = GlobalBatches(tokens, seq_len=16, batch_size=8, micro=8, rank=0, world=1, seed=3)
    new.load_state_dict({"epoch": 2, "offset": 24})
    assert new.next()[0][0].shape == x.shape and new.state_dict() == {"epoch": 2, "offset": 32}


# -- what `data` may name -----------------------------------------------------------------

def test_load_splits_reads_prepared_corpora(corpora: Path) -> None:
    splits = load_splits(DataConfig(data=str(corpora / "web"), vocab_size=1000))
    assert splits.source is not None and splits.vocab_size == 1000
    assert splits.train_tokens == splits.source.sources[0].corpus.train_tokens and len(splits.eval)
    with pytest.raises(UserError, match="more than the model's 500"):
        load_splits(DataConfig(data=str(corpora / "web")), vocab_size=500)
    with pytest.raises(UserError, match="more than the model's 256; set vocab_size=1000"):
        load_splits(DataConfig(data=str(corpora / "web")))


@pytest.mark.parametrize(("spec", "message"), [
    ("web:0.7,code:-1", "'code' has weight '-1'; a weight must be a positive number"),
    ("web:0.7,code:x", "'code' has weight 'x'"),
    ("web:0.7,nowhere:0.3", "'nowhere' names no prepared corpus"),
    ("web:0.5,web:0.5", "'web' is named twice"),
    ("web,code:1", "'web' has no weight"),
    ("bad.toml", "has no [sources.NAME] tables"),
])
def test_a_bad_mixture_is_one_line(corpora: Path, spec: str, message: str) -> None:
    (corpora / "bad.toml").write_text("[other]\nx = 1\n")
    with pytest.raises(UserError) as err:
        load_blend(spec, str(corpora))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_doc_mode_needs_documents(corpora: Path) -> None:
    with pytest.raises(UserError, match="doc_mode=whole needs prepared corpora"):
        load_splits(DataConfig(data=str(corpora / "mix.toml"), doc_mode="whole"))
    with pytest.raises(UserError, match="doc_mode='pages' is not valid"):
        load_blend(str(corpora / "web"), doc_mode="pages")


# -- review fixes ------------------------------------------------------------------------

def edit_manifest(folder: Path, change: Any) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(change(manifest)))


def test_a_corpus_of_many_shards_stays_within_the_open_file_limit(tmp_path: Path) -> None:
    """Each shard's two files were mapped for good: 1000+ shards passed `ulimit -n 1024`."""
    folder = write_corpus(tmp_path / "web", documents(600, 100), per_shard=1)  # 600 shards
    script = f"""
import resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (160, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from hpcshard.runtime.corpus import Corpus, Windows
corpus = Corpus([__import__("pathlib").Path({str(folder)!r})])
for mode in ("stream", "whole"):
    w = Windows(corpus, 8, mode)
    x, _ = w.rows(np.arange(w.count))
    assert len(x) == w.count
print("read", corpus.tokens)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0 and "read" in done.stdout, done.stderr[-2000:]


def test_evaluating_a_mixture_reads_every_source(tmp_path: Path) -> None:
    """The held-out tails were concatenated: evaluation read only the first source's."""
    bases = {"web": 100, "code": 300, "math": 500}
    for name, base in bases.items():  # one shard each: 20,000 tokens held out per source
        write_corpus(tmp_path / name, [[base + i % 50] * 199 + [0] for i in range(2000)], per_shard=2000)
    splits = load_splits(DataConfig(data="web:1,code:1,math:1", data_root=str(tmp_path), vocab_size=1000))
    cfg = TrainConfig()
    assert splits.eval.dtype == np.uint16  # the shards' own tokens, not int64 copies
    read = sum((x.flatten().tolist() for x, _ in eval_batches(
        splits.eval, seq_len=cfg.seq_len, batch_size=cfg.batch_size, micro=cfg.batch_size, rank=0,
        world=1, count=cfg.eval_batches)), [])
    assert len(read) == cfg.eval_batches * cfg.batch_size * cfg.seq_len
    counts = {name: sum(base <= t < base + 50 for t in read) for name, base in bases.items()}
    assert min(counts.values()) > len(read) // 4, counts


def test_the_held_out_share_is_the_whole_sources_and_no_small_tail_empties_a_mixture(
        tmp_path: Path) -> None:
    """A source holds out 5% of itself (at most HELD_OUT), not 5% of its last shard (data
    prepare's remainder: here 800 tokens, 40 held out), and a short tail no longer cuts
    every other one to its length: the mixture's evaluation went from 40,000 tokens to 120,
    and off. Tails with nothing in them: an empty evaluation, not a ValueError at startup.
    HELD_OUT fits eval_batches=4 at 1M to 4M tokens a step (2^20 gave 0 batches there)."""
    write_corpus(tmp_path / "web", [[5] * 99_999 + [0]] * 4, per_shard=4)
    write_corpus(tmp_path / "code", [[6] * 99_999 + [0]] * 4, per_shard=4)
    write_corpus(tmp_path / "math", [[7] * 9_999 + [0]] * 4 + [[8] * 799 + [0]], per_shard=4)
    mixture = load_splits(DataConfig(data="web:0.45,code:0.45,math:0.1", data_root=str(tmp_path),
                                     vocab_size=1000))
    assert mixture.source is not None
    math = mixture.source.sources[2].corpus
    assert math.tokens - math.train_tokens == math.tokens // 20 == 2040
    assert len(mixture.eval) == 20_000 + 20_000 + 2040
    assert eval_batch_count(mixture.eval, 256, 8, 10) == 10
    assert {int(t) for t in mixture.eval[:3 * 1024]} == {5, 6, 7}  # every source from the start
    write_corpus(tmp_path / "a", [[5] * 10 + [0]], per_shard=1)  # 11 tokens: none held out
    write_corpus(tmp_path / "b", [[6] * 10 + [0]], per_shard=1)
    empty = load_splits(DataConfig(data="a:1,b:1", data_root=str(tmp_path), vocab_size=1000))
    assert len(empty.eval) == 0 and empty.eval.dtype == np.uint16
    for seq, batch in ((4096, 256), (2048, 512), (8192, 128), (4096, 1024)):
        assert eval_batch_count(np.empty(HELD_OUT, np.uint16), seq, batch, 4) >= 3, (seq, batch)


def test_a_run_resolved_before_the_held_out_setting_keeps_its_split(tmp_path: Path) -> None:
    """The split decides which samples train: a run resolved before `held_out` existed (its
    checkpoints' positions mean the last-shard split) keeps it when requeued or resumed; a
    new run, one that says, and a job without DataConfig are their own."""
    from hpcshard.config import build_config, kept_sets

    @dataclasses.dataclass(kw_only=True)
    class Config(TrainConfig, DataConfig):
        pass

    old = {"data": "web", "token_dtype": "uint16", "seed": 0, "data_order": "feistel"}
    assert build_config(Config, kept_sets({}, old)).held_out == "last-shard"
    assert build_config(Config, kept_sets({}, {**old, "held_out": "source"})).held_out == "source"
    assert kept_sets({"held_out": "source"}, old) == {"held_out": "source"}
    assert kept_sets({}, {"seed": 0, "data_order": "feistel"}) == {}  # no DataConfig: nothing to keep
    # a job's own `data` field is not DataConfig's (examples/custom_job): nothing to keep either
    assert kept_sets({}, {"data": "README.md", "seed": 0, "data_order": "feistel"}) == {}
    write_corpus(tmp_path / "web", [[5] * 99_999 + [0]] * 4 + [[6] * 799 + [0]], per_shard=4)
    before = load_splits(DataConfig(data="web", data_root=str(tmp_path), vocab_size=1000,
                                    held_out="last-shard"))
    assert before.source is not None and before.source.sources[0].corpus.train_tokens == 400_000 + 800 - 40
    with pytest.raises(UserError, match="held_out='all' is not valid; choose one of: source, last-shard"):
        load_splits(DataConfig(data="web", data_root=str(tmp_path), vocab_size=1000, held_out="all"))


def test_the_fingerprint_is_the_content_not_the_spelling(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One corpus spelled absolute, ./x, x/, through a symlink (an NFS alias) or data_root +
    a relative path is the same data (each was refused as "source gone; source added"); the
    same counts over other content (documents reordered, other ids, another tokenizer) are
    not (each was accepted)."""
    root = tmp_path / "root"
    docs = documents(50, 100, seed=1)
    write_corpus(root / "corpora" / "web", docs)
    (tmp_path / "alias").symlink_to(root)

    def fingerprint(data: str, data_root: str = "") -> dict | None:
        return data_fingerprint(load_splits(DataConfig(data=data, data_root=data_root, vocab_size=1000)),
                                16, "feistel")

    monkeypatch.chdir(root)
    saved = fingerprint("corpora/web")
    for spelled, data_root in ((str(root / "corpora/web"), ""), ("corpora/web", str(root)),
                               ("./corpora/web", ""), ("corpora/web/", ""),
                               (str(tmp_path / "alias/corpora/web"), "")):
        assert data_changes(saved, fingerprint(spelled, data_root)) == "", spelled
    for changed, tok_sha in ((docs[::-1], ""), ([[t + 1 for t in d] for d in docs], ""), (docs, "other")):
        shutil.rmtree(root / "corpora" / "web")
        write_corpus(root / "corpora" / "web", changed, tok_sha=tok_sha)
        assert "source 'corpora/web' tokens differ" in data_changes(saved, fingerprint("corpora/web"))


def test_a_checkpoint_of_the_first_fingerprint_format_resumes_as_it_was_checked(corpora: Path) -> None:
    """A checkpoint written before the content fingerprint holds the first format (spelled
    names and directories, sizes): compared in that format, the unchanged data resumes and
    a grown source is still refused; never refused because the format changed."""
    splits = load_splits(DataConfig(data="web*:0.7,code:0.3", data_root=str(corpora), vocab_size=1000))
    old = data_fingerprint_v1(splits, 64, "feistel")
    assert old is not None and "version" not in old
    now, now_v1 = data_fingerprint(splits, 64, "feistel"), data_fingerprint_v1(splits, 64, "feistel")
    assert data_changes(old, now, now_v1) == ""
    write_corpus(corpora / "web2", documents(30, 100))
    grown = load_splits(DataConfig(data="web*:0.7,code:0.3", data_root=str(corpora), vocab_size=1000))
    changed = data_changes(old, data_fingerprint(grown, 64, "feistel"),
                           data_fingerprint_v1(grown, 64, "feistel"))
    assert "source 'web*' dirs" in changed


def test_the_held_out_tails_are_read_where_evaluation_reads_them(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each source's held-out tail was read whole and its ids checked at every start: a 2^24
    token tail is 64 MB of uint32 per node and per source from shared storage, and a mixture
    read every source's whole tail, though it keeps 2^24 tokens in all and evaluation reads a
    few batches. Nothing of it is read at the start; evaluation reads its windows, their ids
    checked there as training's are."""
    for name, base in (("web", 100), ("code", 300)):
        write_corpus(tmp_path / name, [[base + i % 50] * 199 + [0] for i in range(2000)], per_shard=2000)
    read: list[int] = []
    checked = Corpus._ids

    def ids(self: Corpus, k: int, at: int, piece: np.ndarray) -> np.ndarray:
        read.append(len(piece))
        return checked(self, k, at, piece)

    monkeypatch.setattr(Corpus, "_ids", ids)
    for data in ("web", "web:1,code:1"):
        splits = load_splits(DataConfig(data=data, data_root=str(tmp_path), vocab_size=1000))
        assert len(splits.eval) >= 20_000 and not read, data
        batches = list(eval_batches(splits.eval, seq_len=64, batch_size=4, micro=4, rank=0, world=1, count=2))
        assert len(batches) == 2 and sum(read) == 2 * 4 * 65, data
        read.clear()


def test_one_source_evaluates_its_own_tail(corpora: Path) -> None:
    blend = load_blend("web", str(corpora))
    assert blend is not None
    corpus = blend.sources[0].corpus
    tail = corpus.read(corpus.train_tokens, corpus.tokens - corpus.train_tokens)
    assert blend.held_out()[:].tolist() == tail.tolist()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda f: (f / "manifest.json").unlink(), "has no manifest.json: its preparation did not finish"),
    (lambda f: [p.unlink() for p in f.glob("*")] and (f / ".prepare").mkdir(),
     "has no manifest.json: its preparation did not finish"),
    (lambda f: (f / "manifest.json").rename(f / "partial.json"), "run `hpcshard data prepare` again"),
])
def test_a_corpus_whose_preparation_did_not_finish_is_one_line(tmp_path: Path, damage: Any,
                                                              message: str) -> None:
    """A directory without its manifest (written last) was trained on as text bytes."""
    folder = write_corpus(tmp_path / "web", documents(50, 100))
    damage(folder)
    with pytest.raises(UserError) as err:
        load_splits(DataConfig(data=str(folder), vocab_size=1000))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_folder_of_corpora_or_a_glob_with_an_unfinished_one_is_one_line(corpora: Path) -> None:
    with pytest.raises(UserError, match="its subdirectories code, math, web are: name them"):
        load_splits(DataConfig(data=str(corpora), vocab_size=1000))
    write_corpus(corpora / "web2", documents(50, 100))
    (corpora / "web2" / "manifest.json").unlink()
    with pytest.raises(UserError, match="web2' has no manifest.json"):
        load_splits(DataConfig(data=str(corpora / "web*"), vocab_size=1000))


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: [m], "manifest.json: a list, not an object"),
    (lambda m: {k: v for k, v in m.items() if k != "shards"}, "manifest.json: shards is missing"),
    (lambda m: {k: v for k, v in m.items() if k != "vocab_size"}, "manifest.json: vocab_size is missing"),
    (lambda m: {k: v for k, v in m.items() if k != "tokens"}, "manifest.json: tokens is missing"),
    (lambda m: {**m, "vocab_size": None}, "manifest.json: vocab_size is null, not a positive integer"),
    (lambda m: {**m, "shards": {"a": 1}}, "manifest.json: shards is {\"a\": 1}, not a list"),
    (lambda m: {**m, "shards": [None]}, "manifest.json: shards[0] is None, not an object"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "tokens": "12"}] + m["shards"][1:]},
     "manifest.json: shards[0].tokens is \"12\", not an integer"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "name": None}] + m["shards"][1:]},
     "manifest.json: shards[0].name is null, not a file name"),
    (lambda m: {**m, "tokens": m["tokens"] + 1}, "its `tokens` says"),
])
def test_a_malformed_manifest_is_one_line(tmp_path: Path, change: Any, message: str) -> None:
    folder = write_corpus(tmp_path / "web", documents(50, 100))
    edit_manifest(folder, change)
    with pytest.raises(UserError) as err:
        load_blend(str(folder))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("offsets", "message"), [
    (lambda o: o.__setitem__(0, 1), "first 1, last"),
    (lambda o: o.__setitem__(1, o[2] + 1), "not 0, non-decreasing"),
    (lambda o: o.__setitem__(-1, o[-1] - 1), "last"),
])
def test_a_damaged_index_is_one_line_when_first_read(tmp_path: Path, offsets: Any, message: str) -> None:
    folder = write_corpus(tmp_path / "web", documents(50, 100))
    idx = np.fromfile(folder / "shard-00000.idx", dtype="<i8")
    offsets(idx)
    idx.tofile(folder / "shard-00000.idx")
    blend = load_blend(str(folder))
    assert blend is not None
    windows = Windows(blend.sources[0].corpus, 8, "whole")
    with pytest.raises(UserError) as err:
        windows.rows(np.arange(windows.count))
    assert "shard-00000.idx: its document offsets" in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_shard_is_one_line_when_first_read(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path / "web", documents(50, 100))
    (folder / "shard-00000.bin").unlink()
    blend = load_blend(str(folder))
    assert blend is not None
    with pytest.raises(UserError, match="shard-00000.bin is missing"):
        blend.sources[0].corpus.read(0, 4)


def test_a_shard_mapped_again_after_the_lru_dropped_it_is_checked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A corpus re-prepared under a running job: a shard's file mapped again once the LRU
    unmapped it is of another size (larger: once read silently; smaller: numpy's ValueError)."""
    from hpcshard.runtime import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "MAPS", corpus_module._Maps())
    monkeypatch.setattr(corpus_module, "MAX_OPEN", 1)
    folder = write_corpus(tmp_path / "web", documents(6, 100), per_shard=3)
    corpus = Corpus([folder])
    size = corpus.shards[0].tokens * 2
    first = corpus.read(0, 4).tolist()
    corpus.read(int(corpus.starts[1]), 4)  # shard 1 mapped: shard 0 dropped
    assert corpus.read(0, 4).tolist() == first
    for other in (size + 6, size - 4):
        corpus.read(int(corpus.starts[1]), 4)
        os.truncate(folder / "shard-00000.bin", other)
        with pytest.raises(UserError, match="shard-00000.bin holds .* bytes, its manifest says"):
            corpus.read(0, 4)


def test_an_id_beyond_the_vocabulary_is_one_line_naming_its_shard(tmp_path: Path) -> None:
    """A shard holding an id at or beyond its manifest's vocab_size (damaged, or written when
    prepare took a tokenizer's count of entries for the bound of its ids) is refused where it
    is read, in one line naming the shard: not an index error in the model's embedding (on a
    GPU a device-side assert), again at every restart. Training windows and the held-out
    tail alike; the shards before it read as ever."""
    folder = write_corpus(tmp_path / "web", documents(6, 100), per_shard=3, vocab=1000)
    data = np.fromfile(folder / "shard-00001.bin", dtype="<u2")
    data[5], data[-1] = 1000, 60000
    data.tofile(folder / "shard-00001.bin")
    corpus = Corpus([folder])
    assert corpus.read(0, int(corpus.starts[1])).max() < 1000
    windows = Windows(corpus, 8, "stream")
    with pytest.raises(UserError) as err:
        windows.rows(np.arange(windows.count))
    said = str(err.value)
    assert "shard-00001.bin: token 5 is id 1000, not below the manifest's vocab_size 1000" in said
    assert "prepare it again" in said and "\n" not in said
    held = corpus.held_out()  # read where evaluation reads it
    with pytest.raises(UserError, match=f"shard-00001.bin: token {len(data) - 1} is id 60000"):
        held[len(held) - 8:]


def test_a_corpus_past_its_manifests_bound_trains_on_with_a_model_that_holds_its_ids(tmp_path: Path) -> None:
    """A corpus an older `data prepare` wrote with its tokenizer's count of entries for the bound
    (manifest vocab_size 1000, an EOS of id 60000) trained with a model whose embedding holds
    every id: a Hugging Face model's, padded above its tokenizer's ids, or vocab_size=60001
    set by hand. It trains on, eval too (refused where read, it stopped the run, and preparing
    it again changes its manifest: the resume was refused as other data). A model that does
    not hold an id: one line naming the model's vocab_size, where it is read."""
    folder = write_corpus(tmp_path / "old", [[5, 6, 7, 60000]] * 400, per_shard=100, vocab=1000)
    splits = load_splits(DataConfig(data=str(folder)), vocab_size=60001)
    assert splits.source is not None and int(splits.eval[:].max()) == 60000
    batches = GlobalBatches(splits.source, seq_len=8, batch_size=40, micro=40, rank=0, world=1, seed=0)
    assert all(int(batches.next()[0][0].max()) == 60000 for _ in range(8))
    with pytest.raises(UserError, match="more than the model's 999"):  # below the manifest's: refused first
        load_splits(DataConfig(data=str(folder)), vocab_size=999)
    small = load_splits(DataConfig(data=str(folder)), vocab_size=1000)
    with pytest.raises(UserError, match=r"shard-00003\.bin: token \d+ is id 60000, not below the model's "
                                        "vocab_size 1000; the corpus is damaged"):
        next(eval_batches(small.eval, seq_len=8, batch_size=1, micro=1, rank=0, world=1, count=1))


@pytest.mark.parametrize(("field", "value"), [("tokenizer", {"path": "", "sha256": "other"}),
                                              ("vocab_size", 999), ("eos_id", 7)])
def test_sources_prepared_with_other_tokenizers_are_one_line(corpora: Path, field: str, value: Any) -> None:
    """Only the vocabulary size was compared (and across sources only, the largest kept)."""
    edit_manifest(corpora / "code", lambda m: {**m, field: value})
    with pytest.raises(UserError) as err:
        load_blend("web:1,code:1", str(corpora))
    text = str(err.value)
    assert str(corpora / "web") in text and str(corpora / "code") in text and "\n" not in text
    (corpora / "web2").symlink_to(corpora / "code")
    with pytest.raises(UserError, match="prepare every source with the same tokenizer"):
        load_blend("web*", str(corpora))


def test_a_tiny_weight_is_sampled_not_rounded_away(corpora: Path) -> None:
    """1e-7 rounded to 0 before normalising: a ZeroDivisionError (or a never-drawn source)."""
    blend = load_blend("web:1,code:1e-7", str(corpora))
    assert blend is not None
    assert [s.weight for s in blend.sources] == [Fraction(10**7, 10**7 + 1), Fraction(1, 10**7 + 1)]
    b = GlobalBatches(blend, seq_len=16, batch_size=8, micro=8, rank=0, world=1, seed=0)
    assert isinstance(b.sampler, Mixed)  # its first draw: when half a sample is its due
    assert [g for g in range(4_999_990, 5_000_010) if b.sampler.locate(g)[0] == 1] == [5_000_000]
    rows(b)


@pytest.mark.parametrize("name", ["notes,v2.txt", "log:2", "a,b:0.5"])
def test_a_text_path_with_a_comma_or_a_colon_is_that_path(tmp_path: Path, name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / name).write_text("hello world " * 200)
    (tmp_path / "corpora").mkdir()
    monkeypatch.chdir(tmp_path)  # text is read from the working directory, whatever data_root says
    for data, root in ((str(tmp_path / name), ""), (name, str(tmp_path)), (name, "corpora")):
        assert parse_sources(data, root) is None
    splits = load_splits(DataConfig(data=str(tmp_path / name)))
    assert splits.source is None and splits.vocab_size == 256 and len(splits.train) + len(splits.eval) == 2400


def test_a_text_directory_with_someone_elses_manifest_is_text(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "manifest.json").write_text('{"name": "web app", "icons": []}')
    (tmp_path / "site" / "index.html").write_text("<p>hi</p>" * 100)
    splits = load_splits(DataConfig(data=str(tmp_path / "site")))
    assert splits.source is None and splits.vocab_size == 256


def test_randperm_orders_each_source_of_a_mixture_apart() -> None:
    """The salt was left out: sources of one size were drawn in the same order."""

    class Count:
        count = 1000

        def rows(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
            return (ids,)

    one, two = (Ordered(Count(), 5, "randperm", salt=s).ids(3, np.arange(1000)) for s in (1, 2))
    assert sorted(one.tolist()) == list(range(1000)) and one.tolist() != two.tolist()
    lone = Ordered(Count(), 5, "randperm").ids(3, np.arange(1000))  # a lone source: as before
    before = torch.randperm(1000, generator=torch.Generator().manual_seed(5 * 1_000_003 + 3))
    assert lone.tolist() == before.tolist()


def test_the_loader_thread_never_holds_a_rank_at_its_exit() -> None:
    """A fetch blocked on a hung file system kept the process from exiting (the pool's
    thread was joined at exit). Closed once a fetch is blocked in it, not a while after the
    plan (on a loaded machine the thread may not have begun the fetch by then)."""
    script = """
import threading, time
from hpcshard.runtime.loader import Ahead
fetching = threading.Event()
ahead = Ahead(lambda epoch, offset: (fetching.set(), time.sleep(3600)))
ahead.plan([(0, 0), (0, 8)])
assert fetching.wait(60)
ahead.close()
print("closed")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]


def test_the_loader_hands_a_failed_fetch_to_the_loop() -> None:
    def fetch(epoch: int, offset: int) -> int:
        if offset == 8:
            raise UserError("bad shard")
        return offset

    ahead: Ahead[int] = Ahead(fetch)
    ahead.plan([(0, 0), (0, 8)])
    assert ahead.take((0, 0)) == 0 and ahead.take((0, 16)) == 16
    with pytest.raises(UserError, match="bad shard"):
        ahead.take((0, 8))
    ahead.close()
    assert ahead.thread.daemon


def test_a_resume_onto_changed_data_is_refused_unless_accepted(corpora: Path) -> None:
    """The position is two integers: on other data (a glob gained a directory, a weight was
    edited) it silently meant other samples."""
    from types import SimpleNamespace

    from hpcshard.runtime.checkpoint import Loaded
    from hpcshard.runtime.train import Trainer

    def fingerprint(data: str, **sets: Any) -> dict | None:
        splits = load_splits(DataConfig(data=data, data_root=str(corpora), vocab_size=1000, **sets))
        return data_fingerprint(splits, 64, "feistel")

    saved = fingerprint("web*:0.7,code:0.3")
    assert saved is not None and json.loads(json.dumps(saved)) == saved  # what the manifest holds
    assert data_changes(saved, fingerprint("web*:0.7,code:0.3")) == ""
    assert data_changes(None, fingerprint("web*:0.7,code:0.3")) == ""  # a checkpoint from before
    assert "source 'code' weight '3/10' -> '1/5'" in data_changes(saved, fingerprint("web*:0.8,code:0.2"))
    assert "doc_mode 'stream' -> 'whole'" in data_changes(saved, fingerprint("web*:0.7,code:0.3",
                                                                             doc_mode="whole"))
    write_corpus(corpora / "web2", documents(30, 100))
    grown = fingerprint("web*:0.7,code:0.3")
    assert "source 'web*' tokens differ" in data_changes(saved, grown)
    assert "source 'web*' documents 400 -> 430" in data_changes(saved, grown)
    assert data_fingerprint(load_splits(DataConfig(data="", vocab_size=1000)), 64, "feistel") is None

    loaded = Loaded(step=8, path="/run/checkpoints/step-8", skipped=[], world_changed=False,
                    manifest={"data": saved})
    for accept, refused in ((False, True), (True, False)):
        trainer = SimpleNamespace(data_fingerprint=grown, data_fingerprint_v1=None,
                                  splits=SimpleNamespace(accept_changed=accept),
                                  env=SimpleNamespace(is_main=True))
        if refused:
            with pytest.raises(UserError) as err:
                Trainer._same_data(trainer, loaded)  # type: ignore[arg-type]
            assert "the data differs from what step-8 was trained on" in str(err.value)
            assert "data_changed=accept" in str(err.value) and "\n" not in str(err.value)
        else:
            Trainer._same_data(trainer, loaded)  # type: ignore[arg-type]
    accepted = load_splits(DataConfig(data="web", data_root=str(corpora), data_changed="accept"),
                           vocab_size=1000)
    assert accepted.accept_changed
    with pytest.raises(UserError, match="data_changed='maybe' is not valid"):
        load_splits(DataConfig(data="web", data_root=str(corpora), data_changed="maybe"), vocab_size=1000)
