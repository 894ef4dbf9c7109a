"""A sweep's directory: `sweep.json` (the job, the configurations, the array jobs) and one
ordinary run directory per configuration, `task-INDEX` (every run command works on one).
A sweep split into several arrays (`slurm.arrays`) has one `.array-K` directory per array
after the first, whose `task-INDEX` links to the sweep's task it runs: the array's batch
logs (`--output RUN_DIR/task-%a/...`, Slurm's own pattern, which cannot add an offset)
land in the task's own directory. Stdlib only."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SWEEP = "sweep.json"


@dataclass
class Sweep:
    job: str
    name: str
    backend: str
    configs: list[dict[str, str]]
    """Each task's --set values (its own; the common ones are in every task's spec)."""
    max_parallel: int = 0
    """Tasks at once; 0: as many as the cluster gives (Slurm)."""
    array: str = ""
    """The (first) Slurm array job's id; empty under the local backend."""
    created: float = field(default_factory=time.time)
    arrays: list[str] = field(default_factory=list)
    """Every array's job id, in order, when the sweep was split into several (task i is
    task i % array_size of arrays[i // array_size]); empty: one array, `array` (a record
    written before sweeps were split has only that)."""
    array_size: int = 0
    """Tasks per array (the last may have fewer); 0: one array."""

    @staticmethod
    def task_dir(root: Path, index: int) -> Path:
        return root / f"task-{index}"

    @staticmethod
    def array_dir(root: Path, part: int) -> Path:
        """Where array `part` (after the first, whose directory is the sweep's) finds its
        tasks' directories."""
        return root / f".array-{part}"

    @classmethod
    def link_tasks(cls, root: Path, part: int, first: int, count: int) -> Path:
        """Array `part`'s directory: its task-INDEX linked to the sweep's task-(first +
        INDEX) (relative links: the sweep's directory may be seen at another path)."""
        where = cls.array_dir(root, part)
        where.mkdir(exist_ok=True)
        for index in range(count):
            os.symlink(os.path.join("..", cls.task_dir(root, first + index).name), where / f"task-{index}")
        return where

    @property
    def array_jobs(self) -> list[str]:
        """Every array's job id, in order (none under the local backend)."""
        return self.arrays or ([self.array] if self.array else [])

    def task_of(self, job: str) -> int | None:
        """The sweep's task that Slurm job ARRAY_INDEX is (None: none of the sweep's)."""
        array, _, index = job.partition("_")
        jobs = self.array_jobs
        if array not in jobs or not index.isdigit():
            return None
        task = jobs.index(array) * self.array_size + int(index)
        return task if task < len(self.configs) else None

    def write(self, root: Path) -> None:
        tmp = root / f".{SWEEP}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(root / SWEEP)

    @classmethod
    def read(cls, root: Path) -> Sweep:
        """The record (a key this version does not know, a newer one's, is dropped)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads((root / SWEEP).read_text()).items() if k in known})


def is_sweep(path: Path) -> bool:
    return (path / SWEEP).is_file()


def label(config: dict[str, Any]) -> str:
    """lr=0.001,dim=64"""
    return ",".join(f"{key}={value}" for key, value in config.items()) or "(the job's own)"


def expand(grid: list[str], listed: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """Every combination of the `--grid KEY=V1,V2` axes (the first axis slowest), each
    on top of every configuration a file lists (none: one, the job's own). ValueError,
    naming the axis and the fix, for an axis that is not KEY=V1,... or repeats a key."""
    axes: dict[str, list[str]] = {}
    for item in grid:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--grid {item!r} is not KEY=V1,V2,...; write e.g. --grid lr=1e-3,3e-4")
        if key in axes:
            raise ValueError(f"--grid {key} is given twice; put all its values in one: "
                             f"--grid {key}={','.join(axes[key])},{values}")
        choices = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in choices):
            raise ValueError(f"--grid {item!r} has an empty value; list values separated by commas, "
                             f"e.g. --grid {key}=1e-3,3e-4")
        axes[key] = choices
    base = [{k: _text(v) for k, v in c.items()} for c in (listed if listed is not None else [{}])]
    combos = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    return [{**b, **c} for b in base for c in combos]


def read_configs(path: Path) -> list[dict[str, Any]]:
    """A file of configurations: a JSON list of objects ({"lr": 1e-3, "dim": 64}), or JSON
    lines, one object each."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"--configs {str(path)!r}: {err.strerror}; give a readable JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                data += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as err:
                raise ValueError(f"--configs {str(path)!r} line {number}: not JSON ({err.msg}); write "
                                 'a list of objects, e.g. [{"lr": 0.001}, {"lr": 0.0003}]') from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data or not all(isinstance(c, dict) for c in data):
        raise ValueError(f"--configs {str(path)!r} holds no configurations; write a list of objects, "
                         'e.g. [{"lr": 0.001}, {"lr": 0.0003}]')
    for i, config in enumerate(data):
        bad = next((k for k, v in config.items() if isinstance(v, (dict, list)) or v is None), None)
        if bad is not None:
            raise ValueError(f"--configs {str(path)!r}, configuration {i}: {bad} is "
                             f"{json.dumps(config[bad])}; give a number, a string or a boolean")
    return data


def _text(value: Any) -> str:
    """A file's JSON value as --set would write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
