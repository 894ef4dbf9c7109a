"""Tensor parallelism through the real CLI on the local backend: a tp=2 run preempted and
resumed ends bitwise equal to one never interrupted; a run resumes on another tp degree
with the same losses; export gives the full weights whatever the degree. (1 rank against
tp=2 on a 3D mesh, step by step: test_runtime_train.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hpcshard.rundir import ledger
from tests.conftest import STEPS, hpcshard, metrics, sets, step_records
from tests.distributed.test_runtime_checkpoint import assert_bitwise_equal, committed, load, preempted_once
from tests.distributed.test_runtime_planner import assert_planned

# A tp=2 step and its save cost about 5 CPU-s here. The preempted run is stopped once past
# step 2 (a checkpoint before the stop) and keeps the 6 steps before the end it had when
# it was 10 steps long and stopped past step 4: the notice's margin on a loaded machine.
TP_STEPS = 8
TP = sets(steps=TP_STEPS, ckpt_every=1, keep_last=1000, eval_every=TP_STEPS, tp=2)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo with tp=2 on 2 nodes x 2 ranks (mesh replicate 2 x shard 1 x tp 2), never
    interrupted."""
    run = tmp_path_factory.mktemp("tp") / "tp-uninterrupted"
    proc = hpcshard("submit", "--nodes", "2", "--gpus", "2", "jobs/charlm.py", "--run-dir", str(run), *TP)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def losses_after(run: Path, resumed: int) -> dict[int, float]:
    """Losses of the steps after `resumed` in the run's newest start."""
    mine = metrics(run)
    last = max(i for i, r in enumerate(mine) if r.get("event") == "start")
    return {r["step"]: r["loss"] for r in mine[last:] if "loss" in r and "event" not in r
            and r["step"] > resumed}


def test_a_tensor_parallel_run_preempted_resumes_bitwise(tp_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "tp-preempted"
    stop = preempted_once(run, "jobs/charlm.py", 2, *TP)
    reference, mine = committed(tp_run), committed(run)
    assert TP_STEPS in mine and stop["saved_step"] in mine
    for step, path in mine.items():  # DTensors of a 3D mesh, the optimizer's too
        assert_bitwise_equal(load(path), load(reference[step]), f"step {step}")


@pytest.mark.parametrize("source,nodes,gpus,tp", [("tp1", "1", "4", "2"), ("tp2", "2", "2", "1"),
                                                  ("tp2", "1", "2", "2")])
def test_resume_on_another_tensor_parallel_degree(uninterrupted: Path, tp_run: Path, tmp_path: Path,
                                                 source: str, nodes: str, gpus: str, tp: str) -> None:
    """DCP reshards the TP+FSDP DTensors: tp=1 on 2x2 -> tp=2 on 1x4, tp=2 -> tp=1, and
    tp=2 on 2 nodes -> tp=2 on 1; the same global batches follow, so the same losses."""
    origin, at, end = (uninterrupted, 12, STEPS) if source == "tp1" else (tp_run, 4, TP_STEPS)
    run = tmp_path / "reshaped"
    shutil.copytree(origin, run)
    proc = hpcshard("resume", str(run), "--nodes", nodes, "--gpus", gpus, "--resume", str(at),
                    "--set", f"tp={tp}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = [r for r in ledger.read(run) if r["event"] == "start"][-1]
    assert start["resumed_step"] == at and start["world"] == int(nodes) * int(gpus)
    resumed = losses_after(run, at)
    reference = {r["step"]: r["loss"] for r in step_records(origin)}
    assert sorted(resumed) == list(range(at + 1, end + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=2e-4), step


def chunks(checkpoint: Path, key: str) -> list[tuple[list[int], list[int]]]:
    """The pieces of one tensor a DCP checkpoint holds: (offsets, sizes), each once (a
    replica's copy is written by one rank only)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata[key]
    return sorted((list(c.offsets), list(c.sizes)) for c in meta.chunks)  # type: ignore[union-attr]


def test_a_shard_group_across_both_nodes_with_tensor_parallelism(tp_run: Path, tmp_path: Path) -> None:
    """tp=2 with shard=2 on 2 nodes x 2: (replicate 1, shard 2, tp 2), each node's two ranks
    a tensor parallel pair and each shard group ({0, 2}, {1, 3}) across the two nodes. A
    shard group of every data-parallel rank is full sharding: the mesh is (shard 2, tp 2),
    a replicate dimension of 1 left out. Resumed from the tp run's (replicate 2, shard 1,
    tp 2) step 4, DCP reshards: each rank holds a quarter of every matrix (half of what it
    held), the new checkpoint holds each matrix in 4 distinct pieces (no replica), and the
    same global batches give the same losses."""
    run = tmp_path / "tp-shard"
    shutil.copytree(tp_run, run)
    proc = hpcshard("resume", str(run), "--nodes", "2", "--gpus", "2", "--resume", "4", "--set", "tp=2",
                    "--set", "shard=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = [r for r in metrics(run) if r.get("event") == "start"]
    assert [(s["sharding"], s["mesh"]) for s in (started[0], started[-1])] == [("hybrid", [2, 1, 2]),
                                                                                ("full", [2, 2])]
    held = [r["params"] for r in metrics(run) if r.get("event") == "memory"]
    assert held[-1] == pytest.approx(held[0] / 2, rel=0.02)  # a quarter per rank, not a half
    key = "model.blocks.0.attn.q.weight"  # column-wise: tp and the shard group both split rows
    before, after = chunks(committed(tp_run)[TP_STEPS], key), chunks(committed(run)[TP_STEPS], key)
    rows = before[-1][0][0] + before[-1][1][0]
    assert [(o[0], s[0]) for o, s in before] == [(0, rows // 2), (rows // 2, rows // 2)]
    assert [(o[0], s[0]) for o, s in after] == [(i * rows // 4, rows // 4) for i in range(4)]
    resumed, reference = losses_after(run, 4), {r["step"]: r["loss"] for r in step_records(tp_run)}
    assert sorted(resumed) == list(range(5, TP_STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=2e-4), step
    assert_planned(run, 2, 2)


def test_export_gives_the_full_weights_whatever_the_degree(uninterrupted: Path, tp_run: Path,
                                                         tmp_path: Path) -> None:
    """The same keys and full shapes from a tp=2 run as from a tp=1 one, each the values
    its checkpoint holds (the DTensors of the 3D mesh reassembled)."""
    out1, out2 = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    assert hpcshard("ckpt", "export", str(uninterrupted), "--out", str(out1)).returncode == 0
    assert hpcshard("ckpt", "export", str(tp_run), "--out", str(out2)).returncode == 0
    one, two = torch.load(out1), torch.load(out2)
    assert one.keys() == two.keys() and "blocks.0.attn.q.weight" in two
    stored = load(committed(tp_run)[TP_STEPS])["model"]
    for key in one:
        assert one[key].shape == two[key].shape, key
        assert torch.equal(two[key], stored[key]), key
    # The demo is no transformers model: --hf says so in one line and writes nothing.
    proc = hpcshard("ckpt", "export", str(tp_run), "--hf", str(tmp_path / "hf"))
    assert proc.returncode == 2 and "--hf needs a transformers model; this run's is CharLM" in proc.stderr
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_the_planner_knows_what_a_tensor_parallel_rank_holds(tp_run: Path) -> None:
    """`hpcshard plan --set tp=2` predicts the parameter, gradient and optimizer bytes each
    rank of the tp=2 run held (a tensor parallel rank's split of every matrix, FSDP's
    shard of that), and the checkpoint's size, within 5%."""
    assert_planned(tp_run, 2, 2)
