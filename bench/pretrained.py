"""Pretrained weights in and out, side by side with transformers' own (CPU, one machine):

- load: a 0.1B-parameter Llama (bf16 safetensors, 4 files) into 2x2 HSDP with init_from,
  each rank reading its slices, against `from_pretrained` of the same directory in one
  process: time, and peak memory per rank against its shard (target: <= 1.5 x the shard
  plus one read buffer, the largest tensor's slice);
- export: `ckpt export --hf --dtype bf16` of a checkpoint of that run (one process, read
  and written a few tensors at a time) against `save_pretrained` with the same file size:
  time, and peak memory against one output file (target: <= 2x). Two file sizes: 120MB,
  where the largest tensor (the 49 MB bf16 embedding) is 0.4 of a file as Llama-3-70B's
  2.1 GB embedding is of its 5 GB files, and 50MB, about the embedding itself. The export's
  peak follows the largest tensor (in the output dtype, plus DCP's read of one stored
  shard of it), not the file size; a row shows that ratio too.

Each measurement runs in its own process (`bench.hf_worker`), 3 interleaved rounds, medians."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench.common import PY, Metric, hpcshard, median, run, save

NAME = "pretrained"
SIZES = {"120MB": 120 * 10**6, "50MB": 50 * 10**6}
"""Output file sizes: the first is the realistic one, the target's."""


def make_base(root: Path) -> tuple[Path, int]:
    """The model, saved as a downloaded one would be; returns its directory and one read
    buffer: a rank's slice of the largest tensor (the embedding, split over the 2 ranks of
    a node) as stored, in bf16."""
    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        "c = LlamaConfig(vocab_size=32000, hidden_size=768, num_hidden_layers=8, num_attention_heads=12,"
        " num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=256,"
        " tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)\n"
        "LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(sys.argv[1], max_shard_size='60MB')\n")
    base = root / "base"
    run([PY, "-c", code, str(base)])
    return base, 32000 * 768 * 2 // 2


LARGEST = 32000 * 768
"""Elements of the largest tensor (the embedding; the head is as large)."""


def measure(kind: str, *args: str, ranks: int = 1) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    head = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    head = head if ranks > 1 else [PY]
    run([*head, "-m", "bench.hf_worker", kind, *args, str(out)])
    facts = json.loads(out.read_text())
    out.unlink()
    return dict(facts)


def main(rounds: int = 3) -> list[Metric]:
    ours: list[dict] = []
    theirs: list[dict] = []
    exports: dict[str, list[dict]] = {size: [] for size in SIZES}
    saves: dict[str, list[dict]] = {size: [] for size in SIZES}
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-") as tmp:
        root = Path(tmp)
        base, buffer = make_base(root)
        model_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
        train = root / "run"  # one step from init_from: a checkpoint to export
        hpcshard("submit", "--backend", "local", "--nodes", "2", "--gpus", "2", "jobs/hf_causal_lm.py",
                 "--run-dir", str(train), "--set", f"init_from={base}", "--set", "steps=1",
                 "--set", "seq_len=64", "--set", "batch_size=4", "--set", "eval_every=0",
                 "--set", "warmup_steps=1")
        for i in range(rounds):
            order = ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")
            for who in order:
                if who == "ours":
                    ours.append(measure("load-sharded", str(base), ranks=4))
                else:
                    theirs.append(measure("load-hf", str(base)))
                for size in SIZES:
                    out = root / f"{who}-{i}-{size}"
                    if who == "ours":
                        exports[size].append(measure("export", str(train), str(out), size))
                    else:
                        saves[size].append(measure("save-hf", str(base), str(out), size))
                    shutil.rmtree(out)
            size = next(iter(SIZES))
            print(f"  round {i + 1}: load {median(ours[-1]['seconds']):.1f} s per rank vs "
                  f"{theirs[-1]['seconds']:.1f} s, export {exports[size][-1]['seconds']:.1f} s vs "
                  f"{saves[size][-1]['seconds']:.1f} s", flush=True)
    shard = median([s for r in ours for s in r["shard"]])
    peak = median([p for r in ours for p in r["peak_rise"]])
    load_s = median([max(r["seconds"]) for r in ours])  # the slowest rank: when training can start
    hf_s, hf_peak = median([r["seconds"] for r in theirs]), median([r["peak_rise"] for r in theirs])
    over = (peak - buffer) / shard
    metrics = [
        Metric(NAME, f"sharded load, 2x2 (slowest rank), {model_bytes / 1e6:.0f} MB bf16", load_s, "s"),
        Metric(NAME, "from_pretrained, one process, fp32", hf_s, "s"),
        Metric(NAME, "sharded load peak per rank / its fp32 shard", peak / shard, "x"),
        Metric(NAME, "(peak - one read buffer) / shard", over, "x", "<= 1.5", over <= 1.5),
        Metric(NAME, "from_pretrained peak / one rank's shard", hf_peak / shard, "x"),
    ]
    # the largest tensor in bf16, and one stored shard of it in fp32 (split over a node's 2 ranks)
    floor = LARGEST * 2 + LARGEST * 4 // 2
    for n, (size, limit) in enumerate(SIZES.items()):
        exp_s, exp_peak = (median([r[k] for r in exports[size]]) for k in ("seconds", "peak_rise"))
        save_s, save_peak = (median([r[k] for r in saves[size]]) for k in ("seconds", "peak_rise"))
        target = ("<= 2", exp_peak <= 2 * limit) if n == 0 else ("", None)
        metrics += [
            Metric(NAME, f"ckpt export --hf, {size} files, bf16", exp_s, "s"),
            Metric(NAME, f"save_pretrained, {size} files (model already held)", save_s, "s"),
            Metric(NAME, f"export peak / one {size} output file", exp_peak / limit, "x", *target),
            Metric(NAME, f"export peak ({size} files) / largest tensor bf16 + one fp32 stored shard of it",
                   exp_peak / floor, "x"),
            Metric(NAME, f"save_pretrained peak above the held model / one {size} file", save_peak / limit,
                   "x"),
        ]
    save(NAME, metrics, {"ours": ours, "from_pretrained": theirs, "export": exports,
                         "save_pretrained": saves, "model_bytes": model_bytes, "read_buffer": buffer,
                         "file_sizes": SIZES, "largest_tensor_elements": LARGEST})
    return metrics


if __name__ == "__main__":
    from bench.common import show

    show(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
