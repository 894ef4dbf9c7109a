#!/usr/bin/env bash
# Why a rank on one CUDA GPU died at step 0 before its log opened (scripts/device-check.sh,
# first run on an H100): fork safety of the warm agent's imports, then the warm agent alone
# (torchelastic's own failure summary, faulthandler on), then the demo under plain torchrun.
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/diag.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
stamp() { echo "=== $(date +%T) $*"; }
HS=(python3 -c "from hpcshard.cli import main; main()")
hs() { "${HS[@]}" "$@"; }

stamp "fork after the warm agent's imports"
timeout 60 python3 - <<'EOF'
import os
import hpcshard.runtime.main  # noqa: F401  (what launch.warm imports before it forks)
import torch
print("cuda initialised in the parent:", torch.cuda.is_initialized())
pid = os.fork()
if pid == 0:
    try:
        x = torch.ones(4, device="cuda") * 2
        print("child:", x.sum().item(), torch.cuda.get_device_name(0), flush=True)
        os._exit(0)
    except BaseException as err:
        print("child failed:", type(err).__name__, err, flush=True)
        os._exit(3)
print("child status:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
EOF

stamp "warm demo, 1 rank, faulthandler on"
timeout 60 "${HS[@]}" submit --backend local --nodes 1 --gpus 1 jobs/charlm.py --run-dir /tmp/runs/warm \
  --set steps=10 --set log_every=5 --max-restarts 0 2>&1 | head -80
ls -la /tmp/runs/warm/logs; tail -50 /tmp/runs/warm/logs/* 2>/dev/null
stamp "the warm agent alone on that run directory"
timeout 60 python3 -m hpcshard.launch.warm --nnodes=1 --nproc_per_node=1 --rdzv_backend=static \
  --node_rank=0 --rdzv_endpoint=127.0.0.1:29561 --rdzv_id=diag --max_restarts=0 /tmp/runs/warm 2>&1 | tail -60
tail -40 /tmp/runs/warm/logs/* 2>/dev/null

stamp "demo bf16 under plain torchrun (HPCSHARD_WARM_START=0)"
export HPCSHARD_WARM_START=0
timeout 100 "${HS[@]}" submit --backend local --nodes 1 --gpus 1 jobs/charlm.py --run-dir /tmp/runs/bf16 \
  --set steps=60 --set precision=bf16 --set ac=full --set ckpt_every=30 --set eval_every=30 \
  --set log_every=10 2>&1 | tail -40
hs status /tmp/runs/bf16; tail -30 /tmp/runs/bf16/logs/rank-0.log 2>/dev/null
stamp "fp16 + compile + async saves, plain torchrun"
timeout 100 "${HS[@]}" submit --backend local --nodes 1 --gpus 1 jobs/charlm.py --run-dir /tmp/runs/fp16 \
  --set steps=60 --set precision=fp16 --set compile=true --set async_save=true --set ckpt_every=20 \
  --set eval_every=30 --set log_every=10 2>&1 | tail -30
hs status /tmp/runs/fp16
stamp done
tar czf "$OUT/runs.tgz" -C /tmp runs --exclude='*.distcp' 2>/dev/null
