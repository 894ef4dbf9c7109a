"""Slurm's job states are mapped from its strings once (hpcshard.slurm.states): what it
maps, and a walk of the source that finds a state's word compared anywhere else."""

from __future__ import annotations

import ast

import pytest

from hpcshard.slurm.states import JobState, parse
from tests.unit.test_launch_backends import comparisons, found_outside, names

NAMES = frozenset(s.value for s in JobState)


@pytest.mark.parametrize(("text", "state"), [
    ("RUNNING", JobState.RUNNING), ("CANCELLED by 1000", JobState.CANCELLED),
    ("COMPLETED", JobState.COMPLETED), ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
    ("CANCELLED+", JobState.CANCELLED), ("", JobState.UNKNOWN), ("RESV_DEL_HOLD", JobState.RESV_DEL_HOLD),
    ("A_NEWER_WORD", JobState.UNKNOWN),
    ("running", JobState.UNKNOWN), ("REQUEUE_HOLD", JobState.REQUEUE_HOLD),
])
def test_parse_maps_slurm_s_words(text: str, state: JobState) -> None:
    assert parse(text) is state


def test_the_properties() -> None:
    over = {s for s in JobState if s.over}
    assert over == {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
                    JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL, JobState.DEADLINE,
                    JobState.PREEMPTED}
    assert not any(s.over for s in JobState if s.requeued or s.running or s.pending)
    assert not JobState.UNKNOWN.over  # a word we do not know is never taken for "over"
    assert {s for s in JobState if s.ended_on_purpose} == {JobState.CANCELLED, JobState.COMPLETED}


def comparisons_of_state_words(source: str) -> list[int]:
    """Lines comparing anything with a Slurm state's word (`==`, `in`, a `match` case, a
    `.startswith`), or keeping such words in a tuple, set or list to compare with later."""
    lines = comparisons(source, lambda node: names(node, NAMES))
    lines += [node.lineno for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Tuple | ast.Set | ast.List) and names(node, NAMES)]
    return sorted(set(lines))


FORMS = ('x = state == "COMPLETED"', 'x = "RUNNING" != s', 'x = s in ("PENDING", "REQUEUED")',
         'x = s in {"TIMEOUT"}', 'x = info.get("JobState") == "NODE_FAIL"', 'x = s.startswith("CANCELLED")',
         'ENDED = ("CANCELLED", "COMPLETED")', 'match s:\n    case "PREEMPTED":\n        pass')
"""A state's word compared in every form the walk must find."""


def test_no_module_but_states_compares_a_slurm_state_s_word() -> None:
    """Every decision on a job's state asks a JobState (`hpcshard.slurm.states.parse`); the
    walk finds each of FORMS, and none of them anywhere but there."""
    assert [form for form in FORMS if not comparisons_of_state_words(form)] == []
    assert found_outside("hpcshard/slurm/states.py", comparisons_of_state_words) == []
