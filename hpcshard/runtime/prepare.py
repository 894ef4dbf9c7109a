"""`hpcshard data prepare`: a corpus tokenized into shards of tokens, in parallel over
processes or Slurm array tasks, resumable, with a manifest written last.

The output directory (the format `hpcshard-tokens` version 1; the reader relies on it):

    manifest.json        written last, atomically: only a finished corpus has one
    shard-NNNNN.bin      the tokens, little-endian uint16 (every id below 65536) or uint32;
                         each document followed by the tokenizer's EOS (counted in it)
    shard-NNNNN.idx      little-endian int64: documents + 1 offsets into the shard
    .prepare/            the work's state: the request, the plan, one done file per shard

Shards are planned before anything is tokenized: documents in their order, cut where the
bytes read reach --shard-tokens (at the tokens per byte that a sample of the first
documents gives). A shard's documents depend on the source, the tokenizer and the target
only, so 1 worker, 8 workers or 16 array tasks write the same bytes. A shard is written
under a temporary name of its writer's alone (`rundir.files.written`), renamed when complete,
then its done file (its manifest entry, with the checksum) is written: a rerun skips the
shards that have one.

The manifest's `vocab_size` is the bound of the ids (the tokenizer's largest id + 1, not
its count of entries: ids can have gaps), and the dtype follows it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcshard.errors import UserError
from hpcshard.rundir.files import locked, side_name, try_flock, written
from hpcshard.runtime import sidefiles
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
    """uint16 while every id fits (`vocab_size`, the bound of the ids, <= 65536), else uint32."""
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
    texts = source.read(0, sample)
    kept = _cut(texts, SAMPLE_BYTES)
    encoded = tok.encode(kept)
    tokens = sum(len(ids) for ids in encoded)
    special = {tok.eos_id, tok.unk_id()} - {None}
    if not any(t not in special for ids in encoded for t in ids):
        raise UserError(f"tokenizer {tok.path} gives no token but EOS or UNK for the first {sample} "
                        f"document(s) of {source.spec.path}: it does not fit this text; give the tokenizer "
                        "it was meant for")
    tokens += sample if tok.eos_id is not None else 0
    ends = np.cumsum(sizes + 1)  # +1: a byte for each document's EOS, and no empty document is free
    # the sample's bytes, in the sizes' own (a JSONL line's), less the part of a document cut off
    sampled = float(ends[sample - 1]) - sum(float(sizes[i]) * (1 - len(k) / len(t))
                                            for i, (t, k) in enumerate(zip(texts, kept, strict=True))
                                            if len(k) < len(t))
    per_token = sampled / max(1, tokens)  # in the sizes' own bytes (a JSONL line's)
    target = max(1.0, shard_tokens * per_token)
    cuts = np.searchsorted(ends, np.arange(1, int(ends[-1] // target) + 1) * target, side="left") + 1
    return np.unique(np.concatenate([[0], np.minimum(cuts, n), [n]])).astype(np.int64)


def _cut(texts: list[str], limit: int) -> list[str]:
    """The texts up to `limit` characters in all (a whole-file document is not tokenized whole)."""
    out, left = [], limit
    for text in texts:
        out.append(text[:left])
        left -= len(out[-1])
    return out


def _state(out: Path) -> Path:
    return out / STATE


def start(cfg: PrepareConfig) -> tuple[Source, Tokenizer, dict[str, Any], np.ndarray]:
    """Everything checked before anything is written: the source read and planned, the
    tokenizer loaded, the output directory new, empty, or this same request's."""
    out = Path(cfg.output)
    check_writable(out)  # before the source is read: an output that cannot be written is known now
    tok = Tokenizer(cfg.tokenizer, cfg.eos)
    source = open_source(cfg.source)
    request = request_of(cfg, source, tok)
    check_output(out, request)
    if (_state(out) / "plan.npz").is_file() and (_state(out) / "request.json").is_file():
        # a resume: the plan its done shards were cut by
        return source, tok, request, load_plan(out)[1]
    return source, tok, request, plan(source, tok, cfg.shard_tokens)


def check_writable(out: Path) -> None:
    """--output can be made and written: no file in its path, its nearest existing folder
    writable (a probe file), and a folder of its own when it exists."""
    near = out
    while not near.exists() and near != near.parent:
        near = near.parent
    if near.exists() and not near.is_dir():
        raise UserError(f"--output {out}: {near} is a file; give a new or empty directory")
    if near == out and out.exists() and not _empty(out) and not (_state(out) / "request.json").is_file():
        raise UserError(f"--output {out} is not empty and holds no prepared corpus; give a new or "
                        "empty directory")
    probe = side_name(near / "hpcshard-probe")  # two runs' probes never one file
    try:
        probe.touch()
        # A run that holds the output sweeps this host's unheld side files (`remove_stale`):
        # it may take this probe between touch and unlink, and the write was still made.
        probe.unlink(missing_ok=True)
    except OSError as err:
        raise UserError(f"--output {out} cannot be written ({near}: {err.strerror or err}); give a directory "
                        "you can write") from None


def _empty(out: Path) -> bool:
    """Nothing in it, or only a work folder without a request (a run stopped before it wrote one)."""
    entries = list(out.iterdir())
    return not entries or ([e.name for e in entries] == [STATE]
                           and not (_state(out) / "request.json").exists())


def check_output(out: Path, request: dict[str, Any]) -> None:
    """A new or empty output directory, or one this request was started in (resume)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a new or empty directory")
    if not out.exists() or _empty(out):
        return
    saved = _state(out) / "request.json"
    if not saved.is_file():
        raise UserError(f"--output {out} is not empty and holds no prepared corpus; give a new or "
                        "empty directory")
    old = json.loads(saved.read_text(encoding="utf-8"))
    differ = sorted(k for k in {*old, *request} if old.get(k) != request.get(k))
    if _older_bound(old, request, differ):
        raise UserError(f"--output {out} was started by an older hpcshard, which took the tokenizer's count "
                        f"of entries ({old['vocab_size']}) for the bound of its ids, not its largest id + 1 "
                        f"({request['vocab_size']}); prepare into a new directory")
    if differ:
        raise UserError(f"--output {out} was prepared with other arguments (they differ in: "
                        f"{', '.join(differ)}); give the same ones to resume, or a new directory")


def _older_bound(old: dict[str, Any], request: dict[str, Any], differ: list[str]) -> bool:
    """Do the saved request and this one differ only in the bound of the ids (and the dtype
    it gives), the saved one lower? With the same tokenizer, that bound is an older
    hpcshard's (the count of entries, where ids have gaps): not the user's arguments."""
    then, now = old.get("vocab_size"), request.get("vocab_size")
    return ("vocab_size" in differ and set(differ) <= {"vocab_size", "dtype"}
            and isinstance(then, int) and isinstance(now, int) and then < now)


def save_plan(out: Path, request: dict[str, Any], bounds: np.ndarray, source: Source) -> None:
    """The request, then the plan (a request without a plan is planned again), where every
    worker and array task reads them."""
    state = _state(out)
    make_state(out)
    _write_json(state / "request.json", request)
    arrays = {"bounds": bounds, **{f"index_{k}": v for k, v in source.index().items()}}
    with written(state / "plan.npz", held=True) as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub: file, *args


def make_state(out: Path) -> bool:
    """The output directory and its work folder; one line when they cannot be made. True
    when this call made the output directory (mkdir's exclusive create: of two runs into
    one new output, exactly one)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            out.mkdir()
            made = True
        except FileExistsError:
            made = False
        _state(out).mkdir(exist_ok=True)
        return made
    except OSError as err:
        raise UserError(f"--output {out} cannot be made ({err.strerror or err}); give a directory you can "
                        "write") from None


def load_plan(out: Path) -> tuple[dict[str, Any], np.ndarray, dict[str, np.ndarray]]:
    state = _state(out)
    request = json.loads((state / "request.json").read_text(encoding="utf-8"))
    with np.load(state / "plan.npz") as saved:
        index = {k.removeprefix("index_"): saved[k] for k in saved.files if k.startswith("index_")}
        return request, saved["bounds"], index


def _write_json(path: Path, value: Any) -> None:
    """Atomically and durably: a temporary name of this writer's, on disk, then renamed."""
    with written(path, held=True) as f:
        f.write((json.dumps(value, indent=1) + "\n").encode())


# -- shards ------------------------------------------------------------------------------------


def done_entry(out: Path, k: int, bounds: np.ndarray | None = None) -> dict[str, Any] | None:
    """Shard k's manifest entry when it is complete: its done file, a .bin of its tokens'
    size, a .idx of its documents + 1 offsets (and as many documents as the plan's)."""
    try:
        entry = json.loads((_state(out) / f"{shard_name(k)}.done").read_text(encoding="utf-8"))
        request = json.loads((_state(out) / "request.json").read_text(encoding="utf-8"))
        size = (out / f"{shard_name(k)}.bin").stat().st_size
        idx = (out / f"{shard_name(k)}.idx").stat().st_size
    except (OSError, ValueError):
        return None
    if bounds is not None and entry["documents"] != int(bounds[k + 1] - bounds[k]):
        return None
    if idx != (entry["documents"] + 1) * 8:
        return None
    return entry if size == entry["tokens"] * np.dtype(request["dtype"]).itemsize else None


def write_shard(out: Path, k: int, source: Source, tok: Tokenizer, bounds: np.ndarray, dtype: str,
                tick: Callable[[int, int], None], planned: int | None = None) -> dict[str, Any]:
    """Tokenize shard k's documents, write its .bin (streamed, hashed as it goes) and .idx
    (temporary names, renamed when complete), then its done file; its manifest entry.
    `planned`: the plan's bound of the ids, the manifest's vocab_size (`_narrow`)."""
    start, stop = int(bounds[k]), int(bounds[k + 1])
    lengths: list[int] = []
    name = shard_name(k)
    digest, tokens = hashlib.sha256(), 0
    with written(out / f"{name}.bin", held=True) as f:  # renamed after the .idx, when both are complete
        for lo in range(start, stop, BATCH_DOCS):
            hi = min(stop, lo + BATCH_DOCS)
            ids = tok.encode(source.read(lo, hi))
            if tok.eos_id is not None:
                for one in ids:
                    one.append(tok.eos_id)
            counts = [len(one) for one in ids]
            chunk = _narrow(np.concatenate([np.array(one, dtype=np.int64) for one in ids]), dtype,
                            tok, planned).tobytes()
            digest.update(chunk)
            f.write(chunk)
            lengths.extend(counts)
            tokens += sum(counts)
            tick(hi - lo, sum(counts))
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype("<i8")
        with written(out / f"{name}.idx", held=True) as g:
            g.write(offsets.tobytes())
    entry = {"name": name, "tokens": tokens, "documents": stop - start, "sha256": digest.hexdigest()}
    _write_json(_state(out) / f"{name}.done", entry)
    return entry


def _narrow(ids: np.ndarray, dtype: str, tok: Tokenizer, planned: int | None = None) -> np.ndarray:
    """The ids in the shard's dtype. An id outside the tokenizer's vocabulary (below 0, or at
    or beyond the bound the manifest's vocab_size says and a model is sized from) is one line.
    The bound is the plan's (`planned`) where it is lower: array tasks queued across the
    upgrade run a plan of an older hpcshard, which took the count of entries for it (300,
    where an id is 60,000), and the manifest will give the plan's."""
    if ids.size and planned is not None and planned < tok.vocab_size and ids.max() >= planned:
        raise UserError(f"tokenizer {tok.path} gave id {int(ids.max())}, beyond {planned - 1}, the largest "
                        "the plan of this corpus allows (an older hpcshard's: the tokenizer's count of "
                        f"entries, not its largest id + 1, {tok.vocab_size}); prepare it again into a new "
                        "directory")
    if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise UserError(f"tokenizer {tok.path} gave id {bad}, outside its vocabulary's ids 0 to "
                        f"{tok.vocab_size - 1}; give a tokenizer whose ids are all in its vocabulary")
    return ids.astype(np.dtype(dtype).newbyteorder("<"))


def write_manifest(out: Path) -> bool:
    """The manifest, once every shard is done (by whichever process finds them all done:
    the same text from any of them); False while one is missing."""
    request, bounds, _ = load_plan(out)
    entries = [done_entry(out, k, bounds) for k in range(len(bounds) - 1)]
    if any(e is None for e in entries):
        return False
    shards = [e for e in entries if e is not None]
    for e in shards:  # what the manifest vouches for: each shard's bytes, checked once more
        if _sha256(out / f"{e['name']}.bin") != e["sha256"]:
            raise UserError(f"{out / e['name']}.bin does not match its checksum (changed since it was "
                            "written); "
                            f"delete {out / STATE / e['name']}.done and run the same command again")
    manifest = {"format": FORMAT, "version": VERSION, "dtype": request["dtype"],
                "vocab_size": request["vocab_size"], "eos_id": request["eos_id"],
                "tokenizer": request["tokenizer"], "source": request["source"],
                "tokens": sum(e["tokens"] for e in shards), "documents": sum(e["documents"] for e in shards),
                "shards": shards}
    _write_json(out / "manifest.json", manifest)
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


# -- running ---------------------------------------------------------------------------------


def prepare(cfg: PrepareConfig) -> Prepared:
    """Check, plan, and write every shard not done yet (over `workers` processes), then the
    manifest. Bad input raises UserError before the output directory is made; a bad record
    found while tokenizing leaves nothing of a directory this call made."""
    source, tok, request, bounds = start(cfg)
    out = Path(cfg.output)
    made = make_state(out)
    # A refusal (another run holds the output, or started it with other arguments) removes
    # nothing: what is there is the other run's, even in a directory this call made (two runs
    # into one new output: the one that made it may lose the lock to the other).
    lock = take_lock(out)
    try:
        bounds = check_again(out, request, bounds)
        try:
            save_plan(out, request, bounds, source)
            remove_stale(out)
            return run_shards(out, source, tok, list(range(len(bounds) - 1)), cfg.workers, cfg.progress)
        except ValueError:  # a bad record: nothing kept of what this call made (under its lock)
            if made and not (out / "manifest.json").exists():
                shutil.rmtree(out, ignore_errors=True)
            raise
    finally:
        lock.close()


def check_again(out: Path, request: dict[str, Any], bounds: np.ndarray) -> np.ndarray:
    """Under the lock, the output checked once more and the plan to write by: another run
    may have started it with other arguments while this one planned (refused: its shards
    would be skipped as done under this request's manifest), or with the same ones (its
    saved plan, which its done shards were cut by)."""
    check_output(out, request)
    if (_state(out) / "plan.npz").is_file() and (_state(out) / "request.json").is_file():
        return load_plan(out)[1]
    return bounds


OUT_FILES = r"shard-\d+\.(?:bin|idx)|manifest\.json|clock|hpcshard-probe"
"""The names in the output directory that are written under side names (`rundir.files.written`,
and the probes of `sidefiles.stamp_now` and `check_writable`)."""
STATE_FILES = r"shard-\d+\.done|request\.json|plan\.npz|clock"
"""The same in its work folder."""


def take_lock(out: Path) -> Any:
    """This run's exclusive hold on `out` (flock on .prepare/lock, released when the file
    closes or the process ends; where flock fails, a lock file: see `_lock_file`); one line
    when another run holds it. Closing the result releases it."""
    f = (_state(out) / "lock").open("a+", encoding="utf-8")
    got = try_flock(f.fileno())
    if got is False:  # held by another run, and only that
        f.seek(0)
        holder = (f.read().strip().splitlines() or ["unknown"])[-1]
        f.close()
        raise UserError(f"another `data prepare` ({holder}) is writing {out}; wait for it")
    if got is not True:
        f.close()
        return _lock_file(out, got)
    f.seek(0)
    f.truncate()
    f.write(f"{socket.gethostname()}, pid {os.getpid()}\n")
    f.flush()
    return f


def _lock_file(out: Path, err: OSError) -> contextlib.ExitStack:
    """The hold where flock fails (`try_flock`): .prepare/run.lock made by link() with the holder's
    host and pid (`rundir.files.locked`, which holds on NFS), removed when released. A
    holder of this host that is gone is broken at once; one of another host is not (a
    crashed host's lock stays until it is removed by hand: the line says which file)."""
    print(f"warning: {out} is on a file system without flock, or its flock fails ({err.strerror or err}); "
          "a lock file keeps a second `data prepare` out instead", file=sys.stderr)
    hold = contextlib.ExitStack()
    try:
        hold.enter_context(locked(_state(out) / "run", timeout=0))
    except TimeoutError as held:
        raise UserError(f"another `data prepare` is writing {out} ({held}); wait for it, or remove "
                        f"{_state(out) / 'run.lock'} if that run is gone") from None
    return hold


def remove_stale(out: Path) -> list[Path]:
    """Interrupted runs' unfinished files (`sidefiles.remove_stale`: one nobody holds is
    removed at once where it is this host's, any other once untouched for an hour; an array
    task may still be writing one), and those of hpcshard before side names
    (NAME.tmp-HOST-PID: by their age only); the paths removed."""
    found: list[tuple[Path, str | None]] = [*sidefiles.side_files(out, OUT_FILES),
                                            *sidefiles.side_files(_state(out), STATE_FILES)]
    before = [*out.glob("shard-*.tmp-*"), *out.glob("manifest.json.tmp-*"), *_state(out).glob("*.tmp-*")]
    found += [(old, None) for old in before]
    return sidefiles.remove_stale(found)


def run_shards(out: Path, source: Source, tok: Tokenizer, shards: list[int], workers: int,
               progress: bool) -> Prepared:
    """Shards `shards` of the saved plan (those not done yet), then the manifest if all are."""
    began = time.perf_counter()
    request, bounds, _ = load_plan(out)
    todo = [k for k in shards if done_entry(out, k, bounds) is None]
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
                write_shard(out, k, source, tok, bounds, request["dtype"], tick, request["vocab_size"])
        else:
            _pool(out, todo, workers, tick)
    finally:
        bar.close()
    result.written = len(todo)
    result.manifest = write_manifest(out)
    entries = [e for k in range(result.shards) if (e := done_entry(out, k, bounds)) is not None]
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
    threads = max(1, cpus() // workers)  # the tokenizer's own threads, shared out
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(str(out), ticks, threads, os.getpid()))
    previous = _on_term(signal.SIGTERM)
    try:
        pending = {pool.submit(_worker_shard, k) for k in todo}
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in finished:
                future.result()  # a worker's error (a bad record: UserError) is this call's
            while True:
                try:
                    tick(*ticks.get_nowait())
                except stdqueue.Empty:
                    break
    except BaseException:  # an error, Ctrl-C, SIGTERM: nothing more started, the workers stopped
        workers_now = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers_now:
            proc.terminate()
        for proc in workers_now:
            proc.join(5)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def cpus() -> int:
    """The cores this process may run on (a Slurm task's or a container's, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _on_term(sig: signal.Signals) -> Any:
    """SIGTERM raises KeyboardInterrupt here (the pool is shut down as for Ctrl-C); the old handler."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(sig, stop)


_WORKER: dict[str, Any] = {}


def _worker_init(out: str, ticks: Any, threads: int, parent: int = 0) -> None:
    _follow_parent(parent)
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # read when the tokenizer first runs
    request, _, index = load_plan(Path(out))
    _WORKER.update(out=Path(out), ticks=ticks, request=request, index=index, tok=_tokenizer(request),
                   source=_source(request, index))


def _follow_parent(parent: int) -> None:
    """This worker ends when the process that started it does (Linux: PR_SET_PDEATHSIG)."""
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the call above
        os._exit(1)


def _tokenizer(request: dict[str, Any]) -> Tokenizer:
    """The planned tokenizer, refused if its files changed since."""
    tok = Tokenizer(request["tokenizer"]["path"], request["eos"])
    if tok.sha256 != request["tokenizer"]["sha256"]:
        raise UserError(f"tokenizer {tok.path} changed since the corpus was planned; prepare it again")
    return tok


def _source(request: dict[str, Any], index: dict[str, np.ndarray]) -> Source:
    """The planned source (exactly its files), refused if it changed since."""
    source = open_source(SourceSpec(**_spec_fields(request["source"])), index)
    if source.fingerprint() != request["source_fingerprint"]:
        raise UserError(f"source {source.spec.path} changed since the corpus was planned (a file added, "
                        "changed or removed); prepare it again into a new directory")
    return source


def _spec_fields(described: dict[str, Any]) -> dict[str, Any]:
    return {k: described[k] for k in ("path", "format", "field", "pattern", "split")}


def _worker_shard(k: int) -> dict[str, Any]:
    w = _WORKER
    _, bounds, _ = load_plan(w["out"])
    return write_shard(w["out"], k, w["source"], w["tok"], bounds, w["request"]["dtype"],
                       lambda n, t: w["ticks"].put((n, t)), w["request"]["vocab_size"])


def run_task(output: str, task: int, tasks: int, workers: int = 1) -> Prepared:
    """One Slurm array task: shards task, task + tasks, ... of the saved plan; the task that
    finds every shard done writes the manifest."""
    out = Path(output)
    request, bounds, index = load_plan(out)
    tok, source = _tokenizer(request), _source(request, index)
    mine = list(range(task, len(bounds) - 1, tasks))
    result = run_shards(out, source, tok, mine, workers, progress=False)
    print(f"array task {task}/{tasks}: {result.written} shard(s) written, {result.skipped} skipped"
          + ("; manifest written" if result.manifest else ""), file=sys.stderr)
    return result


def summary(cfg: PrepareConfig | None, result: Prepared) -> dict[str, Any]:
    """The result as a plain dict (for the command's JSON output and tests)."""
    return {**asdict(result), **({"output": cfg.output} if cfg else {})}
