"""hpcshard.slurm.time: --time and --mem parsed as sbatch parses them (no Slurm binaries here;
tests/slurm/test_slurm_values.py checks a handful against the real sbatch)."""

from __future__ import annotations

import math

import pytest

from hpcshard.slurm.time import hms, parse_limit, parse_mem, parse_time

# Measured against sbatch 22.05.8 (Debian 12, the local cluster of scripts/local-slurm) with
# `sbatch --test-only --time=VALUE --wrap true`: None where sbatch says "Invalid --time
# specification", else the limit Slurm stored for the value (a held `sbatch -H` job's
# TimeLimit in `scontrol show job`, then scancel). The same values in an `#SBATCH --time=`
# line of a script (shell-quoted, as hpcshard renders them) gave the same results.
TIME_MEASURED: list[tuple[str, str | None]] = [
    ("30", "00:30:00"),
    ("0", "UNLIMITED"),
    ("1:30", "00:02:00"),  # M:S, rounded up to whole minutes
    ("01:00:00", "01:00:00"),
    ("1-0", "1-00:00:00"),
    ("1-2:30", "1-02:30:00"),  # D-H:M
    ("2-00:00:00", "2-00:00:00"),
    ("99:99:99", "4-04:41:00"),  # no range check on fields
    ("60:00", "01:00:00"),  # 60 minutes 0 seconds
    ("1:2:3:4", None),
    ("1.5", None),
    (" 30", None),
    ("30 ", None),
    ("", None),
    ("UNLIMITED", "UNLIMITED"),
    ("INFINITE", "UNLIMITED"),
    ("infinite", "UNLIMITED"),
    ("Unlimited", "UNLIMITED"),
    ("-1", "UNLIMITED"),
    ("INF", None),
    ("1-", "1-00:00:00"),
    ("abc", None),
    ("25:00:00", "1-01:00:00"),
    ("0:0:0", "UNLIMITED"),
    ("0-0", "UNLIMITED"),
    ("-0", "UNLIMITED"),
    ("05", "00:05:00"),
    ("0:1", "00:01:00"),
    ("1:60", "00:02:00"),
    ("1-2:3", "1-02:03:00"),
    ("1-2:3:4", "1-02:04:00"),
    ("1-0:0:1", "1-00:01:00"),
    ("1:", None),
    (":30", None),
    ("1::2", None),
    ("+5", None),
    ("1-02:03:04:05", None),
    ("1:2:3-4", None),
    ("1 -0", None),
    ("35791393", "24855-03:13:00"),  # the longest plain minute count that does not wrap
    ("24855-0", "24855-00:00:00"),
]

# sbatch takes these, but its 32-bit arithmetic wraps them into limits of thousands of
# years (measured limit on the right): hpcshard refuses them.
TIME_WRAPPED = [
    ("-5", "2982611-04:17:00"),  # sscanf reads minus 5 days
    ("35791394", "2957761-01:03:00"),
    ("24856-0", "2957761-21:49:00"),
    ("99999999999", "2981813-22:48:00"),
]

# Measured the same way with `sbatch --test-only --mem=VALUE --wrap true`: None where sbatch
# says "Invalid --mem specification", else MinMemoryNode of a held job (0: all of the node's
# memory). 200G, 2T and the 8? ones parse but no node of the test cluster (8000 MB) has that
# much: sbatch then says "Requested node configuration is not available", a scheduling
# answer, not a parse error.
MEM_MEASURED: list[tuple[str, str | None]] = [
    ("200G", "200G"),
    ("200GB", "200G"),
    ("200g", "200G"),
    ("200gB", "200G"),
    ("200", "200M"),
    ("0", "0"),
    ("1.5G", None),
    ("200Gfoo", None),
    ("200GiB", None),
    ("200Mi", None),
    ("1024K", "1M"),
    ("1023K", "1M"),  # K rounds up
    ("1025K", "2M"),
    ("1kb", "1M"),
    ("1Mb", "1M"),
    ("100MB", "100M"),
    ("2T", "2T"),
    ("2t", "2T"),
    ("0G", "0"),
    ("010", "10M"),  # decimal
    ("-1", None),
    ("-0", "0"),
    ("+200", "200M"),  # strtoll: a sign and leading blanks
    (" 200", "200M"),
    ("\t200", "200M"),
    ("200 ", None),
    ("200 G", None),
    ("G", None),
    ("", None),
    ("1e3", None),
    ("0x10", None),
    ("200KK", None),
    ("200B", None),
    ("200bG", None),
    ("9223372036854775808", None),  # past strtoll's range
    ("9223372036854775807", "8?"),  # 2**63 - 1 MB: Slurm has no unit name for it
    ("8796093022207T", "8?"),
]

# sbatch takes this, but 2**43 T is 2**63 MB: Slurm's signed 64-bit product wraps to 0,
# "all of the node's memory" (measured MinMemoryNode=0). hpcshard refuses it.
MEM_WRAPPED = [("8796093022208T", "0")]

MEM_FIX = "use a whole number with an optional K, M, G or T suffix"


def _mbytes(shown: str) -> int:
    """MinMemoryNode as scontrol writes it, in MB."""
    scale = {"M": 1, "G": 1024, "T": 1024**2}
    return int(shown) if shown.isdigit() else int(shown[:-1]) * scale[shown[-1]]


@pytest.mark.parametrize("value,limit", TIME_MEASURED)
def test_time_as_sbatch_parses_it(value: str, limit: str | None) -> None:
    if limit is None:
        with pytest.raises(ValueError) as err:
            parse_limit(value)
        assert str(err.value).startswith(f"--time {value!r} is not a Slurm time limit;")
        assert "MM, HH:MM:SS or D-HH:MM:SS" in str(err.value) and "\n" not in str(err.value)
    elif limit == "UNLIMITED":
        assert parse_limit(value) is None
    else:
        seconds = parse_time(value)
        assert parse_limit(value) == seconds
        assert hms(math.ceil(seconds / 60) * 60) == limit  # Slurm rounds up to minutes


@pytest.mark.parametrize("value", [v for v, limit in TIME_MEASURED if limit == "UNLIMITED"])
def test_no_time_limit_is_refused_for_a_job(value: str) -> None:
    with pytest.raises(ValueError, match="hpcshard needs a finite one") as err:
        parse_time(value)
    assert f"--time {value!r} means no time limit to Slurm" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value,wrapped", TIME_WRAPPED)
def test_times_sbatch_wraps_are_refused(value: str, wrapped: str) -> None:
    with pytest.raises(ValueError, match="MM, HH:MM:SS or D-HH:MM:SS") as err:
        parse_limit(value)
    assert str(err.value).startswith(f"--time {value!r} is ")
    assert ("negative" if value.startswith("-") else "longer than Slurm can count") in str(err.value)


def test_time_is_seconds_as_written() -> None:
    assert [parse_time(v) for v in ("1:30", "1-00:00:10", "99:99:99", "1-")] == [90, 86410, 362439, 86400]
    assert parse_time("1-2") == parse_time("26:00:00") == 93600  # D-H, not M-S
    assert parse_time("35791393") == 2**31 - 1 - 59 - 8  # the last minute Slurm can count


def test_unicode_digits_are_not_slurm_digits() -> None:
    for value in ("\u0663\u0660", "1:\u0663\u0660"):  # Arabic-Indic digits: int() takes them
        with pytest.raises(ValueError):
            parse_limit(value)
    with pytest.raises(ValueError):
        parse_mem("\u0663\u0660G")


@pytest.mark.parametrize("value,shown", MEM_MEASURED)
def test_mem_as_sbatch_parses_it(value: str, shown: str | None) -> None:
    if shown is None:
        with pytest.raises(ValueError) as err:
            parse_mem(value)
        wraps = value.isdigit()  # past strtoll's range
        why = "larger than Slurm can count (it wraps around)" if wraps else "not a Slurm memory size"
        assert str(err.value) == (f"--mem {value!r} is {why}; {MEM_FIX} "
                                  "(e.g. 200G; 0 = all of the node's memory)")
    elif shown == "8?":
        assert parse_mem(value) >= 1024**5  # more than a PB
    else:
        assert parse_mem(value) == _mbytes(shown)


@pytest.mark.parametrize("value,wrapped", MEM_WRAPPED)
def test_mem_sbatch_wraps_is_refused(value: str, wrapped: str) -> None:
    with pytest.raises(ValueError, match="larger than Slurm can count") as err:
        parse_mem(value)
    assert str(err.value).startswith(f"--mem {value!r} is ") and MEM_FIX in str(err.value)
    assert "\n" not in str(err.value)


def test_mem_is_megabytes() -> None:
    assert [parse_mem(v) for v in ("200G", "2T", "1K", "0K", "512", "512M")] == [
        204800, 2 * 1024**2, 1, 0, 512, 512]
    assert parse_mem("9223372036854775807") == 2**63 - 1  # the largest that does not wrap
