"""Multi-turn: guess a hidden digit; each wrong guess is answered "higher" or "lower".

Reward (sums to at most 1 per episode):
- format: each turn whose reply starts with a digit earns ``0.5 / max_turns``;
- correctness: the right digit earns 0.5 plus the format credit of the turns it saved,
  so solving on any turn with well-formed replies scores exactly 1.0.

Why this shape: a random byte-level model (264 tokens) starts a reply with a digit
about 10/264 = 3.8% of the time per turn, so a GRPO group of 8 three-turn episodes
usually holds a nonzero reward; the format credit is then learnable within a few
steps, and correctness follows from guessing digits at all (a 1/10 chance per turn).

The digit is the row's ``extras["target"]``; ``max_turns`` is a setting
(``environment.skyrl_gym.guess_number.max_turns``, 3), not the generator's limit,
because the reward's shares depend on it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import Message, action_text, first_char
from skyrl_gym.envs._checks import (
    check_int,
    check_settings,
    extra,
    int_setting,
)
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

PROMPT = "Guess my digit (0-9)."
NOT_A_DIGIT = "digit?"
NAME = "guess_number"


class GuessNumberEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_settings(env_config, NAME, ("max_turns",))
        self.target = check_int(
            f"{NAME}.extras.target", extra(extras, NAME, "target"), low=0, high=9
        )
        self.max_turns = int_setting(env_config, NAME, "max_turns", 3, low=1, high=64)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        turn = begin_turn(self, NAME)
        credit = 0.5 / self.max_turns
        c = first_char(action_text(action))
        if not (len(c) == 1 and "0" <= c <= "9"):
            # Every step says whether the episode is solved, so an episode of only
            # bad replies still counts (as unsolved) in the success rate.
            return end_turn(
                self,
                observations=[{"role": "user", "content": NOT_A_DIGIT}],
                reward=0.0,
                done=False,
                metadata={"valid": False, "solved": False},
            )
        guess = int(c)
        if guess == self.target:
            saved = self.max_turns - turn - 1
            return end_turn(
                self,
                observations=[],
                reward=credit + 0.5 + saved * credit,
                done=True,
                metadata={"valid": True, "solved": True},
            )
        hint = "higher" if guess < self.target else "lower"
        return end_turn(
            self,
            observations=[{"role": "user", "content": hint}],
            reward=credit,
            done=False,
            metadata={"valid": True, "solved": False},
        )

    @classmethod
    def sample_task(cls, rng: random.Random) -> tuple[list[Message], dict[str, Any]]:
        return [{"role": "user", "content": PROMPT}], {"target": rng.randrange(10)}
