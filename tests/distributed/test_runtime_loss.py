"""The loss on 4 ranks (2 nodes x 2, one torchrun launch): a masked step equals the loss
and gradients of its whole global batch computed in one process, on HSDP and with tensor
parallelism; `sharding=none` all-reduces once per step under accumulation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import quiet_env

WORKER = Path(__file__).with_name("loss_worker.py")


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("loss") / "facts.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=4", str(WORKER), str(out)],
                          env=quiet_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("name,mode,dp,accum", [("hybrid", "hybrid", 4, 2), ("tp", "hybrid", 2, 4)])
def test_a_masked_step_is_its_whole_batch_in_one_process(facts: dict[str, Any], name: str, mode: str,
                                                         dp: int, accum: int) -> None:
    """Uneven masks over micro-batches and ranks: the logged loss is the mean over the
    step's learnt tokens, and the reduced gradients are the whole batch's (to float
    reduction order), under FSDP's averaging and under loss parallelism."""
    step = facts[name]
    assert (step["mode"], step["dp_world"], step["accum"]) == (mode, dp, accum)
    assert step["loss"] == pytest.approx(step["whole_loss"], rel=1e-5)
    assert step["grad_error"] < 1e-5 and step["close"]


def test_none_all_reduces_once_per_step_under_accumulation(facts: dict[str, Any]) -> None:
    none = facts["none"]
    assert none["accum"] == 2
    # one all-reduce per FSDP module per step, not one per micro-batch
    assert none["all_reduces"] == [none["fsdp_modules"]] * 2
    assert none["losses"] == pytest.approx(none["ref_losses"], rel=1e-5)
