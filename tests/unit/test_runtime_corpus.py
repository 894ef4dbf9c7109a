"""Prepared corpora, mixtures, the per-index order and the background loader: deterministic,
world-size independent, resumable, and the same batches with or without the loader."""

from __future__ import annotations

import json
import tracemalloc
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcshard.errors import UserError
from hpcshard.runtime.corpus import IGNORE, Corpus, Windows, load_blend
from hpcshard.runtime.data import DataConfig, GlobalBatches, load_splits
from hpcshard.runtime.order import Mixed, Permutation, split


def write_corpus(folder: Path, docs: list[list[int]], per_shard: int = 3, dtype: str = "uint16",
                 vocab: int = 1000) -> Path:
    """A prepared corpus in the format `hpcshard data prepare` writes (no tokenizer)."""
    folder.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    for k in range(0, len(docs), per_shard):
        mine = docs[k:k + per_shard]
        name = f"shard-{k // per_shard:05d}"
        flat = np.array([t for d in mine for t in d], dtype=np.dtype(f"<{dtype[0]}{int(dtype[4:]) // 8}"))
        flat.tofile(folder / f"{name}.bin")
        np.cumsum([0] + [len(d) for d in mine], dtype="<i8").tofile(folder / f"{name}.idx")
        shards.append({"name": name, "tokens": len(flat), "documents": len(mine), "sha256": ""})
    manifest = {"format": "hpcshard-tokens", "version": 1, "dtype": dtype, "vocab_size": vocab,
                "eos_id": 0, "tokenizer": {"path": "", "sha256": ""}, "source": {},
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
    assert 0 < corpus.tokens - corpus.train_tokens <= corpus.shards[-1].tokens // 20
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
