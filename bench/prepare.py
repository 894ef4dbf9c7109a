"""`hpcshard data prepare` against the tokenizer's own batch throughput.

A synthetic JSONL corpus (English-like words, documents of 50 to 2,000 words) and a
byte-level BPE of 8,192 ids trained on a sample of it. The baseline is the tokenizer alone:
one process, the documents already in memory, `Tokenizer.encode_batch` over batches of 256
(the batch `data prepare` uses), and `encode_batch_fast` (no character offsets: what
`data prepare` calls where the library has it). Against it, `hpcshard data prepare` end to end (a fresh
process: start-up, reading and planning, tokenizing, writing and hashing the shards, the
manifest) with 1 and 2 workers. Every case runs with one tokenizer thread per process
(RAYON_NUM_THREADS=1), so "per process" is per core. Interleaved, medians of `repeats`.

The target (>= 0.8x) is against `encode_batch_fast`, the call `data prepare` makes, with the
same one thread: per CPU second and in wall time (both reported, each marked met or not).

    python -m bench.prepare [--mb 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import PY, RESULTS, Metric, env, median, run, save, show

NAME = "prepare"
TEXT = ("the of and to in is was for on that with as by at from his her it an be this which or are "
         "were had not but have one all their there been has when who more will would no out so up "
         "said what its about than into them can only other new some time could these two may first "
         "then do any like my now over such our man me even most made after also did many before must "
         "through back years where much your way well down should because each just those people how "
         "too little state good very make world still own see men work long get here between both life "
         "being under never day same another know while last might us great old year off come since "
         "against go came right used take three")
WORDS = TEXT.split()
BASELINE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
encode = getattr(tok, sys.argv[3])
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
start, cpu = time.perf_counter(), time.process_time()
tokens = 0
for i in range(0, len(texts), 256):
    tokens += sum(len(e.ids) for e in encode(texts[i:i + 256], add_special_tokens=False))
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": wall, "cpu": cpu, "tokens": tokens}))
"""


def make_corpus(folder: Path, mb: float) -> tuple[Path, Path]:
    """The JSONL corpus (about `mb` MB) and its tokenizer."""
    from examples.finetune.make_base import byte_bpe

    rng = random.Random(0)
    path, size = folder / "corpus.jsonl", 0
    sample: list[str] = []
    with path.open("w") as f:
        while size < mb * 1e6:
            words = rng.choices(WORDS, k=rng.randint(50, 2000))
            text = " ".join(w.capitalize() if rng.random() < 0.05 else w for w in words) + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
            if len(sample) < 200:
                sample.append(text)
    byte_bpe(sample, 8192, ["<unk>", "<|endoftext|>"], unk="<unk>").save(str(folder / "tokenizer.json"))
    return path, folder / "tokenizer.json"


def prepare_once(corpus: Path, tok: Path, out: Path, workers: int) -> tuple[float, float, float]:
    """(end-to-end wall seconds, the command's own tokenize-and-write seconds, the CPU
    seconds of the command and its workers)."""
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = run([PY, "-m", "hpcshard", "data", "prepare", str(corpus), "--tokenizer", str(tok), "-o", str(out),
                "--workers", str(workers), "--shard-tokens", "100000", "--no-progress"],
               env=env(RAYON_NUM_THREADS="1"))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers too: each process waits for its own
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, float(proc.stdout.rsplit(" in ", 1)[1].split()[0]), cpu


def main(mb: float = 8, repeats: int = 5) -> list[Metric]:
    folder = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        corpus, tok = make_corpus(folder, mb)
        base: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": []}
        base_cpu: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": []}
        cases: dict[int, list[tuple[float, float, float]]] = {1: [], 2: []}
        tokens = 0
        for _ in range(repeats):  # interleaved: the shared host's load hits every case alike
            for call, seconds in base.items():
                proc = run([PY, "-c", BASELINE, str(tok), str(corpus), call], env=env(RAYON_NUM_THREADS="1"))
                one = json.loads(proc.stdout)
                seconds.append(one["seconds"])
                base_cpu[call].append(one["cpu"])
                tokens = one["tokens"]
            for workers in cases:
                cases[workers].append(prepare_once(corpus, tok, folder / "out", workers))
        manifest = json.loads((folder / "out" / "manifest.json").read_text())
        assert manifest["tokens"] == tokens + manifest["documents"], "prepare's tokens are not encode_batch's"
        rate = {call: tokens / median(seconds) for call, seconds in base.items()}
        for workers, times in cases.items():
            rate[f"prepare w{workers}"] = tokens / median([t[0] for t in times])
            rate[f"prepare w{workers} (tokenize+write)"] = tokens / median([t[1] for t in times])
        # per CPU second: what one process gets done per core, whatever else the host runs
        cpu_rate = {f"{call} per CPU s": tokens / median(v) for call, v in base_cpu.items()}
        for workers, times in cases.items():
            cpu_rate[f"prepare w{workers} per CPU s"] = tokens / median([t[2] for t in times])
        per_process = cpu_rate["prepare w1 per CPU s"] / cpu_rate["encode_batch per CPU s"]
        fast = cpu_rate["prepare w1 per CPU s"] / cpu_rate["encode_batch_fast per CPU s"]
        fast_wall = rate["prepare w1"] / rate["encode_batch_fast"]
        wall_ratio = rate["prepare w1"] / rate["encode_batch"]
        scaling = rate["prepare w2"] / rate["prepare w1"]
        metrics = [Metric(NAME, f"{k} (median of {repeats})", v / 1e6, "Mtok/s")
                   for k, v in {**rate, **cpu_rate}.items()]
        metrics += [Metric(NAME, "prepare w1 / encode_batch_fast, per CPU second (end to end)", fast, "x",
                           ">= 0.8x", fast >= 0.8),
                    Metric(NAME, "prepare w1 / encode_batch_fast, wall (end to end)", fast_wall, "x",
                           ">= 0.8x", fast_wall >= 0.8),
                    Metric(NAME, "prepare w1 / encode_batch, per CPU second (end to end)", per_process, "x"),
                    Metric(NAME, "prepare w1 / encode_batch, wall (end to end)", wall_ratio, "x"),
                    Metric(NAME, "prepare w2 / prepare w1, wall", scaling, "x",
                           note=f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"),
                    Metric(NAME, "prepare w2 / prepare w1, per CPU second (the second process's cost)",
                           cpu_rate["prepare w2 per CPU s"] / cpu_rate["prepare w1 per CPU s"], "x")]
        details = {"mb": mb, "tokens": tokens, "documents": manifest["documents"],
                   "shards": len(manifest["shards"]), **{f"{k}_s": v for k, v in base.items()},
                   **{f"{k}_cpu_s": v for k, v in base_cpu.items()},
                   **{f"prepare_w{w}_s": t for w, t in cases.items()}}
        save(NAME, metrics, details)
        write_table(metrics, details, mb, repeats)
        return metrics
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _sharing() -> str:
    """Whether this host's scheduler lets a second process add CPU at all."""
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        autogroup = False
    if not autogroup:
        return "wall time with 1 and 2 workers, as measured."
    return ("this host runs the kernel's autogroup scheduling and is shared with other sessions: "
            "the processes of one session share that session's fair share of the cores, so a second "
            "worker adds CPU only while the others leave some idle, and the wall-time ratio follows "
            "their load as much as the workers. On a host of its own, wall time with N workers is "
            "the per-CPU-second rate with N workers times N cores; the per-CPU-second ratio of 2 to 1 "
            "workers is the part "
            "of that scaling that the second process itself costs (its start-up, its own reading).")


def write_table(metrics: list[Metric], details: dict[str, object], mb: float, repeats: int) -> None:
    load = os.getloadavg()[0]
    lines = ["# `data prepare` against the tokenizer's own `encode_batch_fast`", "",
             f"`python -m bench.prepare --mb {mb:g} --repeats {repeats}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores (shared; load {load:.1f} at the "
             f"end), Python {platform.python_version()}, one tokenizer thread per process.", "",
             f"{details['tokens']:,} tokens in {details['documents']:,} documents ({mb:g} MB of JSONL), "
             f"{details['shards']} shards. End to end: a fresh `hpcshard data prepare` process (start-up, "
             "reading and planning, tokenizing, writing and hashing, the manifest); tokenize+write: the "
             "command's own time for its shards (the seconds it prints). Per CPU second: tokens over the "
             "CPU seconds used (the baselines' encode loop; the whole `data prepare` command with its "
             "workers): a per-core rate that the other load on this shared host disturbs far less than "
             "wall time, so the target is taken on it.", "",
             f"Scaling with processes: {_sharing()}", "",
             "| case | value | target | met |", "|---|---|---|---|"]
    for m in metrics:
        met = {True: "yes", False: "**no**", None: ""}[m.ok]
        note = f" ({m.note})" if m.note else ""
        lines.append(f"| {m.name}{note} | {m.value:.3g} {m.unit} | {m.target} | {met} |")
    seconds = {k: v for k, v in details.items() if k.endswith("_s")}
    lines += ["", "Seconds of each repeat (baselines: wall of the encode loop, its CPU in `_cpu_s`; prepare: "
              "end-to-end wall, its printed tokenize+write wall, CPU of the command and its workers): "
              + json.dumps(seconds)]
    (RESULTS / "prepare.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    show(main(ns.mb, ns.repeats))
