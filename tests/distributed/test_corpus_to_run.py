"""The README's "from your own corpus to a multi-node pretraining run", run as written but
for its scale: `data prepare` of a directory of text and of a JSONL file (a tokenizer trained
here from the same text: nothing downloaded), then the Llama-shaped job on their 0.7/0.3
mixture, preempted and requeued, ending bitwise equal to the same run never interrupted."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
from functools import partial
from pathlib import Path

import pytest

from hpcshard.rundir import ledger
from tests.conftest import ROOT, hpcshard, hpcshard_bg, sets, wait_for
from tests.distributed.test_runtime_checkpoint import (
    assert_bitwise_equal,
    committed,
    load,
    rank_pids,
    trained_to,
)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SCALE = {"--workers 8": "--workers 2", " --array 32": "", "--nodes 4 --gpus 8": "--nodes 2 --gpus 1",
         "shard=16": "shard=2", "jobs/hf_causal_lm.py": str(ROOT / "jobs" / "hf_causal_lm.py")}
"""What the test changes in the README's commands, each found exactly once: the scale (2
processes, 2 nodes of 1 rank, the shard group over both), no Slurm array (the same shards
as one process writes: tests/unit/test_data_prepare.py), and the job named from the
repository (the commands run in a directory of their own)."""

# Steps of a 0.1M-parameter model take a tenth of a second: the notice goes to a rank at
# once (a signal, not the preempt command's start: seconds on a loaded machine, when 38
# steps may be 4), and every rank stops at the same step boundary.
RUN = sets(steps=40, ckpt_every=8, keep_last=100, seq_len=32, batch_size=8, warmup_steps=4, eval_every=0)


def readme_commands() -> list[list[str]]:
    """The README's corpus-to-run block, scaled (SCALE), one argument list per command."""
    block = next(b for b in re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)
                 if "hpcshard data prepare" in b)
    text = block.replace("\\\n", " ")
    text = re.sub(r" +", " ", text)
    for old, new in SCALE.items():
        assert text.count(old) == 1, f"the README's command no longer has {old!r}: update SCALE"
        text = text.replace(old, new)
    commands = [shlex.split(line, comments=True) for line in text.splitlines()]
    assert len(commands) == 3 and commands[0][:3] == commands[1][:3] == ["hpcshard", "data", "prepare"]
    assert commands[2][:2] == ["hpcshard", "submit"] and "vocab_size=32000" in commands[2]
    return [c[1:] for c in commands]  # (hpcshard() runs `python -m hpcshard`)


def sources(where: Path) -> None:
    """web/: 60 pages of text; code.jsonl: 80 snippets; tokenizer.json: a byte-level BPE of
    at most 320 ids trained on both."""
    from examples.finetune.make_base import byte_bpe

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "it", "rains",
             "in", "the", "old", "town"]
    web = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) + "." for _ in range(60)]
    code = [f"def f{i}(x):\n    return x * {i} + {rng.randint(0, 99)}\n" * rng.randint(1, 4)
            for i in range(80)]
    (where / "web").mkdir()
    for i, page in enumerate(web):
        (where / "web" / f"page-{i:03d}.txt").write_text(page)
    (where / "code.jsonl").write_text("".join(json.dumps({"text": snippet}) + "\n" for snippet in code))
    byte_bpe(web + code, 320, ["<unk>", "<|endoftext|>"], unk="<unk>").save(str(where / "tokenizer.json"))


def test_the_readme_prepares_two_corpora_and_trains_a_mixture_that_resumes_bitwise(tmp_path: Path) -> None:
    prepare_web, prepare_code, submit = readme_commands()
    sources(tmp_path)
    for command in (prepare_web, prepare_code):
        proc = hpcshard(*command, "--no-progress", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    manifests = [json.loads((tmp_path / "corpora" / name / "manifest.json").read_text())
                 for name in ("web", "code")]
    vocab = manifests[0]["vocab_size"]
    assert manifests[1]["vocab_size"] == vocab and all(m["tokens"] > 2000 for m in manifests)
    submit = [arg.replace("vocab_size=32000", f"vocab_size={vocab}") for arg in submit]

    reference, run = tmp_path / "uninterrupted", tmp_path / "preempted"
    proc = hpcshard(*submit, "--run-dir", str(reference), *RUN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = next(r for r in ledger.read(reference) if r["event"] == "start")
    assert (started["world"], started["nodes"]) == (2, 2)
    log = (reference / "logs" / "rank-0.log").read_text()
    assert re.search(r"data: corpora/web \([\d,]+ tokens, weight 0\.7\), corpora/code \([\d,]+ tokens, "
                     r"weight 0\.3\)", log), log[-2000:]

    bg = hpcshard_bg(*submit, "--run-dir", str(run), *RUN, cwd=tmp_path)
    wait_for(partial(trained_to, run, 2), 180, "step 2")
    os.kill(rank_pids(run)[0], signal.SIGUSR2)
    out, _ = bg.communicate(timeout=300)
    assert bg.returncode == 0, out[-4000:]
    assert "requeued as attempt 1" in out, out[-4000:]
    ends = [r for r in ledger.read(run) if r["event"] == "end"]
    assert [e["reason"] for e in ends] == ["stop", "done"] and ends[0]["saved_step"] == ends[0]["step"] < 40
    # Every checkpoint both runs hold (the stop's, the periodic ones, the end) is the same,
    # bit for bit: weights, optimizer, the schedule, the mixture's position and the RNG.
    mine, theirs = committed(run), committed(reference)
    assert 40 in mine and ends[0]["saved_step"] in mine
    for step in sorted(set(mine) & set(theirs)):
        assert_bitwise_equal(load(mine[step]), load(theirs[step]), f"step {step}")
