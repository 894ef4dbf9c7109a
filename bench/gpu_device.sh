#!/usr/bin/env bash
# The GPU layer and the GPU bench on a lent GPU machine, as one command (issue 30 items 3
# and 5): tests/gpu (JUnit report and log), then `python -m bench gpu --quick`, everything
# in $OUT (6 files: device.log, gpu-tests.log, gpu-junit.xml, gpu-bench.md, gpu-bench.json,
# bench.log). About 6-8 minutes on an H100; each part has its own time limit and a
# failure in one does not stop the next.
#
#   run(command="bash bench/gpu_device.sh", carry=[".whl"], timeout_s=580)
#
# The machine has torch (2.11 + CUDA), Triton, transformers (so tokenizers), pytest,
# pytest-timeout, pytest-xdist and no network; .whl carries what it lacks (submitit,
# torchao; torchtitan 0.2.0 for the bench's torchtitan row, with the pure-Python packages it
# imports that the image may lack: bench/titan.py stands in for datasets and TensorBoard
# where they are missing):
#   pip download --no-deps -d .whl submitit==1.5.4 torchao==0.17.0 torchtitan==0.2.0 \
#     torchdata==0.11.0 tyro==1.0.17 docstring-parser typeguard typing_extensions
# hpcshard is not installed there: it runs from this checkout (PYTHONPATH), and `hpcshard`
# on PATH is a wrapper around `python3 -m hpcshard` (the tests call `python -m hpcshard`
# themselves; the wrapper is for anything that looks for the command).
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-out}
TESTS_S=${TESTS_S:-300}
WORKERS=${WORKERS:-4}
BENCH_S=${BENCH_S:-210}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
stamp() { echo "=== $(date +%T) $*"; }

stamp setup
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || echo "wheels: install failed (rc=$?)"
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m hpcshard "$@"\n' > /tmp/bin/hpcshard
chmod +x /tmp/bin/hpcshard
export PATH=/tmp/bin:$PATH
# `python` for anything that asks for it by that name (the tests use sys.executable)
command -v python >/dev/null || ln -sf "$(command -v python3)" /tmp/bin/python

stamp environment
nproc
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi failed"
python3 - <<'EOF' || echo "versions: failed"
import importlib, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
for name in ("transformers", "triton", "submitit", "torchao", "pytest", "pytest_timeout", "xdist",
             "torchtitan", "torchdata", "tyro", "datasets", "tensorboard"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as err:
        print(name, "missing:", type(err).__name__, err)
import inspect
import torch.distributed.checkpoint.staging as staging
print("DefaultStager._stage closes its copier (pytorch#183413):",
      "_state_dict_stager.close()" in inspect.getsource(staging.DefaultStager._stage))
EOF
hpcshard --version 2>/dev/null || hpcshard --help | head -3

stamp "tests/gpu (limit ${TESTS_S}s)"
# 4 workers share the GPU (the suite's runs are small); 200 s per test at most (pytest-
# timeout's thread method: a hung test ends its worker, which xdist replaces).
timeout -k 10 "$TESTS_S" python3 -m pytest tests/gpu -p no:cacheprovider -v -rfEsxX -n "$WORKERS" \
  -o timeout=200 -o timeout_method=thread --junitxml="$OUT/gpu-junit.xml" 2>&1 | tee "$OUT/gpu-tests.log"
echo "tests rc=$?"

stamp "bench gpu --quick (limit ${BENCH_S}s)"
timeout -k 10 "$BENCH_S" python3 -m bench gpu --quick --budget $((BENCH_S - 25)) --out "$OUT" 2>&1 \
  | tee "$OUT/bench.log"
echo "bench rc=$?"
ls -la "$OUT"
stamp done
