"""`hpcshard data prepare --array 3` on the local cluster: three array tasks each write their
share of the shards (i, i+3, ...), the last to finish writes the manifest, and the corpus
is byte for byte the one a local run writes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import hpcshard, wait_for
from tests.slurm.conftest import state
from tests.unit.test_data_prepare import TEXTS, corpus

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def tokenizer(folder: Path) -> Path:
    from examples.finetune.make_base import byte_bpe

    byte_bpe(TEXTS, 300, ["<unk>", "<|endoftext|>"], unk="<unk>").save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_an_array_prepares_the_same_corpus_as_a_local_run(cluster: dict[str, str], tmp_path: Path) -> None:
    source, tok = corpus(tmp_path, "jsonl"), tokenizer(tmp_path)
    args = ["data", "prepare", str(source), "--tokenizer", str(tok), "--shard-tokens", "700", "--no-progress"]
    out = tmp_path / "array"
    proc = hpcshard(*args, "-o", str(out), "--array", "3", "--partition", "low", "--time", "10:00",
                    env=cluster)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = proc.stdout.split("submitted job array ")[1].split()[0]
    jobs = [f"{array}_{i}" for i in range(3)]
    wait_for(lambda: all(state(job) in DONE for job in jobs), 300, "every array task done")
    assert [state(job) for job in jobs] == ["COMPLETED"] * 3, subprocess.run(
        ["cat", *map(str, out.glob(".prepare/slurm/task-*/logs/*"))], capture_output=True, text=True).stdout
    local = tmp_path / "local"
    assert hpcshard(*args, "-o", str(local)).returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == json.loads((local / "manifest.json").read_text()) and len(manifest["shards"]) > 3
    for shard in local.glob("shard-*"):
        assert (out / shard.name).read_bytes() == shard.read_bytes()
