"""GSM8K scoring in SkyRL's signature: ``compute_score(solution_str, ground_truth,
method, format_score, score)``.

``method="strict"`` reads the answer only from ``#### N`` (or ``\\boxed{N}``);
``"flexible"`` falls back to the last number in the text. Unlike SkyRL's string
comparison, numbers are compared as numbers ("1,000" == "1000.0"), and the *last*
marked answer counts (a model that writes two has revised itself); see
``skyrl_gym/envs/answers.py`` and ``docs/environments.md``.
"""

from __future__ import annotations

from skyrl_gym.envs.answers import answers_match, extract_answer

METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The reply's final answer as a canonical number string, or None."""
    if method not in METHODS:
        raise ValueError(f"extract_solution.method: expected one of {METHODS}, got {method!r}")
    return extract_answer(solution_str, strict=method == "strict")


def compute_score(
    solution_str: str,
    ground_truth: str | int | float,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one that was given
    in the format ``method`` reads, 0.0 for none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answers_match(answer, ground_truth) else format_score
