"""One emulated node of the control-plane bench (`bench.control`): the real launcher
(`hpcshard.launch.node.run_node`: its pid file, signal handling and `Supervisor`), whose
agent is a fake rank (`bench/control_rank.py`) instead of torchrun.

The only change is the agent's command line: `run_node` builds it with `torchrun_argv`,
which is swapped here for the fake rank's. With HPCSHARD_WARM_START=0 (set by the bench)
the agent is then a plain Popen of the fake rank: it is the node's one rank, and satisfies
everything the supervisor asks of an agent (poll, wait, send_signal, pid, returncode).
Everything else, HPCSHARD_COORD included, is the launcher's own.

    python -m bench.control_node RUN_DIR     (environment: as `launch.local` sets it, and
                                              BENCH_CONTROL_STEPS, _RATE, _STEADY, _STAMPS)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hpcshard.launch import node as lnode

RANK = Path(__file__).with_name("control_rank.py")


def fake_argv(node: Any, run_dir: Path, module: str = "hpcshard.entry", warm: bool = False) -> list[str]:
    """`torchrun_argv`'s stand-in: the fake rank, global rank = the node's place in the cycle
    (one rank per node)."""
    env = os.environ
    return [sys.executable, str(RANK), str(node.node_rank), env.get("BENCH_CONTROL_STEPS", "3000"),
            env.get("BENCH_CONTROL_RATE", "5"), env.get("BENCH_CONTROL_STEADY", "5")]


def main() -> int:
    if os.environ.get("HPCSHARD_WARM_START") != "0":
        print("bench.control_node: set HPCSHARD_WARM_START=0 (the agent must be the fake rank, "
              "not a zygote's fork)", file=sys.stderr)
        return 2
    lnode.torchrun_argv = fake_argv  # type: ignore[assignment]
    return lnode.main()


if __name__ == "__main__":
    sys.exit(main())
