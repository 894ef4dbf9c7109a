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


@pytest.mark.parametrize("job", ["jobs/charlm.py", "bench/llama.py"])
def test_activations_on_meta_are_what_a_real_forward_saves(job: str) -> None:
    """The planner's meta-device count of the tensors kept for backward against a real
    forward's (CPU, bf16: fused flash attention, as on a GPU), within 2%: views of one
    tensor count once, a weight (or the transpose a matmul saves) is a parameter, not an
    activation, and attention counts as a fused kernel saves it, not as the meta device's
    math path (its seq x seq scores and fp32 copies doubled the demo's figure). RMSNorm on
    CPU is torch's composite (fp32 copies of a bf16 input); on a GPU it is the fused kernel,
    which keeps its input and an fp32 value per row: the reference counts it so (the GPU
    layer checks the whole against an H200's allocator)."""
    import torch

    from hpcshard.config import build_config
    from hpcshard.runtime.job import load_job
    from hpcshard.runtime.planner import measure

    j = load_job(job)
    cfg = build_config(j.config, {"precision": "bf16", "seq_len": "128", "dim": "64", "n_layers": "2"})
    planned = measure(j, cfg, 2, torch.bfloat16)
    model = j.model(cfg).to(torch.bfloat16)
    seen: set[int] = set()
    saved = [0]
    norming = [False]

    held: list[torch.Tensor] = []

    def count(t: torch.Tensor) -> None:
        if t.untyped_storage()._cdata not in seen:  # (a Python wrapper's id is reused)
            seen.add(t.untyped_storage()._cdata)
            held.append(t)  # (a counted norm input the composite does not keep: its address, freed,
            # was taken by the logits' storage, which then counted as seen: a flaky 1.7 MB)
            saved[0] += t.numel() * t.element_size()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (norming[0] or isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
            count(t)
        return t

    def fused(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        norming[0] = False
        count(args[0])
        saved[0] += args[0][..., 0].numel() * 4  # (the fp32 reciprocal RMS per row)

    for m in model.modules():
        if isinstance(m, torch.nn.RMSNorm):
            m.register_forward_pre_hook(lambda *_: norming.__setitem__(0, True))
            m.register_forward_hook(fused)
    x = torch.randint(0, 256, (2, cfg.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        j.loss(model, x, x)
    assert not planned.act_error
    assert planned.act_bytes == pytest.approx(saved[0], rel=0.02), (planned.act_bytes, saved[0])
