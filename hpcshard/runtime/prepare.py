"""`hpcshard data prepare`: a corpus tokenized into shards of tokens, in parallel over
processes or Slurm array tasks, resumable, with a manifest written last.

The output directory (the format `hpcshard-tokens` version 1; the reader relies on it):

    manifest.json        written last, atomically: only a finished corpus has one
    shard-NNNNN.bin      the tokens, little-endian uint16 (vocabulary <= 65536) or uint32;
                         each document followed by the tokenizer's EOS (counted in it)
    shard-NNNNN.idx      little-endian int64: documents + 1 offsets into the shard
    .prepare/            the work's state: the request, the plan, one done file per shard

Shards are planned before anything is tokenized: documents in their order, cut where the
bytes read reach --shard-tokens (at the tokens per byte that a sample of the first
documents gives). A shard's documents depend on the source, the tokenizer and the target
only, so 1 worker, 8 workers or 16 array tasks write the same bytes. A shard is written
under a temporary name, renamed when complete, then its done file (its manifest entry,
with the checksum) is written: a rerun skips the shards that have one.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcshard.errors import UserError
from hpcshard.runtime.sources import Source, SourceSpec, Tokenizer, open_source

FORMAT, VERSION = "hpcshard-tokens", 1
STATE = ".prepare"
"""The work's own folder in the output directory."""
BATCH_DOCS = 256
"""Documents per `encode_batch` call: enough for the library's threads, little memory."""
SAMPLE_BYTES = 1 << 18
"""Text tokenized to learn the tokens per byte that shards are planned with."""


@dataclass(kw_only=True)
class PrepareConfig:
    """One `data prepare`: what to read, how to tokenize it, where to write."""

    source: SourceSpec
    """The documents."""
    tokenizer: str
    """A tokenizer.json, or a local directory with a tokenizer."""
    output: str
    """The directory of shards (new or empty, or this same request's to resume)."""
    eos: str = "auto"
    """auto (the tokenizer's end-of-text token, if it has one), none, or a token."""
    shard_tokens: int = 100_000_000
    """About how many tokens a shard holds (whole documents: a long one overshoots)."""
    workers: int = 1
    """Processes tokenizing at once (each writes whole shards)."""
    progress: bool = True
    """A progress bar on stderr (documents and tokens per second)."""


@dataclass(kw_only=True)
class Prepared:
    """What a call did: the shards it wrote, those it found done, and the totals."""

    written: int = 0
    """Shards tokenized and written by this call."""
    skipped: int = 0
    """Shards already done (a resumed run)."""
    shards: int = 0
    """Shards in the plan."""
    tokens: int = 0
    documents: int = 0
    manifest: bool = False
    """The manifest is written: the corpus is complete."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def dtype_for(vocab_size: int) -> str:
    """uint16 while every id fits (vocabulary <= 65536), else uint32."""
    return "uint16" if vocab_size <= 65536 else "uint32"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


# -- the request and its plan ----------------------------------------------------------------


def request_of(cfg: PrepareConfig, source: Source, tok: Tokenizer) -> dict[str, Any]:
    """What the output depends on (not the workers: any number writes the same shards)."""
    return {"format": FORMAT, "version": VERSION, "source": source.describe(),
            "source_fingerprint": source.fingerprint(),
            "tokenizer": {"path": tok.path, "sha256": tok.sha256}, "eos": cfg.eos, "eos_id": tok.eos_id,
            "vocab_size": tok.vocab_size, "dtype": dtype_for(tok.vocab_size),
            "shard_tokens": cfg.shard_tokens}


def plan(source: Source, tok: Tokenizer, shard_tokens: int) -> np.ndarray:
    """Document boundaries of the shards (shard k: documents bounds[k]..bounds[k+1]-1):
    cut where the bytes reach `shard_tokens` at the sampled tokens per byte."""
    sizes = source.sizes().astype(np.int64)
    if not sizes.sum():
        raise UserError(f"source {source.spec.path} has no text (only empty documents); give a source with "
                        "text in it")
    n, sample, seen = len(sizes), 0, 0
    while sample < n and seen < SAMPLE_BYTES:
        seen += int(sizes[sample])
        sample += 1
    tokens = sum(len(ids) for ids in tok.encode(source.read(0, sample)))
    tokens += sample if tok.eos_id is not None else 0
    ends = np.cumsum(sizes + 1)  # +1: a byte for each document's EOS, and no empty document is free
    per_token = float(ends[sample - 1]) / max(1, tokens)  # in the sizes' own bytes (a JSONL line's)
    target = max(1.0, shard_tokens * per_token)
    cuts = np.searchsorted(ends, np.arange(1, int(ends[-1] // target) + 1) * target, side="left") + 1
    return np.unique(np.concatenate([[0], np.minimum(cuts, n), [n]])).astype(np.int64)


def _state(out: Path) -> Path:
    return out / STATE


def start(cfg: PrepareConfig) -> tuple[Source, Tokenizer, dict[str, Any], np.ndarray]:
    """Everything checked before anything is written: the source read and planned, the
    tokenizer loaded, the output directory new, empty, or this same request's."""
    tok = Tokenizer(cfg.tokenizer, cfg.eos)
    source = open_source(cfg.source)
    request = request_of(cfg, source, tok)
    out = Path(cfg.output)
    check_output(out, request)
    if (_state(out) / "plan.npz").is_file():  # a resume: the plan its done shards were cut by
        return source, tok, request, load_plan(out)[1]
    return source, tok, request, plan(source, tok, cfg.shard_tokens)


def check_output(out: Path, request: dict[str, Any]) -> None:
    """A new or empty output directory, or one this request was started in (resume)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a new or empty directory")
    if not out.exists() or not any(out.iterdir()):
        return
    saved = _state(out) / "request.json"
    if not saved.is_file():
        raise UserError(f"--output {out} is not empty and holds no prepared corpus; give a new or "
                        "empty directory")
    old = json.loads(saved.read_text())
    differ = sorted(k for k in {*old, *request} if old.get(k) != request.get(k))
    if differ:
        raise UserError(f"--output {out} was prepared with other arguments (they differ in: "
                        f"{', '.join(differ)}); give the same ones to resume, or a new directory")


def save_plan(out: Path, request: dict[str, Any], bounds: np.ndarray, source: Source) -> None:
    """The request and the plan, where every worker and array task reads them."""
    state = _state(out)
    state.mkdir(parents=True, exist_ok=True)
    arrays = {"bounds": bounds, **{f"index_{k}": v for k, v in source.index().items()}}
    np.savez(state / "plan.tmp.npz", **arrays)  # type: ignore[arg-type]  # numpy's stub: file, *args
    os.replace(state / "plan.tmp.npz", state / "plan.npz")
    _write_json(state / "request.json", request)


def load_plan(out: Path) -> tuple[dict[str, Any], np.ndarray, dict[str, np.ndarray]]:
    state = _state(out)
    request = json.loads((state / "request.json").read_text())
    with np.load(state / "plan.npz") as saved:
        index = {k.removeprefix("index_"): saved[k] for k in saved.files if k.startswith("index_")}
        return request, saved["bounds"], index


def _write_json(path: Path, value: Any) -> None:
    """Atomically: a temporary name of this process's, then renamed."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


# -- shards ------------------------------------------------------------------------------------


def done_entry(out: Path, k: int) -> dict[str, Any] | None:
    """Shard k's manifest entry when it is complete (done file, and a .bin of its size)."""
    try:
        entry = json.loads((_state(out) / f"{shard_name(k)}.done").read_text())
        request = json.loads((_state(out) / "request.json").read_text())
        size = (out / f"{shard_name(k)}.bin").stat().st_size
    except (OSError, ValueError):
        return None
    return entry if size == entry["tokens"] * np.dtype(request["dtype"]).itemsize else None


def write_shard(out: Path, k: int, source: Source, tok: Tokenizer, bounds: np.ndarray, dtype: str,
                tick: Callable[[int, int], None]) -> dict[str, Any]:
    """Tokenize shard k's documents, write its .bin and .idx (temporary names, renamed when
    complete), then its done file; its manifest entry."""
    start, stop = int(bounds[k]), int(bounds[k + 1])
    chunks: list[np.ndarray] = []  # each batch's tokens, in the shard's dtype (its memory: the shard's)
    lengths: list[int] = []
    for lo in range(start, stop, BATCH_DOCS):
        hi = min(stop, lo + BATCH_DOCS)
        ids = tok.encode(source.read(lo, hi))
        if tok.eos_id is not None:
            for one in ids:
                one.append(tok.eos_id)
        counts = [len(one) for one in ids]
        chunks.append(_narrow(np.concatenate([np.array(one, dtype=np.int64) for one in ids]), dtype, tok))
        lengths.extend(counts)
        tick(hi - lo, sum(counts))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.dtype(dtype).newbyteorder("<"))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype("<i8")
    name, tag = shard_name(k), f"tmp-{socket.gethostname()}-{os.getpid()}"
    data = tokens.tobytes()
    for suffix, blob in ((".idx", offsets.tobytes()), (".bin", data)):
        tmp = out / f"{name}{suffix}.{tag}"
        with tmp.open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename says it is complete
        os.replace(tmp, out / f"{name}{suffix}")
    entry = {"name": name, "tokens": int(tokens.size), "documents": stop - start,
             "sha256": hashlib.sha256(data).hexdigest()}
    _write_json(_state(out) / f"{name}.done", entry)
    return entry


def _narrow(ids: np.ndarray, dtype: str, tok: Tokenizer) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(dtype).max):
        raise UserError(f"tokenizer {tok.path} gave id {int(ids.max())}, beyond {dtype}: its vocabulary "
                        f"size ({tok.vocab_size}) is wrong")
    return ids.astype(np.dtype(dtype).newbyteorder("<"))


def write_manifest(out: Path) -> bool:
    """The manifest, once every shard is done (by whichever process finds them all done:
    the same text from any of them); False while one is missing."""
    request, bounds, _ = load_plan(out)
    entries = [done_entry(out, k) for k in range(len(bounds) - 1)]
    if any(e is None for e in entries):
        return False
    shards = [e for e in entries if e is not None]
    manifest = {"format": FORMAT, "version": VERSION, "dtype": request["dtype"],
                "vocab_size": request["vocab_size"], "eos_id": request["eos_id"],
                "tokenizer": request["tokenizer"], "source": request["source"],
                "tokens": sum(e["tokens"] for e in shards), "documents": sum(e["documents"] for e in shards),
                "shards": shards}
    _write_json(out / "manifest.json", manifest)
    return True


# -- running ---------------------------------------------------------------------------------


def prepare(cfg: PrepareConfig) -> Prepared:
    """Check, plan, and write every shard not done yet (over `workers` processes), then the
    manifest. Bad input raises UserError before the output directory is made."""
    source, tok, request, bounds = start(cfg)
    out = Path(cfg.output)
    save_plan(out, request, bounds, source)
    for stale in out.glob("shard-*.tmp-*"):  # an interrupted run's unfinished shards
        stale.unlink(missing_ok=True)
    return run_shards(out, source, tok, list(range(len(bounds) - 1)), cfg.workers, cfg.progress)


def run_shards(out: Path, source: Source, tok: Tokenizer, shards: list[int], workers: int,
               progress: bool) -> Prepared:
    """Shards `shards` of the saved plan (those not done yet), then the manifest if all are."""
    began = time.perf_counter()
    request, bounds, _ = load_plan(out)
    todo = [k for k in shards if done_entry(out, k) is None]
    result = Prepared(shards=len(bounds) - 1, skipped=len(shards) - len(todo))
    if result.skipped:
        result.notes.append(f"{result.skipped} of {len(shards)} shard(s) already done: skipped")
    docs = int(sum(bounds[k + 1] - bounds[k] for k in todo))
    bar = _bar(docs, progress)
    tokens = [0]

    def tick(n: int, t: int) -> None:
        tokens[0] += t
        bar.update(n)
        rate = tokens[0] / max(1e-9, time.perf_counter() - began)
        bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)

    try:
        if workers <= 1 or len(todo) <= 1:
            for k in todo:
                write_shard(out, k, source, tok, bounds, request["dtype"], tick)
        else:
            _pool(out, todo, workers, tick)
    finally:
        bar.close()
    result.written = len(todo)
    result.manifest = write_manifest(out)
    entries = [e for k in range(result.shards) if (e := done_entry(out, k)) is not None]
    result.tokens, result.documents = sum(e["tokens"] for e in entries), sum(e["documents"] for e in entries)
    result.seconds = time.perf_counter() - began
    return result


def _bar(total: int, show: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="doc", file=sys.stderr, disable=not show or not total, dynamic_ncols=True,
                desc="tokenizing", mininterval=0.5)


def _pool(out: Path, todo: list[int], workers: int, tick: Callable[[int, int], None]) -> None:
    """`workers` fresh processes (spawned: the tokenizer's threads do not survive a fork),
    each writing whole shards and reporting (documents, tokens) as it goes."""
    import multiprocessing as mp
    import queue as stdqueue
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = mp.get_context("spawn")
    ticks = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // workers)  # the tokenizer's own threads, shared out
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(str(out), ticks, threads)) as pool:
        pending = {pool.submit(_worker_shard, k) for k in todo}
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()  # a worker's error (a bad record: UserError) is this call's
                while True:
                    try:
                        tick(*ticks.get_nowait())
                    except stdqueue.Empty:
                        break
        except BaseException:
            for future in pending:  # the shards not started yet are not started
                future.cancel()
            raise


_WORKER: dict[str, Any] = {}


def _worker_init(out: str, ticks: Any, threads: int) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # read when the tokenizer first runs
    request, _, index = load_plan(Path(out))
    _WORKER.update(out=Path(out), ticks=ticks, request=request, index=index,
                   tok=Tokenizer(request["tokenizer"]["path"], request["eos"]),
                   source=open_source(SourceSpec(**_spec_fields(request["source"])), index))


def _spec_fields(described: dict[str, Any]) -> dict[str, Any]:
    return {k: described[k] for k in ("path", "format", "field", "pattern", "split")}


def _worker_shard(k: int) -> dict[str, Any]:
    w = _WORKER
    _, bounds, _ = load_plan(w["out"])
    return write_shard(w["out"], k, w["source"], w["tok"], bounds, w["request"]["dtype"],
                       lambda n, t: w["ticks"].put((n, t)))


def run_task(output: str, task: int, tasks: int, workers: int = 1) -> Prepared:
    """One Slurm array task: shards task, task + tasks, ... of the saved plan; the task that
    finds every shard done writes the manifest."""
    out = Path(output)
    request, bounds, index = load_plan(out)
    tok = Tokenizer(request["tokenizer"]["path"], request["eos"])
    if tok.sha256 != request["tokenizer"]["sha256"]:
        raise UserError(f"tokenizer {tok.path} changed since the corpus was planned; prepare it again")
    source = open_source(SourceSpec(**_spec_fields(request["source"])), index)
    mine = list(range(task, len(bounds) - 1, tasks))
    result = run_shards(out, source, tok, mine, workers, progress=False)
    print(f"array task {task}/{tasks}: {result.written} shard(s) written, {result.skipped} skipped"
          + ("; manifest written" if result.manifest else ""), file=sys.stderr)
    return result


def summary(cfg: PrepareConfig | None, result: Prepared) -> dict[str, Any]:
    """The result as a plain dict (for the command's JSON output and tests)."""
    return {**asdict(result), **({"output": cfg.output} if cfg else {})}
