"""CLI latency: `hpcshard --help` and `hpcshard render` against a bare `python -c pass`
(targets <= 3x and <= 5x: `--help` imports click and the lazy group only, `render` adds
jinja2 and the Slurm package, never submitit or torch), interleaved, medians of 15."""

from __future__ import annotations

from bench.common import PY, Metric, median, save, show, wall

NAME = "cli"


def main(repeats: int = 15) -> list[Metric]:
    cases = {"python -c pass": [PY, "-c", "pass"],
             "hpcshard --help": [PY, "-m", "hpcshard", "--help"],
             "hpcshard render": [PY, "-m", "hpcshard", "render", "jobs/charlm.py", "--nodes", "2",
                                 "--gpus", "2"]}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):  # interleaved: load changes hit every case alike
        for name, argv in cases.items():
            times[name].append(wall(argv))
    base = median(times["python -c pass"])
    metrics = [Metric(NAME, f"{k} (median of {repeats})", median(v) * 1e3, "ms") for k, v in times.items()]
    for name, target in (("hpcshard --help", 3.0), ("hpcshard render", 5.0)):
        ratio = median(times[name]) / base
        metrics.append(Metric(NAME, f"{name} / python -c pass", ratio, "x", f"<= {target:g}x",
                              ratio <= target))
    save(NAME, metrics, {"seconds": times})
    return metrics


if __name__ == "__main__":
    show(main())
