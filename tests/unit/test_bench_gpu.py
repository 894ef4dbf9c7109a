"""`python -m bench gpu`'s parts that need no GPU: torchtitan's arguments from the Llama's
settings, its records' summary, the page with a torchtitan row beside the minimal loop's,
and (where torchtitan and Triton import: not in CI, a throwaway venv here) torchtitan's own
trainer run on CPU by bench/titan.py at a small Llama shape, its model the same size and
FLOPs per token as bench/llama.py's. The bench itself runs on a GPU (bench/gpu_device.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import gpu, titan

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SMALL = {"dim": "64", "n_layers": "2", "n_heads": "4", "vocab_size": "512", "seq_len": "64",
         "batch_size": "2", "lr": "3e-4"}


@pytest.mark.parametrize(("sets", "ac"), [(SMALL, "none"), ({**SMALL, "ac": "full"}, "full")])
def test_torchtitan_gets_the_llamas_shape_batch_and_schedule(sets: dict[str, str], ac: str) -> None:
    argv = gpu.titan_args(sets, 30, 10)
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    assert pairs == {"--dim": "64", "--layers": "2", "--heads": "4", "--vocab": "512", "--seq": "64",
                     "--batch": "2", "--lr": "3e-4", "--steps": "30", "--warmup": "10", "--log-every": "5",
                     "--ac": ac}


def record(step: int, tps: float, mfu: float, gib: float) -> dict[str, Any]:
    return {"step": step, "throughput(tps)": tps, "mfu(%)": mfu, "memory/max_active(GiB)": gib}


def test_the_summary_takes_medians_after_the_warm_up() -> None:
    lines = [record(1, 10.0, 1.0, 9.0), record(5, 100.0, 40.0, 30.0), record(10, 200.0, 42.0, 31.0),
             record(15, 300.0, 44.0, 30.5), record(20, 210.0, 43.0, 30.0)]
    out = titan.summary(lines, 5)
    assert out == {"summary": True, "records": 3, "tokens_per_s": 210.0, "mfu": 0.43, "peak_mem_gb": 31.0}
    with pytest.raises(RuntimeError, match="no record after step 20"):
        titan.summary(lines, 20)


def test_the_page_sets_torchtitan_beside_the_minimal_loop(tmp_path: Path) -> None:
    s = object.__new__(gpu.Session)
    s.rows = [{"job": "bench/llama.py", "runner": "hpcshard", "tokens_per_s": 99.0, "mfu": 0.42,
               "peak_mem_gb": 36.8, "steps": 30, "warmup": 10},
              {"job": "bench/llama.py", "runner": "minimal FSDP2", "tokens_per_s": 100.0, "mfu": 0.43,
               "peak_mem_gb": 37.0, "steps": 30, "warmup": 10},
              {"job": "bench/llama.py", "runner": "torchtitan", "tokens_per_s": 80.0, "mfu": 0.34,
               "titan_mfu": 0.35, "peak_mem_gb": 38.0, "steps": 30, "warmup": 10}]
    out = {"torchtitan": "0.2.0", "params": 953223168, "mfu": 0.35, "stand_ins": ["datasets"]}
    s.notes = [gpu.titan_note(out)]
    s.about = {"device": "NVIDIA H200", "time": "t", "quick": True, "peak_tflops": 989.0, "memory_gb": 139.8,
               "torch": "2.11.0+cu130", "python": "3.12.3"}
    s.out = tmp_path
    s.write()
    page = (tmp_path / "gpu-bench.md").read_text()
    assert json.loads((tmp_path / "gpu-bench.json").read_text())["rows"][2]["vs_minimal"] == 0.8
    assert "| bench/llama.py | torchtitan | 80 | 34% | 38.00 | 0.800 | 30 (10) |" in page
    assert "| bench/llama.py | hpcshard | 99 | 42% | 36.80 | 0.990 | 30 (10) |" in page
    assert "torchtitan 0.2.0: its Trainer and llama3 model at the Llama's shape (0.95B parameters)" in page
    assert "its own MFU figure 35%" in page and "stand-ins for datasets" in page


def titan_imports() -> str:
    """Why torchtitan's trainer cannot be imported here ("" when it can)."""
    probe = subprocess.run([sys.executable, "-c", "import torchtitan.train"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def test_torchtitans_trainer_runs_the_llama_shape_on_cpu(tmp_path: Path) -> None:
    why = titan_imports()
    if why:
        pytest.skip(f"torchtitan's trainer does not import here ({why}): see bench/titan.py")
    argv = [sys.executable, "-m", "bench.titan", "--cpu", *gpu.titan_args(SMALL, 12, 4)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    steps = [r["step"] for r in lines if "step" in r]
    assert steps == [1, 5, 10]
    out = lines[-1]
    assert out["summary"] and out["records"] == 2 and out["tokens_per_s"] > 0 and out["device"] == "cpu"

    import torch

    from hpcshard.config import build_config
    from hpcshard.runtime.job import load_job

    job = load_job(str(ROOT / "bench" / "llama.py"))
    cfg = build_config(job.config, {k: v for k, v in SMALL.items() if k != "lr"})
    with torch.device("meta"):
        model = job.model(cfg)
    assert out["params"] == sum(p.numel() for p in model.parameters())
    assert out["flops_per_token"] == job.flops_per_token(cfg, model)
