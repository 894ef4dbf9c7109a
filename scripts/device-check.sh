#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the `device` tool: 16 cores, one GPU, Python 3.12
# and the image's own torch): the control-plane scale bench on 16 cores at N = 2 and 128
# (issue 27: the growth that a 2-core host cannot separate from its own load), then the GPU
# test layer (tests/gpu). Everything lands in $OUT (at most 8 files come back).
#
#   run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=400)
#
# .whl holds submitit's wheel (the image has no submitit) and torchao's for tests/gpu/test_fp8.py
# (0.17 pairs with the image's torch 2.11; without it that test skips):
#   pip download --no-deps -d .whl submitit==1.5.4 torchao==0.17.0
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
stamp() { echo "=== $(date +%T) $*"; }

stamp env
nproc; nvidia-smi -L
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"

# 1. Control plane (no strace there: the operation counts stay the 2-core host's). One
# invocation per N, so a timeout loses one N, not all.
for n in ${CONTROL_NODES-2 128}; do
  case $n in 128) t=100;; *) t=50;; esac
  stamp "control N=$n"
  timeout $t python3 -m bench.control --nodes $n --repeats 3 --coord store --no-traced-fault
  cp bench/results/control-store.json "$OUT/control-$n.json" 2>/dev/null
done

# 2. The GPU layer.
stamp "tests/gpu"
timeout 230 python3 -m pytest tests/gpu -n 3 -v -p no:cacheprovider --junitxml="$OUT/gpu.xml"
echo "rc=$?"
stamp done
