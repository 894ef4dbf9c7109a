"""The state dict a save writes, built once and reused between saves (TrainState): in one
process, on a 1-rank gloo group with FSDP2 and activation checkpointing as the trainer
shards, it must equal a freshly built one after every step, and be rebuilt whenever it
would not. And the async stager that starts its copy only once it is handed the state."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hpcshard.runtime.checkpoint import HandOffStager, TrainState

pytestmark = pytest.mark.unit


class Counted(nn.Linear):
    """A module with extra state: computed by the module at each state_dict call."""

    calls = 0

    def get_extra_state(self) -> dict[str, int]:
        self.calls += 1
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


class Net(nn.Module):
    def __init__(self, head: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2))
        self.head = head(8, 3)
        self.seen: torch.Tensor
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1  # a buffer training updates in place
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def trained(head: type[nn.Linear] = nn.Linear) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    net = Net(head)
    for i, block in enumerate(net.blocks):
        net.blocks[i] = checkpoint_wrapper(block)
        fully_shard(net.blocks[i])
    fully_shard(net)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1 / (1 + s))
    return net, optim, sched


def step(net: nn.Module, optim: torch.optim.Optimizer, sched: Any) -> None:
    net(torch.randn(4, 8)).square().mean().backward()
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)


def plain(value: Any) -> Any:
    """A state dict as comparable values: local shards as lists, containers recursively."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def test_reused_state_equals_a_fresh_one_after_every_step(world_of_one: None) -> None:
    net, optim, sched = trained()
    state = TrainState(net, optim)
    for _ in range(4):
        step(net, optim, sched)
        assert plain(state()) == plain(get_state_dict(net, optim))
    # Built at the first save after the optimizer state existed, then reused: the learning
    # rate (changed by the scheduler at every step) was read fresh each time.
    assert state.builds == 1
    assert state()[1]["param_groups"][0]["lr"] == optim.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    assert "blocks.0.0.weight" in state()[0]  # activation checkpointing's prefix is stripped


def test_a_replaced_tensor_or_a_computed_state_builds_again(world_of_one: None) -> None:
    net, optim, sched = trained()
    state = TrainState(net, optim)
    step(net, optim, sched)
    state()
    first = next(iter(optim.state.values()))
    first["exp_avg"] = first["exp_avg"].clone()  # an optimizer that replaces its state
    assert plain(state()) == plain(get_state_dict(net, optim)) and state.builds == 2
    net.seen = torch.ones(())  # a module that assigns a new buffer
    assert plain(state()) == plain(get_state_dict(net, optim)) and state.builds == 3
    state()
    assert state.builds == 3
    # A buffer replaced at every step: the freed one's address is soon reused by its
    # successor, which must not pass for it (the kept objects are compared, not their ids).
    for i in range(6):
        net.seen = net.seen + 1
        assert state()[0]["seen"].item() == net.seen.item() == 2 + i
    # A parameter whose storage is swapped under the same object.
    with torch.no_grad():
        weight: Any = cast(Any, net).head.weight
        weight._local_tensor = weight._local_tensor.clone() + 1
    assert plain(state()) == plain(get_state_dict(net, optim))


def test_an_async_save_gets_copies_of_the_buffers(world_of_one: None) -> None:
    """The forward pass may update a buffer in place while the background copy runs."""
    net, optim, sched = trained()
    state = TrainState(net, optim)
    step(net, optim, sched)
    live, copied = state()[0], state(copy_buffers=True)[0]
    net(torch.randn(4, 8))  # seen += 1, in place
    assert live["seen"].item() == net.seen.item() == copied["seen"].item() + 1
    assert live["head.weight"] is copied["head.weight"]  # parameters stay views: the stager copies


def test_a_module_with_extra_state_is_never_served_from_the_cache(world_of_one: None) -> None:
    net, optim, sched = trained(Counted)
    state = TrainState(net, optim)
    step(net, optim, sched)
    assert state()[0]["head._extra_state"] == {"calls": 1}
    assert state()[0]["head._extra_state"] == {"calls": 2}
    assert state.builds == 2


def test_the_hand_off_stager_copies_only_once_started() -> None:
    stager = HandOffStager()
    try:
        weights = torch.arange(6.0)
        staged = stager.stage({"w": weights, "step": 3})
        assert not staged.done()  # nothing copied while async_save is still running
        stager.start()
        copy = staged.result(timeout=30)
        assert copy["step"] == 3 and torch.equal(copy["w"], weights)
        assert copy["w"].data_ptr() != weights.data_ptr()  # a copy: training may now change weights
        stager.start()  # nothing held: no second copy
        # async_save failed after asking for the copy: whoever waits on it hears why.
        waiting = stager.stage({"w": weights})
        stager.drop(RuntimeError("no space"))
        with pytest.raises(RuntimeError, match="no space"):
            waiting.result(timeout=30)
    finally:
        stager.close()
    # A stager that can no longer copy fails the copy instead of leaving it pending.
    waiting = stager.stage({"w": weights})
    with pytest.raises(RuntimeError):
        stager.start()
    with pytest.raises(RuntimeError):
        waiting.result(timeout=30)
