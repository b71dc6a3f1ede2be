"""Single-turn math word problems scored against a dataset row's ground truth.

Reward: 1.0 when the reply's final answer (see ``answers.extract_answer``) equals
``reward_spec["ground_truth"]`` as a number; otherwise ``format_reward`` when the reply
still gave an answer as ``#### N`` or ``\\boxed{N}`` (a shaping bonus for the format,
0 by default so the reward stays pure correctness); otherwise 0.0.

With ``strict=True`` only those two formats count as answers: a right number left
loose in the text earns nothing, which keeps a policy from being paid for listing
numbers.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import Env, Message, StepOutput
from skyrl_gym.envs.answers import (
    answers_match,
    check_extra_info,
    check_reward_spec,
    extract_answer,
)
from skyrl_gym.envs.arith_problems import sample_graded
from skyrl_gym.errors import EnvError

INSTRUCTION = (
    "Solve the problem step by step, then write the final answer as a number on the "
    "last line, after '#### ' (for example: #### 42)."
)
"""Appended to every question, by ``sample_task`` and by ``scripts/prepare_gsm8k.py``."""


def gsm8k_prompt(question: str) -> list[Message]:
    """The one-message prompt for a question: the question, then ``INSTRUCTION``."""
    return [{"role": "user", "content": f"{question.strip()}\n{INSTRUCTION}"}]


class Gsm8kEnv(Env):
    name = "gsm8k"
    max_turns = 1

    def __init__(
        self,
        *,
        reward_spec: Mapping[str, Any],
        extra_info: Mapping[str, Any] | None = None,
        strict: bool = False,
        format_reward: float = 0.0,
    ) -> None:
        super().__init__()
        self.ground_truth = check_reward_spec(self.name, reward_spec)
        self.extra_info = check_extra_info(self.name, extra_info)
        if not isinstance(strict, bool):
            raise EnvError(f"{self.name}.strict: expected a bool, got {strict!r}")
        self.strict = strict
        if (
            isinstance(format_reward, bool)
            or not isinstance(format_reward, (int, float))
            or not 0.0 <= format_reward <= 1.0
        ):
            raise EnvError(
                f"{self.name}.format_reward: expected a float in [0, 1], got {format_reward!r}"
            )
        self.format_reward = float(format_reward)

    def _step(self, action: str, turn: int) -> StepOutput:
        formatted = extract_answer(action, strict=True)
        extracted = formatted if formatted is not None or self.strict else extract_answer(action)
        solved = answers_match(extracted, self.ground_truth)
        if solved:
            reward = 1.0
        elif formatted is not None:
            reward = self.format_reward
        else:
            reward = 0.0
        return StepOutput([], reward, True, {"solved": solved, "extracted": extracted})

    @classmethod
    def sample_task(
        cls, rng: random.Random, *, difficulty: int = 1
    ) -> tuple[list[Message], dict[str, Any]]:
        problem, extras = sample_graded(rng, difficulty=difficulty)
        return gsm8k_prompt(problem.question), extras
