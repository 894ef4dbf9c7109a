from __future__ import annotations

from pathlib import Path

from hpcshard.launch.node import NodeEnv, torchrun_argv


def test_node_env_round_trips_through_the_environment() -> None:
    node = NodeEnv(node_rank=1, nnodes=2, per_node=4, rdzv_host="10.0.0.1", rdzv_port=29400,
                   run_id="abc")
    assert NodeEnv.from_environ(node.to_environ()) == node


def test_torchrun_command_for_one_node() -> None:
    node = NodeEnv(node_rank=1, nnodes=2, per_node=4, rdzv_host="n1", rdzv_port=29400,
                   run_id="abc")
    argv = torchrun_argv(node, Path("/runs/x"))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    for arg in ("--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
                "--rdzv_endpoint=n1:29400", "--rdzv_id=abc", "--max_restarts=0"):
        assert arg in argv
    assert argv[-3:] == ["-m", "hpcshard.entry", "/runs/x"]
