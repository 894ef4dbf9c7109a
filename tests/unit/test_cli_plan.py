"""The sharding modes: one list (config), which the planner orders by preference."""

from __future__ import annotations

import pytest

from hpcshard.cli import plan as plancmd
from hpcshard.config import SHARDING_MODES

pytestmark = pytest.mark.unit


def test_the_planner_ranks_every_mode_the_config_accepts() -> None:
    from hpcshard.runtime.planner import MODES

    assert sorted(MODES) == sorted(plancmd.MODES) == sorted(m for m in SHARDING_MODES if m != "auto")
