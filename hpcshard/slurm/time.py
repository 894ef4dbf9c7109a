"""Slurm's time limits and memory sizes, parsed the way Slurm parses them (stdlib).

Both parsers follow what `sbatch` 22.05 does with --time and --mem (measured with
`sbatch --test-only`; the table is in tests/unit/test_slurm_time.py), and refuse on purpose
the few values sbatch takes but turns into something nobody meant:

- --time: Slurm's time_str2mins. "0" (and 0-0, 0:0:0, -0) and UNLIMITED, INFINITE, -1 (any
  case) mean no limit: parse_limit() gives None for them, parse_time() refuses them, because
  hpcshard needs a finite limit to send its checkpoint notice ahead of. sbatch also takes
  "-5" (minus 5 days) and limits past 2**31 seconds, which its 32-bit arithmetic wraps into
  limits of thousands of years: refused. Slurm rounds a limit up to whole minutes (1:30 is
  00:02:00); parse_time() gives the seconds as written, round up yourself where it matters.
- --mem: Slurm's str_to_mbytes (strtoll, then an optional K, M, G or T, optionally followed
  by B; leading blanks and a sign are strtoll's). Sizes of 2**63 MB and more, which Slurm
  wraps (8796093022208T became "0", all of the node's memory), are refused.
"""

from __future__ import annotations

import re

# What Slurm's _is_valid_timespec lets through to its sscanf("%d-%d:%d:%d" / "%d:%d:%d"),
# spelled out: M, M:S, H:M:S, D-, D-H, D-H:M, D-H:M:S, and -N (minus N days). Nothing else:
# no blanks, no sign but that one minus, no empty fields, ASCII digits only.
_CLOCK = re.compile(r"(\d+)(?::(\d+)(?::(\d+))?)?", re.ASCII)
_DAYS = re.compile(r"-(\d+)|(\d+)-(?:(\d+)(?::(\d+)(?::(\d+))?)?)?", re.ASCII)
_UNLIMITED = {"-1", "infinite", "unlimited"}
# time_str2secs sums into a C int, then time_str2mins adds 59 to round up to minutes.
_MAX_SECONDS = 2**31 - 1 - 59
_FORMATS = "use MM, HH:MM:SS or D-HH:MM:SS (e.g. 30, 04:00:00, 2-00:00:00; also MM:SS, D-HH, D-HH:MM)"

# str_to_mbytes: strtoll (C isspace, a sign, decimal digits), then K/M/G/T, then B, case-blind.
_MEM = re.compile(r"[ \t\n\v\f\r]*([+-]?)(\d+)(?:([KkMmGgTt])[Bb]?)?", re.ASCII)
_MEM_SCALE = {"k": 1, "m": 1, "g": 1024, "t": 1024 * 1024}
_MEM_FIX = ("use a whole number with an optional K, M, G or T suffix "
            "(e.g. 200G; 0 = all of the node's memory)")


def parse_limit(text: str) -> int | None:
    """A Slurm --time value in seconds as written, None for "no limit" (0, UNLIMITED,
    INFINITE, -1), or ValueError naming the value and the accepted formats."""
    if text.lower() in _UNLIMITED:
        return None
    if m := _CLOCK.fullmatch(text):
        first, second, third = (int(g) if g else 0 for g in m.groups())
        # H:M:S, else M or M:S
        seconds = first * 3600 + second * 60 + third if m[3] else first * 60 + second
    elif m := _DAYS.fullmatch(text):
        minus, days, h, mins, s = (int(g) if g else 0 for g in m.groups())
        if minus:  # -N: sscanf's %d reads minus N days (-0 is 0: no limit)
            raise ValueError(f"--time {text!r} is negative (sbatch wraps it into a limit of "
                             f"thousands of years); {_FORMATS}")
        seconds = days * 86400 + h * 3600 + mins * 60 + s
    else:
        raise ValueError(f"--time {text!r} is not a Slurm time limit; {_FORMATS}")
    if seconds > _MAX_SECONDS:
        raise ValueError(f"--time {text!r} is longer than Slurm can count (about 68 years: sbatch "
                         f"wraps it around); {_FORMATS}")
    return seconds or None  # Slurm: a limit of 0 is no limit


def parse_time(text: str) -> int:
    """A finite Slurm --time in seconds as written (Slurm itself rounds up to whole
    minutes), or ValueError: for what sbatch refuses, and for "no limit"."""
    seconds = parse_limit(text)
    if seconds is None:
        raise ValueError(f"--time {text!r} means no time limit to Slurm; hpcshard needs a finite "
                         "one (it sends the checkpoint notice ahead of it): give e.g. 04:00:00 "
                         "or 2-00:00:00")
    return seconds


def parse_mem(text: str) -> int:
    """A Slurm --mem value in megabytes (K rounds up; 0 = all of the node's memory), or
    ValueError naming the value and the fix."""
    m = _MEM.fullmatch(text)
    if not m or (m.group(1) == "-" and int(m.group(2))):
        raise ValueError(f"--mem {text!r} is not a Slurm memory size; {_MEM_FIX}")
    number, unit = int(m.group(2)), (m.group(3) or "m").lower()
    if unit == "k":  # (number + 1023) / 1024: rounds up
        scaled, mbytes = number + 1023, (number + 1023) // 1024
    else:
        scaled = mbytes = number * _MEM_SCALE[unit]
    if max(number, scaled) >= 2**63:  # strtoll's range; Slurm's signed 64-bit scaling wraps
        raise ValueError(f"--mem {text!r} is larger than Slurm can count (it wraps around); {_MEM_FIX}")
    return mbytes


def hms(seconds: int) -> str:
    """Seconds as Slurm writes a time limit: HH:MM:SS, or D-HH:MM:SS from a day on."""
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text
