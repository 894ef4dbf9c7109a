"""hpcshard's own error class, stdlib only, below every other module.

A rank that raises `UserError` stops the run with exit code 2 and one line, and is never
restarted: a bad value stays bad however often it runs. hpcshard's own checks raise it,
and so may a job's own (a config's `__post_init__`, say). Any other exception inside a
rank, a `ValueError` from torch, json or the job's code included, is a rank failure that
the launchers may restart: from its type alone it cannot be told from a fault (a
half-read file, a peer that died mid-collective).
"""

from __future__ import annotations


class UserError(ValueError):
    """A value, file or checkpoint the user must fix; the message names it and the fix.

    A `ValueError`, so code that catches `ValueError` (the CLI's `fail`, the preflight)
    keeps working."""
