"""TensorBoard and W&B (offline) through the real CLI: the demo on 1x2 preempted and requeued,
then resumed from an older checkpoint, is one TensorBoard run and one W&B run in which
every step shows once with the losses metrics.jsonl has; a planted API key and a token
that a site profile names as secrets are in no file of the run directory. (1 node of 2
ranks: only rank 0 writes the trackers, and a second node would cost three more zygotes
and four more ranks across the run's three starts.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from hpcshard.rundir.spec import RunSpec, wandb_id
from tests.conftest import STEPS, hpcshard, sets, step_records
from tests.distributed.test_runtime_checkpoint import preempted_once

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

SECRET = "planted" + "9c1e5b7a" * 5  # the shape of a W&B API key: 40 characters
TOKEN = "hf_planted" + "Qx4" * 10
TRACKED = sets(steps=STEPS, ckpt_every=4, eval_every=STEPS, tensorboard="true",
               wandb_project="hpcshard-tests", wandb_mode="offline")
RESUME = 8


def tensorboard_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point TensorBoard shows for `tag` (what an earlier start
    logged past a purge step is dropped, as TensorBoard's own reader drops it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_records(file: Path) -> list[bytes]:
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks, each record
    `crc32 length type` then its bytes, split across blocks as FIRST/MIDDLE/LAST) after
    W&B's 7-byte header. wandb 0.31 reads them in its Go core only, so the test does."""
    import struct

    data, block, out, part = file.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B", file
    pos = 7
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            out.append(part)
            part = b""
    return out


def wandb_history(offline_run: Path) -> list[dict]:
    """The history rows (step and values) of one offline W&B run directory."""
    from wandb.proto import wandb_internal_pb2

    (file,) = offline_run.glob("*.wandb")
    rows = []
    for data in wandb_records(file):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_one_tensorboard_and_one_wandb_run_across_a_requeue_and_an_older_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a user's environment holds, and a site profile that names both as secrets.
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    site = tmp_path / "site.toml"
    site.write_text('[profiles.tracked]\nsecrets = ["WANDB_API_KEY", "HF_TOKEN"]\n')
    monkeypatch.setenv("HPCSHARD_SITE", str(site))
    run = tmp_path / "tracked"
    stop = preempted_once(run, "jobs/charlm.py", 6, "--profile", "tracked", *TRACKED, nodes=1)
    assert stop["saved_step"] > RESUME - 4
    proc = hpcshard("resume", str(run), "--resume", str(RESUME))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    starts = [r for r in ledger.read(run) if r["event"] == "start"]
    assert len(starts) == 3 and starts[-1]["resumed_step"] == RESUME

    # metrics.jsonl has steps after 8 twice (the older resume trained them again, to the
    # same losses: resume is exact); each tracker shows every step once.
    losses: dict[int, float] = {}
    for r in step_records(run):
        assert losses.setdefault(r["step"], r["loss"]) == r["loss"]
    assert sorted(losses) == list(range(1, STEPS + 1))

    shown = tensorboard_scalars(run, "train/loss")
    assert [step for step, _ in shown] == list(range(1, STEPS + 1))
    for step, value in shown:
        assert value == pytest.approx(losses[step], rel=1e-6), step
    assert [s for s, _ in tensorboard_scalars(run, "eval/loss")] == [STEPS]

    # W&B: one offline run directory per start, all of the one run id; every step once.
    run_id = wandb_id(run, RunSpec.read(run).created)
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 3 and all(d.name.endswith(f"-{run_id}") for d in offline), offline
    steps = [row["_step"] for d in offline for row in wandb_history(d) if "train/loss" in row]
    assert steps == list(range(1, STEPS + 1))
    for d in offline:
        for row in wandb_history(d):
            if "train/loss" in row:
                assert row["train/loss"] == pytest.approx(losses[row["_step"]], rel=1e-9)

    status = hpcshard("status", str(run)).stdout  # where to look
    assert f"tensorboard: tensorboard --logdir {run / 'tensorboard'}" in status
    assert f"wandb: run {run_id} in " in status
    assert f"(offline: wandb sync {run / 'wandb'}/offline-run-*)" in status

    # The secrets reached the ranks through the environment and no file of the run directory
    # (spec, ledger, logs, metrics, checkpoints, the trackers' own files).
    for secret in (SECRET, TOKEN):
        leaked = [f for f in run.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]
        assert not leaked, leaked
    assert json.loads((run / "spec.json").read_text())["profile"] == "tracked"
