"""The sharding modes: one list (config), which the planner orders by preference."""

from __future__ import annotations

import pytest

from hpcshard.cli import plan as plancmd
from hpcshard.config import SHARDING_MODES

pytestmark = pytest.mark.unit


def test_the_planner_ranks_every_mode_the_config_accepts() -> None:
    from hpcshard.runtime.planner import MODES

    assert sorted(MODES) == sorted(plancmd.MODES) == sorted(m for m in SHARDING_MODES if m != "auto")


@pytest.mark.parametrize("freeze", ["", "blocks.0.*"])
def test_the_checkpoint_holds_the_whole_model_whatever_the_tensor_parallel_degree(freeze: str) -> None:
    """tp=2 gives each rank half of most matrices, but the checkpoint (and what trains) is
    the whole model's: the same estimate at tp=1 and tp=2, frozen parameters left out."""
    from hpcshard.runtime.planner import make_plan

    def plan(tp: int) -> dict:
        return make_plan(job="jobs/charlm.py", sets={"tp": str(tp), "freeze": freeze}, numbers={},
                         hf_config=None, nodes=2, gpus=2, sharding="auto", precision=None, ac=None,
                         micro_batch=None, gpu_mem=80 * 2**30)

    one, two = plan(1), plan(2)
    assert one["model"]["trainable"] == two["model"]["trainable"]
    assert (one["model"]["trainable"] < one["model"]["params"]) == bool(freeze)
    assert two["checkpoint_bytes"] == pytest.approx(one["checkpoint_bytes"], rel=0.05)
