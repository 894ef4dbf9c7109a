"""hpcshard's own error classes, stdlib only, below every other module.

A rank that raises `UserError` stops the run with exit code 2 and one line, and is never
restarted: a bad value stays bad however often it runs. hpcshard's own checks raise it,
and so may a job's own (a config's `__post_init__`, say). Any other exception inside a
rank, a `ValueError` from torch, json or the job's code included, is a rank failure that
the launchers may restart: from its type alone it cannot be told from a fault (a
half-read file, a peer that died mid-collective).

On the login node the `hpcshard` command catches them once, at its edge (`hpcshard.cli`):
a `ValueError` that reaches it (a `UserError`, or a check's own) is bad input, one line
and `UserError.exit_code`; a `JobCrashed` prints the job's traceback and exits with its
own code. Nothing below the edge exits.
"""

from __future__ import annotations

from typing import ClassVar


class UserError(ValueError):
    """A value, file or checkpoint the user must fix; the message names it and the fix.

    A `ValueError`, so code that catches `ValueError` (the preflight, a check that tries
    the next candidate) keeps working."""

    exit_code: ClassVar[int] = 2


class JobCrashed(RuntimeError):
    """The job's own code crashed where the login node imported it to check it (the
    preflight, in a subprocess): a bug of the job, not bad input; the message is its
    traceback."""

    exit_code: ClassVar[int] = 1
