"""`--then export-hf=DIR` on the local backend: the run trains here, then its final
checkpoint is exported in the same command, and `status` says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hpcshard, metrics, sets
from tests.slurm.test_chain import HF_SETS, set_args

pytest.importorskip("transformers")


@pytest.mark.dist
def test_then_exports_the_final_checkpoint_after_a_local_run(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "hf"
    proc = hpcshard("submit", "--backend", "local", "--nodes", "1", "--gpus", "1", "jobs/hf_causal_lm.py",
                    "--run-dir", str(run), "--then", f"export-hf={out}", *set_args(HF_SETS), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout and "(step 4)" in proc.stdout, proc.stdout
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == HF_SETS["layers"]
    status = hpcshard("status", str(run))
    assert f"then: export-hf {out}: done: step 4 written to {out}" in status.stdout, status.stdout


@pytest.mark.dist
def test_then_eval_gives_the_held_out_loss_training_gave_on_another_world(tmp_path: Path) -> None:
    """`--then eval` evaluates the final checkpoint in one process (a world of 1; it trained
    on 2 ranks): the very loss the run's own evaluation gave at that step, into its metrics."""
    run = tmp_path / "run"
    proc = hpcshard("submit", "--backend", "local", "--nodes", "1", "--gpus", "2", "jobs/charlm.py",
                    "--run-dir", str(run), "--then", "eval", *sets(steps=6, eval_every=3, log_every=3),
                    timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    evals = [r for r in metrics(run) if "eval_loss" in r and "event" not in r]
    assert [r["step"] for r in evals] == [3, 6, 6] and evals[-1]["source"] == "then eval"
    assert evals[-1]["eval_loss"] == evals[1]["eval_loss"]
    status = hpcshard("status", str(run))
    said = f"then: eval: done: eval loss {evals[-1]['eval_loss']:.4f} at step 6"
    assert said in status.stdout and f"eval: loss {evals[-1]['eval_loss']:.4f} at step 6" in status.stdout, \
        status.stdout
