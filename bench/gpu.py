"""`python -m bench gpu [--quick] [--out DIR] [--budget S]`: throughput and MFU on one GPU,
side by side in one session: the demo and a Llama-shaped job (bench/llama.py, 1.0B
parameters, seq 2048) through hpcshard (`submit --backend local`, 1 x 1, bf16), the same
jobs through a minimal FSDP2 loop in one process (bench/minimal_gpu.py), and torchtitan's
trainer where it is installed. Writes gpu-bench.md and gpu-bench.json to DIR (default
bench/results). Without a GPU: one line, exit 2.

hpcshard's figures are its own metrics records (median of those after the warm-up); the
minimal loop's are timed between its warm-up and its last step. Each part has its share
of the time budget; a part that fails or runs out is reported as such, and the results
are written after every part (a kill leaves what was done)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PY, RESULTS, ROOT, Metric, env, records

NAME = "gpu"
DEMO = {"precision": "bf16"}
LLAMA = {"precision": "bf16", "dim": "2048", "n_layers": "16", "n_heads": "16", "seq_len": "2048",
         "batch_size": "8", "vocab_size": "32000", "lr": "3e-4"}
"""Llama-shaped, 1.0B parameters (Llama 2's vocabulary and SwiGLU width rule, 16 layers of
2048): large enough to load an H100's matmuls, built and run in about a minute."""
SIZES = {True: {"demo": (60, 20), "llama": (30, 10)}, False: {"demo": (200, 50), "llama": (60, 20)}}
"""quick -> {job: (steps, warm-up steps)}"""


def kind(job: str) -> str:
    return "llama" if "llama" in job else "demo"


def no_gpu() -> str:
    """Why this machine cannot run it ("" when it can). No device node and no nvidia-smi
    is answered before torch is imported (a second, not three)."""
    if not Path("/dev/nvidiactl").exists() and not shutil.which("nvidia-smi"):
        return "no NVIDIA device here (/dev/nvidiactl, nvidia-smi)"
    import torch

    return "" if torch.cuda.is_available() else f"torch {torch.__version__} sees no CUDA device"


class Session:
    """One bench session: its budget, its device, what each part found, and the files."""

    def __init__(self, out: Path, quick: bool, budget: float) -> None:
        import torch

        from hpcshard.runtime.device import device_peak_tflops

        self.out, self.quick, self.deadline = out, quick, time.monotonic() + budget
        self.device = torch.cuda.get_device_name(0)
        self.peak = device_peak_tflops(torch.device("cuda", 0)) * 1e12
        self.memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
        self.about = {"device": self.device, "torch": torch.__version__, "python": sys.version.split()[0],
                      "time": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick,
                      "peak_tflops": self.peak / 1e12, "memory_gb": round(self.memory_gb, 1)}
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def left(self, share: float) -> float:
        """Seconds for the next part: `share` of what is left, at least 30."""
        return max(30.0, (self.deadline - time.monotonic()) * share)

    def hpcshard(self, job: str, sets: dict[str, str], tmp: Path, share: float) -> None:
        steps, warm = SIZES[self.quick][kind(job)]
        run = tmp / Path(job).stem
        argv = [PY, "-m", "hpcshard", "submit", "--backend", "local", "--nodes", "1", "--gpus", "1", job,
                "--run-dir", str(run), "--max-restarts", "0"]
        for k, v in {**sets, "steps": str(steps), "log_every": "5", "eval_every": "0",
                     "ckpt_every": "100000", "warmup_steps": str(warm)}.items():
            argv += ["--set", f"{k}={v}"]
        row: dict[str, Any] = {"job": job, "runner": "hpcshard", "sets": sets, "steps": steps, "warmup": warm}
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=env(OMP_NUM_THREADS="8"), capture_output=True,
                                  text=True, timeout=self.left(share))
            after = [r for r in records(run) if r.get("tokens_per_s") and r["step"] > warm]
            if proc.returncode or not after:
                log = run / "logs" / "rank-0.log"
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-600:]} "
                                   f"{log.read_text()[-600:] if log.exists() else ''}")
            row.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in after),
                       mfu=statistics.median(r["mfu"] for r in after)
                       if after[0].get("mfu") is not None else None,
                       peak_mem_gb=max(r["peak_mem_gb"] for r in after), records=len(after))
        except (subprocess.TimeoutExpired, RuntimeError, OSError) as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:900]}"
        row["wall_s"] = round(time.monotonic() - started, 1)
        self.rows.append(row)

    def minimal(self, jobs: list[tuple[str, dict[str, str]]], share: float) -> None:
        argv = [PY, "-m", "bench.minimal_gpu"]
        for n, (job, sets) in enumerate(jobs):
            steps, warm = SIZES[self.quick][kind(job)]
            argv += ["--job", job, "--steps", str(steps), "--warmup", str(warm)]
            argv += [a for k, v in sets.items() for a in ("--set", f"{n}:{k}={v}")]
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=env(OMP_NUM_THREADS="8"), capture_output=True,
                                  text=True, timeout=self.left(share))
            lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
            if proc.returncode and len(lines) < len(jobs):
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-900:]}")
            for line in lines:
                steps, warm = SIZES[self.quick][kind(line["job"])]
                self.rows.append({"job": line["job"], "runner": "minimal FSDP2", "steps": steps,
                                  "warmup": warm,
                                  "tokens_per_s": line["tokens_per_s"],
                                  "mfu": line["tokens_per_s"] * line["flops_per_token"] / self.peak
                                  if self.peak else None,
                                  "peak_mem_gb": line["peak_mem_gb"], "params": line["params"]})
        except (subprocess.TimeoutExpired, RuntimeError, OSError, ValueError) as err:
            self.rows.append({"job": "+".join(j for j, _ in jobs), "runner": "minimal FSDP2",
                              "error": f"{type(err).__name__}: {str(err)[:900]}"})
        self.notes.append(f"minimal loop: {time.monotonic() - started:.0f} s for both jobs in one process")

    def torchtitan(self, llama: dict[str, str], share: float) -> None:
        """torchtitan's own trainer on the Llama's shape (bench/titan.py) where torchtitan
        imports; a line saying why not where it does not."""
        probe = subprocess.run([PY, "-c", "import importlib.metadata as m; print(m.version('torchtitan'))"],
                               capture_output=True, text=True, timeout=60, env=env())
        if probe.returncode:
            self.notes.append("torchtitan: not installed, not run (bench/gpu_device.sh says which wheels "
                              "carry it)")
            return
        steps, warm = SIZES[self.quick]["llama"]
        argv = [PY, "-m", "bench.titan", *titan_args(llama, steps, warm)]
        row: dict[str, Any] = {"job": "bench/llama.py", "runner": "torchtitan", "steps": steps,
                               "warmup": warm}
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=env(OMP_NUM_THREADS="8"), capture_output=True,
                                  text=True, timeout=self.left(share))
            last = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith('{"summary"')]
            if proc.returncode or not last:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-900:]}")
            out = last[0]
            row.update(tokens_per_s=out["tokens_per_s"], titan_mfu=out["mfu"], peak_mem_gb=out["peak_mem_gb"],
                       params=out["params"], records=out["records"],
                       mfu=out["tokens_per_s"] * out["flops_per_token"] / self.peak if self.peak else None)
            self.notes.append(titan_note(out))
        except (subprocess.TimeoutExpired, RuntimeError, OSError, ValueError, KeyError) as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:900]}"
        row["wall_s"] = round(time.monotonic() - started, 1)
        self.rows.append(row)

    def plan_llama(self) -> dict[str, Any]:
        """`hpcshard plan` for the Llama job on this GPU: AC only if it does not fit without."""
        from hpcshard.runtime.planner import make_plan

        plan = make_plan(job=str(ROOT / "bench" / "llama.py"), sets=LLAMA, numbers={}, hf_config=None,
                         nodes=1, gpus=1, sharding="auto", precision=None, ac=None, micro_batch=None,
                         gpu_mem=int(self.memory_gb * 2**30))
        mode = plan["modes"][plan["sharding"]]
        return {"total_gb": mode["total"] / 2**30, "total_ac_gb": mode["total_ac"] / 2**30,
                "fits": mode["fits"], "params": plan["model"]["params"]}

    def write(self) -> None:
        base = {r["job"]: r for r in self.rows if r["runner"] == "minimal FSDP2" and "tokens_per_s" in r}
        for r in self.rows:
            if r["runner"] != "minimal FSDP2" and r["job"] in base and "tokens_per_s" in r:
                r["vs_minimal"] = r["tokens_per_s"] / base[r["job"]]["tokens_per_s"]
        self.out.mkdir(parents=True, exist_ok=True)
        data = {**self.about, "rows": self.rows, "notes": self.notes}
        (self.out / "gpu-bench.json").write_text(json.dumps(data, indent=2) + "\n")
        (self.out / "gpu-bench.md").write_text(markdown(data))

    def metrics(self) -> list[Metric]:
        return [Metric(NAME, f"{r['runner']} {Path(r['job']).stem} tokens/s", r["tokens_per_s"], "tokens/s",
                       note=f"MFU {100 * r['mfu']:.3g}%" if r.get("mfu") else "")
                for r in self.rows if "tokens_per_s" in r]


def titan_args(llama: dict[str, str], steps: int, warm: int) -> list[str]:
    """bench/titan.py's arguments for the Llama job's settings: the same shape, batch,
    sequence, learning rate, warm-up and AC, a record every 5 steps as hpcshard's."""
    return ["--dim", llama["dim"], "--layers", llama["n_layers"], "--heads", llama["n_heads"],
            "--vocab", llama["vocab_size"], "--seq", llama["seq_len"], "--batch", llama["batch_size"],
            "--lr", llama["lr"], "--steps", str(steps), "--warmup", str(warm), "--log-every", "5",
            "--ac", llama.get("ac", "none")]


def titan_note(out: dict[str, Any]) -> str:
    """What torchtitan's row is, in one line."""
    stood = f"; stand-ins for {', '.join(out['stand_ins'])} (imported by torchtitan, unused here)" \
        if out.get("stand_ins") else ""
    return (f"torchtitan {out['torchtitan']}: its Trainer and llama3 model at the Llama's shape "
            f"({out['params'] / 1e9:.2f}B parameters), synthetic tokens; "
            f"on one GPU it does not shard: fp32 parameters under bf16 autocast; its own MFU figure "
            f"{100 * out['mfu']:.3g}% (its peak table){stood}")


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# `python -m bench gpu{' --quick' if data['quick'] else ''}`", "",
             f"{data['time']}: {data['device']} ({data['memory_gb']} GiB, {data['peak_tflops']:g} dense bf16 "
             f"TFLOP/s for MFU), torch {data['torch']}, Python {data['python']}.", "",
             "| job | runner | tokens/s | MFU | peak GiB | runner / minimal | steps (warm-up) |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['job']} | {r['runner']} | failed: {r['error'][:300]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.3g}%" if r.get("mfu") is not None else "n/a"
        ratio = f"{r['vs_minimal']:.3f}" if "vs_minimal" in r else ""
        lines.append(f"| {r['job']} | {r['runner']} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['peak_mem_gb']:.2f} | {ratio} | {r.get('steps', '')} ({r.get('warmup', '')}) |")
    lines += [""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def session(out: Path, quick: bool, budget: float) -> Session:
    s = Session(out, quick, budget)
    llama = dict(LLAMA)
    try:
        plan = s.plan_llama()
        if not plan["fits"]:
            llama["ac"] = "full"
        s.notes.append(f"llama: {plan['params'] / 1e9:.2f}B parameters; `hpcshard plan` gives "
                       f"{plan['total_gb']:.1f} GiB without AC, {plan['total_ac_gb']:.1f} GiB with "
                       f"(1 GiB reserve included): ac={llama.get('ac', 'none')}")
    except Exception as err:  # the bench goes on without the plan: say why
        s.notes.append(f"llama: the plan failed ({type(err).__name__}: {err}); ac=full")
        llama["ac"] = "full"
    s.about["llama"] = llama
    jobs = [("jobs/charlm.py", DEMO), ("bench/llama.py", llama)]
    with tempfile.TemporaryDirectory(prefix="hpcshard-bench-gpu-") as tmp:
        for share, (job, sets) in zip((0.3, 0.45), jobs, strict=True):
            s.hpcshard(job, sets, Path(tmp), share)
            s.write()
        s.minimal(jobs, 0.5)
        s.write()
        s.torchtitan(llama, 0.9)
        s.write()
    return s


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps: about 2-3 minutes on an H100")
    p.add_argument("--out", type=Path, default=RESULTS, help="where gpu-bench.md and .json go")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole bench "
                   "[default: 170 with --quick, else 420]")
    args = p.parse_args(argv)
    why = no_gpu()
    if why:
        print(f"bench gpu needs one CUDA GPU: {why}", file=sys.stderr)
        return 2
    s = session(args.out, args.quick, args.budget or (170 if args.quick else 420))
    for r in s.rows:
        print(f"  {r['runner']:<14} {r['job']:<16} " + (f"failed: {r['error'][:200]}" if "error" in r else
              f"{r['tokens_per_s']:>12,.0f} tokens/s  MFU {100 * (r.get('mfu') or 0):5.1f}%  "
              f"peak {r['peak_mem_gb']:.2f} GiB" + (f"  x{r['vs_minimal']:.3f} of minimal"
                                                    if "vs_minimal" in r else "")), flush=True)
    for n in s.notes:
        print(f"  {n}")
    print(f"results: {args.out / 'gpu-bench.md'}, {args.out / 'gpu-bench.json'}")
    return 1 if any("error" in r for r in s.rows) else 0


def main() -> list[Metric]:
    """For `python -m bench` (all): skipped, with a line, where there is no GPU."""
    why = no_gpu()
    if why:
        print(f"  skipped: {why}")
        return []
    return session(RESULTS, quick=True, budget=170).metrics()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(cli(sys.argv[1:]))
