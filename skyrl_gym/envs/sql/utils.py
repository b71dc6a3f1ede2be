"""text2sql scoring: the episode's format, then the predicted SQL's result set.

A finished episode (every reply and observation, concatenated) is well-formed when

* it has exactly one ``<solution>`` and, after it, exactly one ``</solution>``;
* the solution holds no ``<think>``, ``<sql>`` or ``<observation>`` tag;
* it has at least one ``<think>...</think>``;
* every ``</observation>`` before the solution is followed (after whitespace) by
  ``<think>``: the model reasons about each result before acting again.

Score (SkyRL's): -1.0 for a malformed episode; 1.0 when the solution's rows equal the
gold SQL's rows as sets (order and duplicates ignored, as SkyRL compares them); 0.0
otherwise, including when either query fails, runs out of time, or returns more than
``max_rows`` rows (a truncated result cannot be compared).
"""

from __future__ import annotations

import re
from typing import Any

from skyrl_gym.tools.sql import run_readonly_query

SOLUTION_OPEN, SOLUTION_CLOSE = "<solution>", "</solution>"
_THOUGHT = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_TAG_IN_SOLUTION = re.compile(r"</?(?:think|sql|observation)\b", re.IGNORECASE)
_OBSERVATION_END = re.compile(r"</observation>", re.IGNORECASE)
SCORE_TIMEOUT = 30.0
"""Seconds each of the two queries may run when scoring (SkyRL's)."""
SCORE_MAX_ROWS = 100_000


def verify_format_and_extract(output: str) -> tuple[bool, list[str] | None, str | None, None]:
    """``(True, thoughts, solution_sql, None)`` for a well-formed episode (see the
    module docstring), else ``(False, None, None, None)``; never raises."""
    invalid = (False, None, None, None)
    if not isinstance(output, str) or output.count(SOLUTION_OPEN) != 1:
        return invalid
    before, _, after = output.partition(SOLUTION_OPEN)
    if after.count(SOLUTION_CLOSE) != 1:
        return invalid
    solution = after.partition(SOLUTION_CLOSE)[0]
    if _TAG_IN_SOLUTION.search(solution):
        return invalid
    thoughts = _THOUGHT.findall(output)
    if not thoughts:
        return invalid
    for end in _OBSERVATION_END.finditer(before):
        if not before[end.end() :].lstrip()[:7].lower() == "<think>":
            return invalid
    return True, thoughts, solution.strip(), None


def result_set(
    db_file: str, sql: str, *, timeout: float, max_rows: int
) -> frozenset[tuple[Any, ...]] | None:
    """The query's rows as a set, or None when it failed or returned too many."""
    result = run_readonly_query(db_file, sql, timeout=timeout, max_rows=max_rows)
    if result.rows is None or result.truncated:
        return None
    return frozenset(result.rows)


def compute_score_single(
    completion: str,
    reference: str,
    db_file: str,
    *,
    timeout: float = SCORE_TIMEOUT,
    max_rows: int = SCORE_MAX_ROWS,
) -> float:
    """-1.0 malformed, 1.0 same result set as ``reference``, else 0.0."""
    ok, _thoughts, predicted, _ = verify_format_and_extract(completion)
    if not ok or predicted is None:
        return -1.0
    got = result_set(db_file, predicted, timeout=timeout, max_rows=max_rows)
    if got is None:
        return 0.0
    want = result_set(db_file, reference, timeout=timeout, max_rows=max_rows)
    return 1.0 if want is not None and got == want else 0.0
