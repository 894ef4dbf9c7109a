"""The `hpcshard` command: a lazy click group. Runs on login nodes and laptops.

`hpcshard --help` imports click and this module only; each command's module (and what it
needs: jinja2, submitit, the Slurm queries, torch in a subprocess) is imported when that
command runs. Nothing imports `hpcshard.cli`; a test holds `import hpcshard.cli` to
click and the stdlib.

    submit   submit, render, resume        runs    status, ls, plot, cancel, preempt
    allocation  run (inside an allocation you hold)
    logs     logs
    sweep    sweep                         ckpt    ckpt list, ckpt export
    site     config, profiles, templates   doctor  doctor
    plan     plan                          data    data prepare
    profile  profile
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from hpcshard import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("submit:submit", "Run a job or any torchrun script on NODES x GPUS ranks."),
    "render": ("submit:render_cmd", "Print the sbatch script that submit would submit."),
    "resume": ("submit:resume", "Continue a run from its newest checkpoint, on any shape."),
    "run": ("allocation:run", "Run a job on the nodes of an allocation you hold (salloc), no new job."),
    "sweep": ("sweep:sweep", "Run a job once per configuration (a grid, a file): job arrays, one sweep."),
    "status": ("runs:status", "Slurm state, training progress and attempts of a run."),
    "logs": ("logs:logs", "A run's rank logs in one stream, across attempts (-f: follow)."),
    "ls": ("runs:ls", "Recent runs, newest first."),
    "plot": ("runs:plot", "Loss and tokens/s over steps as a PNG."),
    "preempt": ("runs:preempt", "Send a run the preemption notice (a clean stop)."),
    "cancel": ("runs:cancel", "Stop a run now, without a checkpoint."),
    "profile": ("profile:profile", "Record a profiler trace of a live run's next steps."),
    "ckpt": ("ckpt:ckpt", "Inspect and export checkpoints."),
    "config": ("site:config", "The merged configuration and where each value came from."),
    "profiles": ("site:profiles", "The profiles the site, user and project files define."),
    "templates": ("site:templates", "sbatch templates on the search path."),
    "doctor": ("doctor:doctor", "Check that this site and a profile can run jobs."),
    "plan": ("plan:plan", "Will it fit? Per-GPU memory for each sharding mode."),
    "data": ("data:data", "Tokenize a corpus into token shards (data prepare)."),
}
"""name -> (module:attribute under hpcshard.cli, the one line `--help` shows)."""


class BadInput(click.ClickException):
    """What the edge makes of bad input: click shows it as one line (`Error: ...`) and
    exits with `hpcshard.errors.UserError.exit_code` (not imported here: `--help` loads
    click and this module only; a unit test holds the two equal)."""

    exit_code = 2


class LazyGroup(click.Group):
    """click's lazily loading group (click docs, "Lazily Loading Subcommands"), with the
    listing's one-line help kept here so that `--help` imports no command module."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name][0].split(":")
        command = getattr(importlib.import_module(f"hpcshard.cli.{module}"), attr)
        assert isinstance(command, click.Command), f"{module}:{attr} is not a click command"
        return command

    def invoke(self, ctx: click.Context) -> Any:
        """The command's errors, caught here once (`hpcshard.errors`): bad input is one line
        and exit 2, a job that crashed in its check prints its traceback and exits 1."""
        try:
            return super().invoke(ctx)
        except ValueError as err:  # a UserError, or a check's own ValueError
            import json

            if isinstance(err, UnicodeError | json.JSONDecodeError):
                raise  # a file no check of hpcshard's read (corrupt, or a bug): not bad input
            raise BadInput(str(err)) from None
        except RuntimeError as err:
            from hpcshard.errors import JobCrashed

            if not isinstance(err, JobCrashed):
                raise
            click.echo(str(err), err=True)
            ctx.exit(err.exit_code)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcshard")
def main() -> None:
    """Train FSDP2/HSDP jobs on many GPU nodes, and keep them alive there."""
