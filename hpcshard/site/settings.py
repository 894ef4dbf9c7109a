"""The settings registry: every setting a site, user or project file (and the command
line) may set, with its kind, default, help and check, in one place. The click options'
help, `hpcshard config show`, the admin guide's table and validation all come from here.
Stdlib (and `slurm.time`/`slurm.sbatch` for Slurm's own formats)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcshard.rundir.rankenv import NOTICE, SCRIPT_SIGNALS, STOP_SIGNALS
from hpcshard.rundir.spec import POLICIES, SCRIPT_GRACE_S
from hpcshard.slurm.poll import POLL_MAX_S, POLL_S
from hpcshard.slurm.sbatch import received_names
from hpcshard.slurm.time import parse_mem, parse_time

BACKENDS = ("auto", "local", "slurm")
CONTAINER_RUNTIMES = ("pyxis", "apptainer")
MERGED = ("env", "vars", "train")
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


def _group(value: str) -> None:
    # Checked as a name only: whether it exists and the user is in it is asked at submit,
    # by the user it concerns (a site profile is read by users of other groups too).
    if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*\$?", value):
        raise ValueError("give a Unix group name (letters, digits, _ . -), as `id -Gn` shows it")


def _env_names(value: dict[str, Any]) -> None:
    for key in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{key!r} is not a valid environment variable name")


def _secret_names(value: list[str]) -> None:
    for key in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"secrets: {key!r} is not a valid environment variable name")


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


def _train_keys(value: dict[str, Any]) -> None:
    from hpcshard.config import TrainConfig  # (stdlib; imported when a profile sets any)

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in value:
        if key not in known:
            raise ValueError(f"{key!r} is not a training setting of every job; valid keys: "
                             f"{', '.join(sorted(known))}")


@dataclass(frozen=True)
class Setting:
    """One setting: what the files accept, the command line's option (`cli.options`) and the
    admin guide's row all come from here."""

    kind: str
    """str, int, list (of str), env (table of scalars), vars (table), container (table),
    sets (table of scalars, as --set KEY=VALUE would give them)."""
    default: Any
    help: str
    check: Callable[[Any], None] | None = None
    """A check beyond the kind, the choices and the minimum (ValueError saying why)."""
    choices: tuple[str, ...] = ()
    """The values a str setting may take (a click.Choice on the command line)."""
    minimum: int | None = None
    """The least an int setting may be (a click.IntRange on the command line)."""
    unset: str = ""
    """What an empty default means, for help texts (e.g. "Slurm's")."""
    option: str = ""
    """Its command-line option (`submit`, `render`), if it has one."""

    def validate(self, value: Any) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{value} is less than {self.minimum}")
        if self.check is not None:
            self.check(value)


SETTINGS: dict[str, Setting] = {
    "description": Setting("str", "", "One line shown by `hpcshard profiles list`."),
    "backend": Setting("str", "auto", "Where the run goes: auto (Slurm when a controller answers), "
                       "local (emulated nodes on this machine) or slurm.", choices=BACKENDS,
                       option="--backend"),
    "partition": Setting("str", "", "Slurm partition.", unset="the cluster's default",
                         option="--partition"),
    "account": Setting("str", "", "Slurm account.", unset="none", option="--account"),
    "qos": Setting("str", "", "Slurm QOS.", unset="none", option="--qos"),
    "constraint": Setting("str", "", "Slurm node constraint (features), e.g. a100&ib.",
                          unset="none", option="--constraint"),
    "gpus_per_node": Setting("int", 1, "GPUs per node, one rank each (CPU processes where there "
                             "is no GPU).", minimum=1, option="--gpus"),
    "cpus_per_gpu": Setting("int", 0, "CPUs per GPU (the node's launcher gets them all); 0: Slurm's.",
                            minimum=0, option="--cpus-per-gpu"),
    "mem": Setting("str", "", "Memory per node, e.g. 200G or 0 (all of it).", _mem,
                   unset="Slurm's", option="--mem"),
    "time": Setting("str", "01:00:00", "Time limit per attempt (MM, HH:MM:SS, D-HH:MM:SS).",
                    _time, option="--time"),
    "max_time": Setting("str", "", "Longest --time the profile accepts.", _time, unset="no limit"),
    "modules": Setting("list", [], "Environment modules loaded first (`module load ...`)."),
    "env": Setting("env", {}, "Variables exported in the job (NCCL/network settings).", _env_names),
    "setup": Setting("list", [], "Shell lines run after modules and env (e.g. source a venv)."),
    "secrets": Setting("list", [], "Environment variables the job takes from the submitting "
                       "environment by name only (API keys, tokens: WANDB_API_KEY, HF_TOKEN): each "
                       "must be set at submit; the value is never written into the script or the "
                       "run directory.", _secret_names),
    "container": Setting("container", {}, "Run every node's launcher in a container: "
                         "runtime (pyxis|apptainer), image, mounts, workdir, options."),
    "python": Setting("str", "", "Python interpreter on the compute nodes (inside the container).",
                      unset="the one running hpcshard"),
    "signal": Setting("str", NOTICE, "The preemption notice Slurm sends before the time limit.",
                      _signal),
    "signal_lead": Setting("int", 120, "Seconds before the time limit that the notice comes (it "
                           "must cover a checkpoint save).", minimum=1, option="--signal-lead"),
    "script_signal": Setting("str", "TERM", "Scripts (not hpcshard jobs): the signal each rank "
                             "gets when the notice comes, the one its framework listens to; "
                             "none: nothing.", choices=SCRIPT_SIGNALS, option="--script-signal"),
    "script_grace": Setting("int", SCRIPT_GRACE_S, "Scripts: seconds after the notice before the ranks are "
                            "killed and the job requeued (keep it below signal_lead).", minimum=0,
                            option="--grace"),
    "code": Setting("str", "snapshot", "The job's code: snapshot (its workspace, the git repository "
                    "or the job's directory, is copied into the run directory at submit, and every "
                    "start of the run runs that copy) or live (each start imports what is there "
                    "then).", choices=("snapshot", "live"), option="--code"),
    "code_max_mb": Setting("int", 100, "The most a snapshot of the job's workspace may copy (MB); "
                           "more is refused, naming the largest files.", minimum=1),
    "requeue_policy": Setting("str", "chain", "After a clean stop: chain a continuation job "
                              "(afterany: the fastest road back, measured), requeue the job "
                              "(scontrol requeue: waits requeue_delay), or none.",
                              choices=POLICIES, option="--requeue-policy"),
    "max_requeues": Setting("int", 10, "Restarts after stop requests (preemptions) before the run "
                            "gives up.", minimum=0, option="--max-requeues"),
    "max_restarts": Setting("int", 3, "In-place restarts of the ranks per allocation after a "
                            "fault (a crashed or hung rank); once spent while training advances, "
                            "the job goes back through the queue.", minimum=0,
                            option="--max-restarts"),
    "spares": Setting("int", 0, "Spare nodes allocated besides --nodes: each waits, and takes "
                      "the place of a node that is lost or fails its health check, inside the "
                      "allocation (the mesh keeps its shape; Slurm: the job gets --no-kill).",
                      minimum=0, option="--spares"),
    "min_nodes": Setting("int", 0, "Fewest nodes a run may go on with, inside the allocation, "
                         "after losing nodes it has no spare for (the mesh is planned again; "
                         "DCP reshards); 0: --nodes, i.e. never fewer (back through the queue "
                         "without the lost node instead).", minimum=0, option="--min-nodes"),
    "bad_nodes": Setting("str", "drain", "What else happens to a node a run declares bad (lost, "
                         "failed its health check): drain (also DRAIN it in Slurm with the reason, "
                         "where the user may: operators, root) or exclude (only this run avoids "
                         "it).", choices=("drain", "exclude")),
    "health_check": Setting("str", "", "A shell command every node's launcher runs before each "
                            "attempt trains (after its own checks: the run directory takes a "
                            "write and has room for a checkpoint); a non-zero exit makes the node "
                            "bad for the run: the job is requeued without it.", unset="none"),
    "no_progress_restarts": Setting("int", 2, "Stop after this many restarts in a row that did "
                                    "not advance the committed checkpoint.", minimum=1),
    "train": Setting("sets", {}, "Training settings every hpcshard job of the profile gets, "
                     "as --set KEY=VALUE would give them (e.g. watchdog_floor_s = 30, nan_policy "
                     "= \"rollback\"); a job's own --set wins. Scripts ignore them.", _train_keys),
    "storage_root": Setting("str", "runs", "Where run directories go (shared storage seen by "
                            "every node); ~ and $VARS expand, relative paths are from the "
                            "current directory."),
    "run_group": Setting("str", "", "The Unix group run directories are shared with, for a "
                         "project whose members share runs: each run directory is made owned by "
                         "it, mode 2770, and checkpoint files that group owns are loaded though "
                         "another member wrote them (a checkpoint is a pickle: code runs when it "
                         "loads). You must be in the group.", _group,
                         unset="private (run directories 0700; only your own checkpoint files "
                         "load)"),
    "poll_s": Setting("int", POLL_S, "Seconds between two polls of Slurm by a command that follows jobs "
                      "(`submit --follow`, `logs -f`, `status SWEEP --follow`): one squeue or scontrol "
                      "call a poll for all its jobs, the interval doubling while nothing changes.",
                      minimum=1),
    "poll_max_s": Setting("int", POLL_MAX_S, "The longest interval between two polls of Slurm (`poll_s` "
                          "doubles up to it while the jobs followed do not change; a change brings "
                          "it back to `poll_s`).", minimum=1),
    "template": Setting("str", "sbatch.j2", "The sbatch template, found on the template path."),
    "vars": Setting("vars", {}, "Extra variables for site templates.", _var_names),
}

CONTAINER_KEYS = {"runtime": "str", "image": "str", "mounts": "list", "workdir": "str",
                  "options": "list"}
TOP_KEYS = ("profile", "template_dirs", "defaults", "profiles")


def markdown_table() -> str:
    """The admin guide's table of settings (docs/admins.md; a unit test keeps it current)."""
    rows = ["| setting | type | default | command line | meaning |", "|---|---|---|---|---|"]
    for key, s in SETTINGS.items():
        default = json.dumps(s.default)
        meaning = s.help.replace("|", "\\|")
        if s.choices:
            meaning += " One of: " + ", ".join(f"`{c}`" for c in s.choices) + "."
        if s.unset:
            meaning += f" Empty: {s.unset}."
        rows.append(f"| `{key}` | {s.kind} | `{default}` | {f'`{s.option}`' if s.option else ''} "
                    f"| {meaning} |")
    return "\n".join(rows) + "\n"
