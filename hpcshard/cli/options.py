"""The options `submit`, `render` and `resume` share. Options that are settings come from
the registry (`hpcshard.site.SETTINGS`: help, choices, bounds), so the command line, the
configuration files and the admin guide say the same thing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from hpcshard import site
from hpcshard.site.layers import show_value

F = TypeVar("F", bound=Callable[..., Any])

OPTION_SETTINGS = {s.option.lstrip("-").replace("-", "_"): key
                   for key, s in site.SETTINGS.items() if s.option}
"""Parameter name (--cpus-per-gpu -> cpus_per_gpu) -> the setting it sets."""


def setting_option(key: str) -> Callable[[F], F]:
    """The command-line option of a setting: the top layer of the configuration. Unset, the
    value comes from the profile and the files (`hpcshard config show`), then the default."""
    s = site.SETTINGS[key]
    kind: click.ParamType | None = None
    if s.choices:
        kind = click.Choice(s.choices, case_sensitive=key != "script_signal")
    elif s.kind == "int":
        kind = click.IntRange(min=s.minimum)
    default = s.unset if s.default in ("", [], {}) and s.unset else show_value(s.default)
    return click.option(s.option, type=kind,
                        help=f"{s.help} [default: the profile's, else {default}]")


def settings(profile: str | None, opts: dict[str, Any]) -> site.Resolved:
    """The merged configuration: built-in < site < user < project < these options."""
    cli = {OPTION_SETTINGS[k]: v for k, v in opts.items() if k in OPTION_SETTINGS}
    return site.resolve(site.load(), profile, cli)


def _apply(f: F, options: list[Callable[[F], F]]) -> F:
    for option in reversed(options):
        f = option(f)
    return f


PROFILE = click.option("--profile", help="Site profile (`hpcshard profiles list`) [default: the "
                       "configuration's `profile`].")

RUN_DIR = click.option("--run-dir", type=click.Path(path_type=Path), help="Where the run writes config, "
                       "logs, metrics, checkpoints [default: runs/JOB-TIME].")
NAME = click.option("--name", help="Run name [default: the job's name].")


def spare_options(f: F) -> F:
    """Spares and the fewest nodes a run may shrink to (both backends)."""
    return _apply(f, [setting_option("spares"), setting_option("min_nodes")])


def slurm_options(f: F) -> F:
    """sbatch settings (Slurm backend)."""
    return _apply(f, [PROFILE, *(setting_option(k) for k in (
        "time", "partition", "account", "qos", "constraint", "cpus_per_gpu", "mem", "signal_lead",
        "requeue_policy"))])


def script_options(f: F) -> F:
    """Bring your own script: `submit train.py -- ARGS` or `submit -m pkg.mod -- ARGS`."""
    return _apply(f, [
        click.argument("args", nargs=-1, type=click.UNPROCESSED),
        click.option("-m", "module", metavar="MODULE",
                     help="Run a module as the script, as `python -m MODULE` would."),
        setting_option("script_signal"), setting_option("script_grace")])


def shape_options() -> Callable[[F], F]:
    def wrap(f: F) -> F:
        return _apply(f, [
            click.option("--nodes", type=click.IntRange(min=1),
                         help="Nodes (emulated nodes under the local backend) [default: 1; resume: "
                         "the run's]."),
            click.option("--gpus", type=click.IntRange(min=1), help=site.SETTINGS["gpus_per_node"].help
                         + " [default: the profile's, else 1; resume: the run's]")])
    return wrap


SETS = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                    help="Override a config field of the job (repeatable), e.g. --set steps=100.")
RESUME = click.option("--resume", "resume", default="auto", show_default=True,
                      metavar="auto|never|STEP|PATH",
                      help="Checkpoint to start from: the newest (auto), none, a step of this "
                      "run, or a checkpoint directory of another run.")
