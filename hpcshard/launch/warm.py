"""torchrun with warm ranks: the agent imports torch and the runtime once, then forks them.

    python -m hpcshard.launch.warm [torchrun options] RUN_DIR

Every option is torchrun's own (its parser, its LaunchConfig, its elastic agent and static
rendezvous); only the workers differ. Plain torchrun starts each rank as a new Python that
imports torch, FSDP, DTensor and DCP again: seconds of CPU per rank, all ranks of a node at
once, typically from a shared file system. Here the agent pays that once and each rank is
a fork of it, running `hpcshard.entry.rank` (torch's own `start_method="fork"` path for
function entry points).

Fork safety: the agent never touches CUDA (no device query, no tensor) and imports no
user code (a job module may query GPUs at import), so each rank initialises its GPU
itself, as under plain torchrun. (Importing torch._dynamo here too, which fully_shard
loads in every rank, made a 2x2 start slower, 17 s against 14 s, when each cycle's agent
was a new Python: the zygote, `launch.zygote`, now imports it once per node.)
`HPCSHARD_WARM_START=0` falls back to plain torchrun (`node.torchrun_argv`), for a site
where something in the agent's imports turns out not to survive a fork. Bring-your-own
scripts always run under plain torchrun: a forked worker leaves through `os._exit`, and a
script's atexit hooks must run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
VISIBLE = "CUDA_VISIBLE_DEVICES"


def main(argv: list[str] | None = None) -> int:
    # What every rank needs, imported once, before the fork.
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    import hpcshard.runtime.main  # noqa: F401  (torch, FSDP2, DTensor, DCP, the trainer)
    from hpcshard import entry

    args = torchrun.get_args_parser().parse_args(argv)
    config = _config(torchrun, args)
    config.start_method = "fork"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        elastic_launch(config, entry.rank)(args.training_script)
    except ChildFailedError as err:
        # torchrun's own exit: one summary of the failed ranks (their logs say why).
        print(f"hpcshard: {err.format_msg()}", file=sys.stderr, flush=True)
        return 1
    except SignalException as err:  # TERM/INT/HUP: the ranks were torn down, as torchrun does
        print(f"hpcshard: torchrun stopped by {err.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    return 0


def _config(torchrun: Any, args: Any) -> Any:
    """torchrun's LaunchConfig for `args`, without touching CUDA. Building one asks
    `torch.cuda.is_available()` and `device_count()` (for its default NUMA binding), and
    the CUDA runtime's answer poisons every later fork: each forked rank then failed with
    "Cannot re-initialize CUDA in forked subprocess" at its first CUDA call (seen on an
    H100, torch 2.11; 2.13 asks the same). NVML answers both without initialising CUDA
    (`PYTORCH_NVML_BASED_CUDA_CHECK`, torch's own switch for this), but only where it can
    count: for MIG instances (CUDA_VISIBLE_DEVICES=MIG-...) or without libnvidia-ml torch
    asks the runtime after all. So the question sees no device (CUDA_VISIBLE_DEVICES
    empty: NVML is not even loaded): the answer only picks a default NUMA binding, which
    torch leaves off outside Meta (`get_default_numa_options`: None; `--numa-binding`
    asks nothing). The ranks get the environment as it was."""
    hidden = {NVML_CHECK: "1", VISIBLE: ""}
    before = {name: os.environ.get(name) for name in hidden}
    os.environ.update(hidden)
    try:
        config, _cmd, _cmd_args = torchrun.config_from_args(args)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return config

if __name__ == "__main__":
    sys.exit(main())
