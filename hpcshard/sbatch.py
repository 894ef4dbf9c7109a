"""The sbatch script: a validated request rendered through a jinja2 template (login node).

`render` returns the text; `hpcshard render` prints it and `hpcshard submit` hands the very
same text to Slurm through submitit. Every user value reaches the script shell-quoted
(sbatch parses #SBATCH lines with shell quoting too); values that would break a line-based
directive (newlines, control characters) are refused.
"""

from __future__ import annotations

import re
import shlex
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jinja2

BUILTIN_TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
DEFAULT_TEMPLATE = "sbatch.j2"

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str) -> int:
    """A Slurm time limit in seconds, or ValueError naming the accepted formats."""
    m = _TIME.match(text.strip())
    if not m or not text.strip():
        raise ValueError(f"--time {text!r} is not a Slurm time limit; use MM, HH:MM:SS or "
                         "D-HH:MM:SS (e.g. 30, 04:00:00, 2-00:00:00)")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a or 0) * 3600 + (b or 0) * 60 + c
    return (a or 0) * 60 + (b or 0)  # M or M:S


def _single_line(name: str, value: str) -> None:
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{name}={value!r} contains a newline or control character; "
                         "an sbatch directive is one line")


@dataclass(kw_only=True)
class SbatchRequest:
    """Everything the template needs. Paths are absolute: the job starts elsewhere."""

    job_name: str
    nodes: int
    gpus_per_node: int
    time: str = "01:00:00"
    """Slurm time limit."""
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    cpus_per_task: int = 0
    """CPUs for each node's launcher and its ranks; 0 lets Slurm decide."""
    mem: str = ""
    """Memory per node, e.g. 200G; empty lets Slurm decide."""
    requeue: bool = True
    """--requeue in sbatch (off for the chain and none policies)."""
    signal: str = "USR2"
    """The preemption notice; the ranks checkpoint on it."""
    signal_lead_s: int = 120
    """Seconds before the time limit that the notice comes (it must cover a save)."""
    run_dir: Path = Path(".")
    env: dict[str, str] = field(default_factory=dict)
    """Variables exported before the launch (quoted)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the launch (a site's `module load ...`): not quoted."""
    template: str = DEFAULT_TEMPLATE

    def validate(self) -> None:
        for name in ("job_name", "time", "partition", "account", "qos", "constraint", "mem"):
            _single_line(name, getattr(self, name))
        _single_line("run_dir", str(self.run_dir))
        limit = parse_time(self.time)
        if self.signal_lead_s >= limit:
            raise ValueError(f"the notice lead time ({self.signal_lead_s} s) is not shorter than the "
                             f"time limit --time {self.time} ({limit} s); lower --signal-lead or "
                             "raise --time")
        name = self.signal if self.signal.startswith("SIG") else f"SIG{self.signal}"
        if not hasattr(signal.Signals, name):
            raise ValueError(f"signal {self.signal!r} is not a signal name; use e.g. USR2")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"environment variable name {key!r} is not valid")


def environment(search_path: list[Path] | None = None) -> jinja2.Environment:
    """Templates from the site directories first, then the built-in ones."""
    dirs = [*(search_path or []), BUILTIN_TEMPLATES]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(d) for d in dirs]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render(req: SbatchRequest, command: str, folder: Path,
           search_path: list[Path] | None = None) -> str:
    """The sbatch text. `command` and `folder` are submitit's: the srun line runs
    `submitit.core._submit` in every task, which calls hpcshard's per-node launcher."""
    req.validate()
    from submitit.core.utils import JobPaths  # small; keeps its log layout for `logs`

    paths = JobPaths(folder=folder)  # no ids: the %j_%t patterns submitit itself uses
    values: dict[str, Any] = {
        **asdict(req),
        "directives": {k: getattr(req, k) for k in ("partition", "account", "qos", "constraint")},
        "stdout": str(req.run_dir / "logs" / "slurm-%j.out"),
        "stderr": str(req.run_dir / "logs" / "slurm-%j.err"),
        "task_stdout": str(paths.stdout), "task_stderr": str(paths.stderr),
        "submitit_folder": str(folder), "command": command,
    }
    try:
        template = environment(search_path).get_template(req.template)
        return template.render(**values)
    except jinja2.TemplateNotFound as err:
        dirs = ", ".join(str(d) for d in [*(search_path or []), BUILTIN_TEMPLATES])
        raise ValueError(f"template {err.name!r} not found; searched: {dirs}") from None
    except jinja2.UndefinedError as err:
        raise ValueError(f"template {req.template!r}: {err.message}") from None
