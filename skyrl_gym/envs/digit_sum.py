"""Single-turn: "3+4=" — reply with the one-digit sum.

Reward: 0.5 when the reply starts with a digit, another 0.5 when it is the sum.
Operands (the row's ``extras["a"]`` and ``["b"]``) are drawn so the sum stays below 10;
a random byte-level model starts with a digit about 3.8% of the time and is then right
1 time in 10.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import Message, action_text, first_char
from skyrl_gym.envs._checks import check_int, check_settings, extra
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.error import EnvError

NAME = "single_digit_sum"


class SingleDigitSumEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_settings(env_config, NAME, ())
        self.a = check_int(f"{NAME}.extras.a", extra(extras, NAME, "a"), low=0, high=9)
        self.b = check_int(f"{NAME}.extras.b", extra(extras, NAME, "b"), low=0, high=9)
        if self.a + self.b > 9:
            raise EnvError(
                f"{NAME}.extras.a+b: expected a one-digit sum (<= 9), got {self.a + self.b}"
            )

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        c = first_char(action_text(action))
        valid = len(c) == 1 and "0" <= c <= "9"
        correct = valid and int(c) == self.a + self.b
        reward = (0.5 if valid else 0.0) + (0.5 if correct else 0.0)
        return end_turn(
            self,
            observations=[],
            reward=reward,
            done=True,
            metadata={"valid": valid, "correct": correct},
        )

    @classmethod
    def sample_task(cls, rng: random.Random) -> tuple[list[Message], dict[str, Any]]:
        a = rng.randrange(10)
        b = rng.randrange(10 - a)
        return [{"role": "user", "content": f"{a}+{b}="}], {"a": a, "b": b}
