"""Multi-turn: the environment shows a letter, the reply should start with it; N turns.

Reward: ``1 / N`` for each turn whose reply starts with the letter just shown, so an
episode that repeats every letter scores exactly 1.0. ``format_credit``
(``environment.skyrl_gym.repeat_letter.format_credit``) moves that share of each
turn's reward to replies that start with any lowercase letter (``valid`` in the step
metadata). It is 0 by default: at 0.5 (this environment's reward before 2026-12-03)
GRPO groups were told apart by "a letter" long before "the right letter", and the
default run never solved an episode in 80 steps. A random byte model hits the right
letter 1/264 of the time; tests that need groups to vary from the first step of a
random model set a credit (any letter is 26/264).

Observations: the next letter ("b") after a right reply, "no. b" after a wrong one;
the letter to copy is always the last character before the reply. The row's
``extras["letters"]`` are the letters to copy, one per turn.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import Message, action_text, first_char
from skyrl_gym.envs._checks import (
    check_settings,
    extra,
    number_setting,
)
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.error import EnvError

ALPHABET = "abcdefgh"
"""Letters drawn for tasks; replies are judged against all 26 lowercase letters."""
NAME = "repeat_letter"


class RepeatLetterEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_settings(env_config, NAME, ("format_credit",))
        letters = extra(extras, NAME, "letters")
        if (
            not isinstance(letters, str)
            or not 1 <= len(letters) <= 64
            or any(c not in string.ascii_lowercase for c in letters)
        ):
            raise EnvError(
                f"{NAME}.extras.letters: expected 1-64 lowercase ASCII letters, got {letters!r}"
            )
        self.letters = letters
        self.format_credit = number_setting(env_config, NAME, "format_credit", 0.0, low=0, high=1)
        self.max_turns = len(letters)
        self.all_correct = True

    def step(self, action: str) -> BaseTextEnvStepOutput:
        turn = begin_turn(self, NAME)
        share = 1.0 / self.max_turns
        c = first_char(action_text(action))
        valid = len(c) == 1 and c in string.ascii_lowercase
        correct = valid and c == self.letters[turn]
        reward = share * (
            (self.format_credit if valid else 0.0) + (1.0 - self.format_credit if correct else 0.0)
        )
        nxt = self.letters[turn + 1] if turn + 1 < self.max_turns else ""
        message = nxt if correct else f"no. {nxt}"
        self.all_correct = (turn == 0 or self.all_correct) and correct
        # Solved: every letter repeated. Reported on every step (False until the last
        # one), so episodes cut short by the token budget count as unsolved.
        solved = self.all_correct and turn == self.max_turns - 1
        return end_turn(
            self,
            observations=[{"role": "user", "content": message}],
            reward=reward,
            done=False,
            metadata={"valid": valid, "correct": correct, "solved": solved},
        )

    @classmethod
    def sample_task(
        cls, rng: random.Random, *, turns: int = 3
    ) -> tuple[list[Message], dict[str, Any]]:
        letters = "".join(rng.choice(ALPHABET) for _ in range(turns))
        return [{"role": "user", "content": f"Repeat: {letters[0]}"}], {"letters": letters}
