"""Scoring for ``search``: exact match of the last ``<answer>`` against the gold answers.

Both sides are normalized first (SQuAD's convention, which Search-R1 uses): lower case,
punctuation dropped, the articles a/an/the dropped, whitespace collapsed; so
"The Eiffel Tower!" matches "eiffel tower". ``subem_check`` is the looser variant: a
gold answer appearing anywhere in the normalized prediction.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from typing import Any

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_NO_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golden_answers: str | Iterable[str]) -> list[str]:
    if isinstance(golden_answers, str):
        return [golden_answers]
    return [str(g) for g in golden_answers]


def em_check(prediction: str, golden_answers: str | Iterable[str]) -> int:
    """1 when the normalized prediction equals a normalized gold answer, else 0."""
    predicted = normalize_answer(prediction)
    return int(any(normalize_answer(g) == predicted for g in _golds(golden_answers)))


def subem_check(prediction: str, golden_answers: str | Iterable[str]) -> int:
    """1 when a normalized gold answer occurs inside the normalized prediction."""
    predicted = normalize_answer(prediction)
    return int(any(normalize_answer(g) in predicted for g in _golds(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    """The stripped text of the last complete ``<answer>...</answer>``, or None.

    Scanned left to right like a lazy regex's successive matches, but with
    ``str.find``: many unclosed ``<answer>`` tags cost linear time, not quadratic."""
    found: str | None = None
    position = 0
    while (start := solution_str.find(ANSWER_OPEN, position)) >= 0:
        end = solution_str.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
        if end < 0:
            break
        found = solution_str[start + len(ANSWER_OPEN) : end]
        position = end + len(ANSWER_CLOSE)
    return None if found is None else found.strip()


def _score(
    check: Any,
    solution_str: str,
    ground_truth: Mapping[str, Any],
    format_score: float,
    score: float,
) -> float:
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return float(score) if check(answer, ground_truth["target"]) else float(format_score)


def compute_score(
    solution_str: str,
    ground_truth: Mapping[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for an exact match with ``ground_truth["target"]`` (a str or a list of
    them), ``format_score`` for a wrong answer, 0 for no answer. ``method`` is
    accepted for SkyRL's signature; there is one method."""
    return _score(em_check, solution_str, ground_truth, format_score, score)


def compute_score_subem(
    solution_str: str,
    ground_truth: Mapping[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``compute_score`` with ``subem_check``."""
    return _score(subem_check, solution_str, ground_truth, format_score, score)
