"""hpcshard.slurm.time against the real sbatch: the values it accepts and refuses for --time
and --mem are the ones sbatch accepts and refuses (tests/unit/test_slurm_time.py has the
full table, measured once; this keeps it honest on the Slurm the tests run)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

import pytest

from hpcshard.slurm.time import parse_limit, parse_mem

TIMES = ["30", "1:30", "1-2:30", "99:99:99", "1-", "0", "UNLIMITED", "infinite",
         "1:2:3:4", "1.5", " 30", "", "abc", "1::2", "+5"]
MEMS = ["200", "100MB", "1024K", "0", "-0", "+200", " 200",
        "1.5G", "200GiB", "200Gfoo", "200 G", "-1", "G", "", "1e3"]
# sbatch takes these but wraps them (minus 5 days; 2**63 MB): hpcshard refuses them on purpose.
WRAPPED = [("time", "-5"), ("time", "35791394"), ("mem", "8796093022208T")]


def _sbatch_takes(cluster: dict[str, str], option: str, value: str) -> bool:
    proc = subprocess.run(["sbatch", "--test-only", "--partition", "debug", f"--{option}={value}",
                           "--wrap", "true"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **cluster})
    if f"Invalid --{option} specification" in proc.stderr:
        return False
    assert proc.returncode == 0, f"--{option}={value!r}: {proc.stderr}"  # not a scheduling answer
    return True


def _we_take(parse: Callable[[str], object], value: str) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


@pytest.mark.debug_partition
def test_parsers_accept_what_sbatch_accepts(cluster: dict[str, str]) -> None:
    parsers: dict[str, Callable[[str], object]] = {"time": parse_limit, "mem": parse_mem}
    cases = [("time", v) for v in TIMES] + [("mem", v) for v in MEMS]
    disagree = [(option, value, sbatch) for option, value in cases
                if (sbatch := _sbatch_takes(cluster, option, value)) != _we_take(parsers[option], value)]
    assert not disagree, f"(option, value, sbatch accepts) where hpcshard disagrees: {disagree}"
    for option, value in WRAPPED:
        assert _sbatch_takes(cluster, option, value) and not _we_take(parsers[option], value), value
