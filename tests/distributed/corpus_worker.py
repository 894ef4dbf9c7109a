"""The demo job on a mixture of prepared corpora, for test_runtime_data.py: run as
`torchrun --nproc_per_node=2 corpus_worker.py CORPORA OUT`. One launch: the same steps with
the background loader and without it, and a run's metrics records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hpcshard.config import build_config  # noqa: E402
from hpcshard.runtime.device import init_distributed  # noqa: E402
from hpcshard.runtime.job import load_job  # noqa: E402
from hpcshard.runtime.train import Trainer  # noqa: E402

JOB = load_job(str(ROOT / "jobs" / "charlm.py"))


def main() -> None:
    corpora, out = sys.argv[1], Path(sys.argv[2])
    env = init_distributed()
    sets = {"dim": "32", "n_layers": "2", "n_heads": "2", "seq_len": "32", "batch_size": "8",
            "micro_batch_size": "2", "warmup_steps": "2", "steps": "3", "log_every": "1",
            "eval_every": "0", "data": "web:0.7,code:0.3", "data_root": corpora, "doc_mode": "whole"}
    facts = {}
    for prefetch in ("0", "2"):
        t = Trainer(JOB, build_config(JOB.config, {**sets, "data_prefetch": prefetch}), env, None)
        facts[prefetch] = [t.mean_over_ranks(t.train_step()[0]) for _ in range(3)]
        t.batches.close()
    run = out.parent / "run"
    run.mkdir(exist_ok=True)
    t = Trainer(JOB, build_config(JOB.config, {**sets, "ckpt_every": "0"}), env, run)
    t.run()
    if env.is_main:
        facts["records"] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        out.write_text(json.dumps(facts))


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker(main)
