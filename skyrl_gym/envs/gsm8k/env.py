"""Single-turn math word problems scored against a dataset row's ground truth.

Reward: 1.0 when the reply's final answer equals ``reward_spec["ground_truth"]`` as a
number; otherwise ``format_reward`` when the reply gave an answer as ``#### N`` or
``\\boxed{N}`` (a shaping bonus, 0 by default so the reward stays pure correctness);
otherwise 0.0.

Settings (``environment.skyrl_gym.gsm8k``): ``strict`` (true, SkyRL's behaviour: only
a marked answer counts; false also reads the last number in the text) and
``format_reward``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import Message, action_text
from skyrl_gym.envs._checks import (
    bool_setting,
    check_settings,
    number_setting,
)
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.answers import (
    answers_match,
    check_extra_info,
    check_reward_spec,
    extract_answer,
)
from skyrl_gym.envs.arith_problems import sample_graded
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

INSTRUCTION = (
    "Solve the problem step by step, then write the final answer as a number on the "
    "last line, after '#### ' (for example: #### 42)."
)
"""Appended to every question, by ``sample_task`` and by ``scripts/prepare_gsm8k.py``."""
NAME = "gsm8k"


def gsm8k_prompt(question: str) -> list[Message]:
    """The one-message prompt for a question: the question, then ``INSTRUCTION``."""
    return [{"role": "user", "content": f"{question.strip()}\n{INSTRUCTION}"}]


class GSM8kEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_settings(env_config, NAME, ("strict", "format_reward"))
        extras = extras if extras is not None else {}
        self.ground_truth = check_reward_spec(NAME, extras.get("reward_spec"))
        self.extra_info = check_extra_info(NAME, extras.get("extra_info"))
        self.strict = bool_setting(env_config, NAME, "strict", True)
        self.format_reward = number_setting(env_config, NAME, "format_reward", 0.0, low=0, high=1)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        text = action_text(action)
        formatted = extract_answer(text, strict=True)
        extracted = formatted if formatted is not None or self.strict else extract_answer(text)
        solved = answers_match(extracted, self.ground_truth)
        if solved:
            reward = 1.0
        elif formatted is not None:
            reward = self.format_reward
        else:
            reward = 0.0
        return end_turn(
            self,
            observations=[],
            reward=reward,
            done=True,
            metadata={"solved": solved, "extracted": extracted},
        )

    @classmethod
    def sample_task(
        cls, rng: random.Random, *, difficulty: int = 1
    ) -> tuple[list[Message], dict[str, Any]]:
        problem, extras = sample_graded(rng, difficulty=difficulty)
        return gsm8k_prompt(problem.question), extras
