"""`hpcshard plan`: will it fit, and how should it be sharded? (login node: torch is
imported only when the command runs, to build the model on the meta device)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

from hpcshard.cli.common import table
from hpcshard.config import PRECISIONS, SHARDING_MODES, check_precision, parse_sets
from hpcshard.errors import JobCrashed

UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
MEM_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
MODES = tuple(m for m in SHARDING_MODES if m != "auto")


def parse_count(text: str, what: str) -> int:
    """70B, 7.5M, 120000 -> a positive count; ValueError naming the accepted units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBGT]?)\s*", text.upper())
    if not m:
        raise ValueError(f"{what} {text!r} is not a count; use a number with an optional K, M, B "
                         "(or G) or T suffix, e.g. 70B or 350M")
    value = float(m.group(1)) * UNITS[m.group(2)]
    if value < 1:
        raise ValueError(f"{what} {text!r} must be at least 1")
    return int(value)


def parse_memory(text: str, option: str = "--gpu-mem") -> int:
    """80GiB, 80GB, 80G (GiB), 24000MiB -> bytes; ValueError naming the accepted units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([KMGT])(I?B)?|(B))?\s*", text.upper())
    if not m:
        raise ValueError(f"{option} {text!r} does not parse; use e.g. 80GiB, 80GB or 24000MiB")
    prefix, suffix, plain = m.group(2), m.group(3), m.group(4)
    unit = "B" if plain else f"{prefix or 'G'}{suffix or 'IB'}"
    value = float(m.group(1)) * MEM_UNITS[unit]
    if value <= 0:
        raise ValueError(f"{option} {text!r} must be more than zero")
    return int(value)


def parse_ac(text: str) -> int:
    """none -> 0, full -> 1 (and selective, estimated as full: a lower bound on what it
    keeps), K -> every K-th block."""
    if text in ("none", "full", "selective"):
        return {"none": 0, "full": 1, "selective": 1}[text]
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"--ac {text!r} is not valid; use none, full, selective, or K (every K-th block)")


@click.command()
@click.argument("job", required=False)
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus", type=click.IntRange(min=1), default=8, show_default=True, help="GPUs per node.")
@click.option("--sharding", type=click.Choice(("auto", *MODES)), default="auto", show_default=True,
              help="auto: hybrid on more than one node, else full.")
@click.option("--shard", type=click.IntRange(min=0), default=0, show_default=True,
              help="Shard degree: replicate over groups of this many consecutive ranks (divided "
              "by tp), e.g. 16 on 8-GPU nodes spans 2 nodes [default: the job's, else the mode's].")
@click.option("--precision", metavar="|".join(PRECISIONS),
              help="Compute dtype [default: the job's, else bf16]; float8: --set float8=true.")
@click.option("--ac", "ac_text", default=None, metavar="none|full|selective|K",
              help="Activation checkpointing [default: the job's, else none].")
@click.option("--micro-batch", type=click.IntRange(min=1), help="Sequences per GPU per micro-batch "
              "[default: the job's batch over the ranks, else 1].")
@click.option("--gpu-mem", default="80GiB", show_default=True, help="Memory of one GPU.")
@click.option("--reserve", default="1GiB", show_default=True,
              help="Memory per GPU that training cannot use (CUDA context, NCCL, allocator slack).")
@click.option("--params", help="Model given by numbers: parameter count (e.g. 70B).")
@click.option("--layers", type=int, help="... number of transformer layers.")
@click.option("--hidden", type=int, help="... hidden size.")
@click.option("--heads", type=int, default=None, help="... attention heads [default: hidden/128].")
@click.option("--seq-len", type=int, default=None, help="... sequence length [default: 4096].")
@click.option("--vocab", type=int, default=None, help="... vocabulary size [default: 32000].")
@click.option("--hf-config", type=click.Path(path_type=Path),
              help="A Hugging Face config.json (or its directory): the model is built from it "
              "on the meta device (needs transformers).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a job config field.")
def plan(job: str | None, nodes: int, gpus: int, sharding: str, shard: int, precision: str | None,
         ac_text: str | None, micro_batch: int | None, gpu_mem: str, reserve: str,
         params: str | None,
         layers: int | None, hidden: int | None, heads: int | None, seq_len: int | None,
         vocab: int | None, hf_config: Path | None, as_json: bool, sets: tuple[str, ...]) -> None:
    """Per-GPU memory of JOB (or of a model given by numbers or a Hugging Face config) on
    NODES x GPUS: parameters, gradients, optimizer state, activations, all-gather buffers,
    for each sharding mode (and the shard degree asked for); whether it fits, the checkpoint
    size, the smallest node count that fits, and a recommended sharding (the smallest shard
    degree that fits), AC and micro-batch."""
    mem = parse_memory(gpu_mem)
    held = parse_memory(reserve, "--reserve") if reserve.strip() not in ("0", "0B") else 0
    ac = parse_ac(ac_text) if ac_text is not None else None
    if precision is not None:
        check_precision(precision)
    sources = [x for x in (job, params, hf_config) if x]
    if len(sources) != 1:
        raise ValueError("give one model: a JOB, --params with --layers and --hidden, or --hf-config")
    numbers: dict[str, Any] = {}
    if params:
        if layers is None or hidden is None:
            raise ValueError("--params needs --layers and --hidden (e.g. --params 70B --layers 80 "
                             "--hidden 8192)")
        numbers = {"params": parse_count(params, "--params"), "layers": layers, "hidden": hidden,
                   "heads": heads or max(1, hidden // 128), "seq_len": seq_len or 4096,
                   "vocab": vocab or 32000}
        for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
            if numbers[key] < 1:
                raise ValueError(f"--{key.replace('_', '-')} {numbers[key]} must be at least 1")
    if hf_config is not None and not hf_config.exists():
        raise ValueError(f"--hf-config {str(hf_config)!r} does not exist; give a config.json "
                         "or the directory holding it")
    from hpcshard.runtime.planner import make_plan

    try:
        result = make_plan(job=job, sets=parse_sets(sets), numbers=numbers, hf_config=hf_config,
                           nodes=nodes, gpus=gpus, sharding=sharding, precision=precision, ac=ac,
                           micro_batch=micro_batch, gpu_mem=mem, reserve=held, shard=shard)
    except RuntimeError as err:  # the job's model failed to build (its own code, or torch's refusal)
        raise JobCrashed(str(err)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    show(result)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def show(p: dict[str, Any]) -> None:
    m = p["model"]
    frozen = m["params"] - m.get("trainable", m["params"])
    trains = f" ({m['trainable'] / 1e6:,.2f}M trained, the rest frozen)" if frozen else ""
    click.echo(f"model: {m['name']}: {m['params'] / 1e6:,.2f}M parameters{trains}, {m['blocks']} x "
               f"{m['block']} (largest {m['max_block_params'] / 1e6:,.2f}M), "
               f"{m['root_params'] / 1e6:,.2f}M outside the blocks")
    click.echo(f"shape: {p['nodes']} node(s) x {p['gpus']} GPU(s), {p['precision']}, micro-batch "
               f"{p['micro_batch']} x {m['seq_len']} tokens, AC {p['ac']}, GPU memory "
               f"{gib(p['gpu_mem'])}\n")
    modes = p["modes"]
    rows = [("sharding", *[f"{k}{' *' if k == p['sharding'] else ''}" for k in modes]),
            ("mesh (replicate x shard)", *[f"{v['replicate']} x {v['shard']}" for v in modes.values()])]
    if p.get("tp", 1) > 1:
        rows[1] = ("mesh (replicate x shard x tp)",
                   *[f"{v['replicate']} x {v['shard']} x {p['tp']}" for v in modes.values()])
    for key, label in (("params", "parameters (fp32 shard)"), ("grads", "gradients (fp32 shard)"),
                       ("optimizer", "optimizer (AdamW)"), ("gather", "all-gather buffers"),
                       ("reduce", "reduce-scatter buffer"), ("activations", "activations, no AC"),
                       ("activations_ac", f"activations, AC {p['ac_with']}"),
                       ("reserve", "reserve (CUDA, NCCL, slack)")):
        rows.append((label, *[gib(v[key]) for v in modes.values()]))
    rows.append(("total, no AC", *[gib(v["total"]) for v in modes.values()]))
    rows.append((f"total, AC {p['ac_with']}", *[gib(v["total_ac"]) for v in modes.values()]))
    rows.append((f"fits in {gib(p['gpu_mem'])}", *[
        "yes" if v["fits"] else "with AC" if v["fits_ac"] else "no" for v in modes.values()]))
    table(("per GPU", *["" for _ in modes]), rows)
    if p.get("float8"):
        click.echo("\nfloat8: counted as bf16; its all-gathers carry the converted Linear weights in "
                   "1 byte instead of 2 (the all-gather row is an upper bound), its matmuls save "
                   "their bf16 inputs for backward as bf16's do")
    if p["activations_unmeasured"]:
        click.echo(f"\nactivations not measured (totals leave them out): the model's forward does "
                   f"not run on the meta device ({p['activations_unmeasured']})")
    click.echo(f"\ncheckpoint: {gib(p['checkpoint_bytes'])} (weights and AdamW state in fp32, each "
               "shard written once: replicas add nothing)")
    def nodes(n: int | None) -> str:
        return f"{n} ({n * p['gpus']} GPUs)" if n else "none up to 4096"

    click.echo(f"smallest node count that fits, full sharding: {nodes(p['min_nodes_full'])} with AC "
               f"{p['ac']}, {nodes(p['min_nodes_full_ac'])} with AC {p['ac_with']}")
    r = p["recommendation"]
    if r:
        # (both keys: a job's own shard or sharding would contradict the other one alone)
        how = (f"sharding=hybrid --set shard={r['shard']}" if r.get("shard")
               else f"sharding={r['sharding']} --set shard=0")
        click.echo(f"recommended: --set {how} --set ac={r['ac']} --set "
                   f"micro_batch_size={r['micro_batch']} ({gib(r['total'])} of {gib(p['gpu_mem'])}): "
                   f"{r['why']}")
    else:
        click.echo("recommended: does not fit on this shape; add nodes with full sharding "
                   "(see above), or lower the sequence length")
