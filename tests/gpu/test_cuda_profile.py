"""One demo run on the GPU read for several facts (its profile, MFU, step split, state
bytes), a profile asked of a live run with `hpcshard profile`, and the snapshot a rank
writes when CUDA runs out of memory."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcshard.runtime.planner import make_plan
from tests.conftest import ROOT, hpcshard, metrics, quiet_env, step_records, wait_for
from tests.gpu.runs import attempt, rank_log, submit

STEPS, PROFILE_EVERY, PROFILE_STEPS = 40, 20, 2
DEMO = ("precision=bf16", "eval_every=0", "ckpt_every=1000", "log_every=5")
SHARED = pytest.mark.xdist_group("gpu-profiled-run")  # one worker: the run is made once


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo in bf16 for 40 steps, steps 21 and 22 profiled with a memory snapshot."""
    run = tmp_path_factory.mktemp("profiled") / "run"
    submit(run, f"steps={STEPS}", *DEMO, f"profile_every={PROFILE_EVERY}",
           f"profile_steps={PROFILE_STEPS}", "profile_memory=true")
    return run


def events(run: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in metrics(run) if r.get("event") == name]


def in_run(run: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else run / p


def kernels(trace: Path) -> list[dict[str, Any]]:
    """The trace's GPU kernels and CUDA runtime calls (what a CPU-only profile lacks)."""
    data = json.loads(trace.read_text())
    return [e for e in data["traceEvents"]
            if str(e.get("cat", "")).lower() in ("kernel", "cuda_runtime")]


def snapshot(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        data = pickle.load(f)
    assert isinstance(data, dict) and "segments" in data and "device_traces" in data, type(data)
    assert data["segments"], f"{path}: a snapshot without a segment"
    return data


@SHARED
@pytest.mark.timeout(300)
def test_a_scheduled_profile_traces_cuda_kernels_and_snapshots_memory(profiled: Path) -> None:
    assert step_records(profiled)[-1]["step"] == STEPS
    first = PROFILE_EVERY + 1
    done = [e for e in events(profiled, "profile") if e["step"] == first]
    assert [(e["steps"], e["rank"]) for e in done] == [(PROFILE_STEPS, 0)], events(profiled, "profile")
    trace = in_run(profiled, done[0]["trace"])
    folder = profiled / "profiles" / f"step-{first:08d}"
    assert trace.resolve() == (folder / "rank-0.pt.trace.json").resolve(), trace
    assert kernels(trace), f"{trace}: no event of category kernel or cuda_runtime"
    memory = in_run(profiled, done[0]["memory"])
    assert memory.resolve() == (folder / "rank-0.memory.pickle").resolve(), done[0]["memory"]
    snapshot(memory)


PEAK = {"H100": 989e12, "H200": 989e12}
"""Dense bf16 FLOP/s, from the data sheets (runtime/device.py's table, written again)."""


def demo_flops_per_token() -> float:
    """By hand, the demo's defaults: dim d=128, 4 blocks, vocabulary V=256, seq T=128.
    Matmul parameters, 6 FLOPs each per token (forward 2, backward 4):
      per block: 2 LayerNorms 2*2d                        512
                 q, k, v, proj 4*(d*d + d)             66,048
                 fc d*4d + 4d, out 4d*d + d           131,712
                 = 198,272, times 4 blocks            793,088
      final LayerNorm 2d                                  256
      head d*V (no bias)                               32,768
      (the token embedding V*d and the position embedding T*d are lookups: no FLOPs)
      N = 826,112 -> 6N = 4,956,672
    Attention scores and their weighting, 12 * layers * d * T (PaLM, appendix B):
      12 * 4 * 128 * 128 = 786,432
    In all 5,743,104 per token."""
    return 6 * 826_112 + 12 * 4 * 128 * 128


@SHARED
@pytest.mark.timeout(300)
def test_mfu_is_throughput_times_hand_counted_flops_over_the_peak(profiled: Path) -> None:
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK.items() if k in name), None)
    if peak is None:
        pytest.skip(f"{name}: no dense bf16 peak written in this test (H100, H200)")
    assert demo_flops_per_token() == 5_743_104
    records = [r for r in step_records(profiled) if r.get("tokens_per_s")]
    assert records
    for r in records:
        hand = r["tokens_per_s"] * demo_flops_per_token() / (peak * 1)  # world = 1
        assert r["mfu"] == pytest.approx(hand, rel=1e-6), (r, hand)
        assert 0 < r["mfu"] < 1


SPLIT = {"data", "forward", "backward", "optimizer", "checkpoint", "comm", "other"}


@SHARED
@pytest.mark.timeout(300)
def test_the_step_split_sums_to_the_step_time(profiled: Path) -> None:
    """Timed with CUDA events on the GPU: the named parts (all but "other") within 5% of
    the step's time, in every record."""
    records = step_records(profiled)
    assert records and all("split_s" in r and "step_s" in r for r in records), records[:2]
    for r in records:
        assert set(r["split_s"]) == SPLIT, r["split_s"]
        named = sum(v for k, v in r["split_s"].items() if k != "other")
        assert named == pytest.approx(r["step_s"], rel=0.05), r


@SHARED
@pytest.mark.timeout(300)
def test_the_runs_state_bytes_are_the_plans(profiled: Path) -> None:
    """The run's memory event (what the rank held) against `hpcshard plan` on 1 x 1."""
    measured = events(profiled, "memory")[-1]
    spec = json.loads((profiled / "spec.json").read_text())
    plan = make_plan(job=spec["job"], sets=spec["sets"], numbers={}, hf_config=None, nodes=1, gpus=1,
                     sharding="auto", precision=None, ac=None, micro_batch=None, gpu_mem=80 * 2**30)
    predicted = plan["modes"][plan["sharding"]]
    for key in ("params", "grads", "optimizer"):
        assert measured[key] == pytest.approx(predicted[key], rel=0.05), (key, measured, predicted)


@pytest.mark.timeout(300)
def test_hpcshard_profile_on_a_live_run(tmp_path: Path) -> None:
    """`hpcshard profile RUN --steps 2 --ranks 0 --memory` while the run trains: it waits
    for the trace and the snapshot, prints their paths and exits 0; the run then goes on to
    its last step."""
    run, steps = tmp_path / "run", 600
    argv = [sys.executable, "-m", "hpcshard", "submit", "--backend", "local", "--nodes", "1", "--gpus", "1",
            "jobs/charlm.py", "--run-dir", str(run), "--max-restarts", "0", "--set", f"steps={steps}",
            *[a for s in DEMO for a in ("--set", s)]]
    said = tmp_path / "submit.out"
    with said.open("w") as sink:  # (a file, not a pipe nobody reads while it trains)
        proc = subprocess.Popen(argv, cwd=ROOT, env=quiet_env(), stdout=sink, stderr=subprocess.STDOUT,
                                text=True)
    try:
        wait_for(lambda: step_records(run) or proc.poll() is not None, timeout=150,
                 what="the run's first step record")
        assert proc.poll() is None, f"the run ended before it was profiled: {rank_log(run)[-3000:]}"
        started = time.monotonic()
        out = hpcshard("profile", str(run), "--steps", "2", "--ranks", "0", "--memory", timeout=150)
        took = time.monotonic() - started
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:] + rank_log(run)[-3000:]
        printed = [Path(w) for w in out.stdout.split() if w.endswith((".json", ".pickle"))]
        traces = [p for p in printed if p.name == "rank-0.pt.trace.json"]
        assert traces and all(p.exists() for p in printed), out.stdout
        assert kernels(traces[0]), f"{traces[0]}: no CUDA kernel"
        pickles = [p for p in printed if p.name == "rank-0.memory.pickle"]
        assert pickles, out.stdout
        snapshot(pickles[0])
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, said.read_text()[-3000:]
    assert step_records(run)[-1]["step"] == steps, f"profiled in {took:.0f} s; {rank_log(run)[-3000:]}"


@pytest.mark.timeout(240)
def test_out_of_gpu_memory_leaves_a_snapshot_and_one_line(tmp_path: Path) -> None:
    """The head's logits of 256 x 128 tokens over a 4M-token vocabulary are 275 GB in bf16:
    one allocation that no GPU holds, refused at once (the parameters take 0.5 GB, so the
    other tests' runs on the GPU keep their memory). The rank writes its allocator
    snapshot and says where in one line, then fails as any error does."""
    run = tmp_path / "run"
    code, text = attempt(run, "steps=3", "precision=bf16", "eval_every=0", "ckpt_every=1000", "dim=16",
                         "n_heads=2", "n_layers=2", "vocab_size=4194304", "batch_size=256")
    assert code != 0 and not step_records(run), text
    shots = sorted((run / "profiles").glob("oom-rank-0-step-*.pickle"))
    assert shots, text
    # the step that ran out: 1 as metrics number it (0, the steps done before it, would
    # be a naming slip, not a missing snapshot: accepted, and shown by the name)
    assert shots[0].name in ("oom-rank-0-step-00000001.pickle", "oom-rank-0-step-00000000.pickle"), shots
    line = [s for s in rank_log(run).splitlines() if "out of GPU memory" in s]
    assert line and shots[0].name in line[0], rank_log(run)[-3000:]
    snapshot(shots[0])
