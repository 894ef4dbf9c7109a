"""Entry point of every rank: `torchrun ... -m hpcshard.runtime.main RUN_DIR`.

RUN_DIR/spec.json (written by `hpcshard submit`) names the job and its --set values.
A user error (a bad value the preflight could not see) exits 2 with one line; its
traceback goes to the rank's log file.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from hpcshard.config import build_config
from hpcshard.runtime.device import init_distributed
from hpcshard.runtime.job import load_job
from hpcshard.runtime.train import Trainer

USER_ERROR = 2
log = logging.getLogger("hpcshard")


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs fully to RUN_DIR/logs/rank-N.log; only rank 0 talks on the console."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    to_file = logging.FileHandler(logs / f"rank-{rank}.log")
    to_file.setFormatter(fmt)
    to_file.setLevel(logging.DEBUG)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.handlers[:] = [to_file, console]
    log.setLevel(logging.DEBUG)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    spec = json.loads((run_dir / "spec.json").read_text())
    env = init_distributed()
    setup_logging(run_dir, env.rank)
    try:
        job = load_job(spec["job"])
        cfg = build_config(job.config, spec["sets"])
        Trainer(job, cfg, env, run_dir).run()
    except ValueError as err:
        log.debug("user error", exc_info=True)
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return USER_ERROR
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
