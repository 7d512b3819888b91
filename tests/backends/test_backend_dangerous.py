"""Misuse of every backend ends in a typed error, never an abort.

The llama.cpp cases run in child processes: a GGML_ASSERT there fails one test (non-zero exit,
no CASE-OK) instead of killing the test run.
"""

from __future__ import annotations

import pytest
from tests.backends import backend_danger_cases as cases
from tests.childkit import assert_case_ok


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_stub_in_process(case: str) -> None:
    cases.CASES[case]("stub")


@pytest.mark.model
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_llama_in_child_process(case: str) -> None:
    assert_case_ok("-m", "tests.backends.backend_danger_cases", "llama_cpp", case, timeout=120)
