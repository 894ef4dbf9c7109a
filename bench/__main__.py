"""`python -m bench [NAME ...]`: run the benchmarks (all by default), print each table, and
merge the results into bench/results/latest.json and latest.md. `python -m bench gpu
[--quick] [--out DIR]` takes options of its own (bench/gpu.py)."""

from __future__ import annotations

import sys
import time

from bench import (
    chaos,
    checkpoint,
    cli_latency,
    control,
    coord_scale,
    data,
    faults,
    gpu,
    loss,
    nfs,
    nodes,
    overhead,
    owner,
    polling,
    prepare,
    pretrained,
    requeue,
    resume,
    scaling,
    tp,
)
from bench.common import RESULTS, show

BENCHES = {"overhead": overhead, "checkpoint": checkpoint, "resume": resume, "requeue": requeue,
           "cli": cli_latency, "scaling": scaling, "faults": faults,
           "nodes": nodes, "chaos": chaos, "tp": tp, "pretrained": pretrained, "owner": owner,
           "control": control, "coord": coord_scale, "nfs": nfs, "data": data,
           "prepare": prepare, "loss": loss, "polling": polling, "gpu": gpu}


def main(names: list[str]) -> int:
    if names[:1] == ["gpu"]:  # its options: python -m bench gpu --quick --out DIR
        return gpu.cli(names[1:])
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; choose from: {', '.join(BENCHES)}",
              file=sys.stderr)
        return 2
    for name in names or list(BENCHES):
        start = time.perf_counter()
        print(f"{name}:", flush=True)
        show(BENCHES[name].main())
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nresults: {RESULTS / 'latest.json'}, {RESULTS / 'latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
