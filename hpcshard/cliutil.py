"""Small pieces the command modules share (login node: click and the stdlib)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import click


class UserError(click.ClickException):
    """Bad input: one line, exit code 2, nothing started."""

    exit_code = 2


def fail(err: Exception) -> NoReturn:
    raise UserError(str(err)) from None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Bad input (ValueError) is one line and exit 2; a job whose own code crashed in the
    preflight (RuntimeError, with its traceback) exits 1."""
    try:
        yield
    except ValueError as err:
        fail(err)
    except RuntimeError as err:
        click.echo(str(err), err=True)
        sys.exit(1)


def run_dir_of(target: str) -> Path:
    """A run directory as given, or the one a Slurm job id writes its log into."""
    path = Path(target)
    if path.is_dir() or not target.isdigit():
        return path
    from hpcshard import slurm

    out = slurm.job_state(target).get("StdOut", "")
    if not out:
        raise ValueError(f"Slurm does not know job {target}; give the run directory instead")
    return Path(out).parent.parent  # RUN_DIR/logs/slurm-%j.out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns as wide as their widest cell; the last column runs free."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    for row in [headers, *rows]:
        cells = [f"{str(c):<{w}}" for c, w in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, str(row[-1])]).rstrip())
