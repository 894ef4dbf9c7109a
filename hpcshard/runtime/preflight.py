"""Check a job before anything runs: `python -m hpcshard.runtime.preflight` reads
{"job", "sets", "nodes", "gpus", "min_nodes"[, "path", "here"]} as JSON on stdin and prints the
resolved config; "here": the ranks will run on this host (the local backend).

A sweep sends {"job", "variants": [sets, ...], "nodes", "gpus"[, "here"]} and gets one resolved
config per variant; a bad one is named by its index ("variant 2: ...").

The CLI runs this in a subprocess (the CLI itself never imports torch). It imports the job,
builds its config from the --set values, builds the model on the meta device (no memory),
finds the block to shard and opens the data, so a typo fails here in seconds instead of
after hours in a queue. A user error prints one line and exits 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import traceback
from typing import Any

from hpcshard.config import build_config
from hpcshard.errors import UserError
from hpcshard.runtime.blocks import find_blocks, on_meta
from hpcshard.runtime.data import GlobalBatches
from hpcshard.runtime.job import load_job, require_tp_plan
from hpcshard.sections import Parallel


def preflight(request: dict[str, Any]) -> dict[str, Any]:
    nodes, gpus = int(request["nodes"]), int(request["gpus"])
    job = load_job(request["job"])
    cfg = build_config(job.config, request["sets"])
    degrees = Parallel.of(cfg, nodes, gpus)
    require_tp_plan(job, cfg.tp, request["job"])
    micro, accum = degrees.accumulation(cfg)
    degrees.check_reshard(cfg.reshard_after_forward)
    degrees.check_fewer_nodes(int(request.get("min_nodes", 0)), cfg)
    with on_meta():
        model = job.model(cfg)
    blocks = find_blocks(model, cfg.block, cfg.block_min_params)
    if cfg.float8:
        check_float8(model, blocks, bool(request.get("here")))
    if cfg.init_from:  # its headers against the model's names and shapes: no tensor is read
        from hpcshard.runtime.pretrained import match, read_dir

        match(model, read_dir(cfg.init_from))
    if cfg.tp > 1 and job.tp_plan is not None:
        job.tp_plan(cfg, model)  # its own checks (heads, tied weights), before anything queues
    splits = job.data(cfg)
    GlobalBatches(splits.source or splits.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                  micro=micro, rank=0, world=degrees.dp_world, seed=cfg.seed, order=cfg.data_order)
    return {
        "config": dataclasses.asdict(cfg),
        "sharding": degrees.mode,
        "replicate": degrees.replicate,
        "shard": degrees.shard_degree,
        "block": type(blocks[0]).__name__,
        "blocks": len(blocks),
        "params": sum(p.numel() for p in model.parameters()),
        "micro_batch": micro,
        "accumulation": accum,
        "train_tokens": splits.train_tokens,
    }


def check_float8(model: Any, blocks: list[Any], here: bool) -> None:
    """float8=true: the model has layers to convert and, where the ranks run on this host,
    the device multiplies in float8 and torchao imports. A Slurm job's GPUs cannot be seen
    from the login node: its ranks check at model build (`runtime.float8.convert`)."""
    from hpcshard.runtime import float8

    float8.count(model, blocks)
    if here:
        import torch

        why = float8.refusal(torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
        if why:
            raise UserError(why)


def preflight_all(request: dict[str, Any]) -> dict[str, Any]:
    """One variant (`sets`), or each of a sweep's (`variants`), in this one process; `path`:
    where the job imports from first (a resumed run's copy of its code, `Code.path`)."""
    sys.path[:0] = request.get("path", [])
    if "variants" not in request:
        return preflight(request)
    resolved = []
    for i, sets in enumerate(request["variants"]):
        try:
            resolved.append(preflight({**request, "sets": sets}))
        except ValueError as err:
            raise UserError(f"variant {i}: " + " ".join(str(err).split("\n"))) from None
        except Exception:
            print(f"variant {i} ({json.dumps(sets)}) crashed:", file=sys.stderr)
            raise
    return {"variants": resolved}


def main() -> int:
    try:
        # What the job prints (at import, building its model) is not the answer: stdout
        # carries the JSON alone.
        with contextlib.redirect_stdout(sys.stderr):
            result = preflight_all(json.load(sys.stdin))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    except Exception:  # the job's own code failed: its traceback is what the user needs
        traceback.print_exc()
        return 1
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
