"""Prepared corpora on 2 ranks (one torchrun): the background loader trains the very steps
the synchronous path trains, and each metrics record says how long the step waited."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import quiet_env
from tests.unit.test_runtime_corpus import write_corpus

WORKER = Path(__file__).with_name("corpus_worker.py")


def test_the_loader_trains_the_same_steps_and_metrics_carry_the_wait(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        write_corpus(tmp_path / name, [rng.integers(1, 256, int(n)).tolist() + [0]
                                       for n in rng.integers(8, 80, 300)], per_shard=100, vocab=256)
    out = tmp_path / "facts.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(WORKER), str(tmp_path), str(out)],
                          env=quiet_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    facts = json.loads(out.read_text())
    assert facts["0"] == facts["2"]  # bitwise: the same batches, prepared ahead or not
    steps = [r for r in facts["records"] if "data_wait_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["data_wait_s"] >= 0 for r in steps)
    start = next(r for r in facts["records"] if r.get("event") == "start")
    assert "web (" in start["data"] and "documents: whole" in start["data"]
