"""The settings registry: every setting a site, user or project file (and the command
line) may set, with its kind, default, help and check, in one place. The click options'
help, `hpcshard config show`, the admin guide's table and validation all come from here.
Stdlib (and `slurm.time`/`slurm.sbatch` for Slurm's own formats)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcshard.rundir.rankenv import SCRIPT_SIGNALS, STOP_SIGNALS
from hpcshard.rundir.spec import POLICIES
from hpcshard.slurm.sbatch import received_names
from hpcshard.slurm.time import parse_mem, parse_time

BACKENDS = ("auto", "local", "slurm")
CONTAINER_RUNTIMES = ("pyxis", "apptainer")
MERGED = ("env", "vars")
"""Table settings merged key by key across layers (others are replaced whole)."""


def _time(value: str) -> None:
    if value:
        parse_time(value)


def _mem(value: str) -> None:
    if value:
        parse_mem(value)


def _signal(value: str) -> None:
    if value not in STOP_SIGNALS:
        raise ValueError("use USR1 or USR2: torchrun takes TERM, INT, HUP and QUIT for itself "
                         "(it tears the ranks down on them, mid-save), and other signals mean "
                         "something else to the processes of a job")


def _choice(options: tuple[str, ...]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
    return check


def _at_least(low: int) -> Callable[[int], None]:
    def check(value: int) -> None:
        if value < low:
            raise ValueError(f"{value} is less than {low}")
    return check


def _env_names(value: dict[str, Any]) -> None:
    for key in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{key!r} is not a valid environment variable name")


def _var_names(value: dict[str, Any]) -> None:
    for key, v in value.items():
        items = v if isinstance(v, list) else [v]
        if not all(isinstance(x, str | int | float | bool) for x in items):
            raise ValueError(f"vars.{key} must be a string, number, boolean or a list of them "
                             f"(not {type(v).__name__}): the run directory stores it as JSON")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{key!r} is not a valid template variable name")
        if key in SETTINGS or key in received_names():
            raise ValueError(f"{key!r} is already a template variable of hpcshard; pick another name")


@dataclass(frozen=True)
class Setting:
    kind: str
    """str, int, list (of str), env (table of scalars), vars (table), container (table)."""
    default: Any
    help: str
    check: Callable[[Any], None] | None = None


SETTINGS: dict[str, Setting] = {
    "description": Setting("str", "", "One line shown by `hpcshard profiles list`."),
    "backend": Setting("str", "auto", "auto (Slurm when a controller answers), local or slurm.",
                       _choice(BACKENDS)),
    "partition": Setting("str", "", "Slurm partition; empty: the cluster's default."),
    "account": Setting("str", "", "Slurm account."),
    "qos": Setting("str", "", "Slurm QOS."),
    "constraint": Setting("str", "", "Slurm node constraint (features), e.g. a100&ib."),
    "gpus_per_node": Setting("int", 1, "GPUs per node, one rank each; the default for --gpus.",
                             _at_least(1)),
    "cpus_per_gpu": Setting("int", 0, "CPUs per GPU (the node's launcher gets them all); 0: Slurm's.",
                            _at_least(0)),
    "mem": Setting("str", "", "Memory per node, e.g. 200G or 0 (all of it); empty: Slurm's.",
                   _mem),
    "time": Setting("str", "01:00:00", "Default time limit per attempt.", _time),
    "max_time": Setting("str", "", "Longest --time the profile accepts; empty: no limit.", _time),
    "modules": Setting("list", [], "Environment modules loaded first (`module load ...`)."),
    "env": Setting("env", {}, "Variables exported in the job (NCCL/network settings).", _env_names),
    "setup": Setting("list", [], "Shell lines run after modules and env (e.g. source a venv)."),
    "container": Setting("container", {}, "Run every node's launcher in a container: "
                         "runtime (pyxis|apptainer), image, mounts, workdir, options."),
    "python": Setting("str", "", "Python interpreter on the compute nodes (inside the container); "
                      "empty: the one running hpcshard."),
    "signal": Setting("str", "USR2", "The preemption notice Slurm sends before the time limit.",
                      _signal),
    "signal_lead": Setting("int", 120, "Seconds before the time limit that the notice comes.",
                           _at_least(1)),
    "script_signal": Setting("str", "TERM", "What a script (not an hpcshard job) is sent when "
                             "the notice comes: TERM, INT, HUP, USR1, USR2 or none, whichever its "
                             "framework listens to.", _choice(SCRIPT_SIGNALS)),
    "script_grace": Setting("int", 60, "Seconds a script has after the notice before its ranks "
                            "are killed and the job requeued (keep it below signal_lead).",
                            _at_least(0)),
    "requeue_policy": Setting("str", "requeue", "After a clean stop: requeue, chain (a "
                              "continuation job, where requeue is forbidden) or none.",
                              _choice(POLICIES)),
    "max_requeues": Setting("int", 10, "Restarts after stop requests before the run gives up.",
                            _at_least(0)),
    "storage_root": Setting("str", "runs", "Where run directories go (shared storage seen by "
                            "every node); ~ and $VARS expand, relative paths are from the "
                            "current directory."),
    "template": Setting("str", "sbatch.j2", "The sbatch template, found on the template path."),
    "vars": Setting("vars", {}, "Extra variables for site templates.", _var_names),
}

CONTAINER_KEYS = {"runtime": "str", "image": "str", "mounts": "list", "workdir": "str",
                  "options": "list"}
TOP_KEYS = ("profile", "template_dirs", "defaults", "profiles")
