"""GSM8K over several turns, with a reward every turn (SkyRL's ``gsm8k_multi_turn``).

Each turn a reply scores 1.0 when its marked answer (``#### N``) is right, which ends
the episode; a marked but wrong answer scores the format share ``0.2 / max_turns``;
anything else 0. Until the last turn the observation asks for reasoning and a
tentative answer; before the last it asks for the final answer only.
``max_turns``: the row's ``extras["max_turns"]`` (the generator sets it to
``generator.max_turns``), else ``extra_info["max_turns"]``, else 5; a null value
(a parquet column other rows fill) counts as absent.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import Message, action_text
from skyrl_gym.envs._checks import check_settings
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.answers import check_extra_info, check_reward_spec
from skyrl_gym.envs.arith_problems import sample_graded
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.gsm8k.env import gsm8k_prompt
from skyrl_gym.envs.gsm8k.utils import compute_score
from skyrl_gym.error import EnvError

NAME = "gsm8k_multi_turn"
FORMAT_SCORE = 0.2
"""Spread over the episode: each well-formed wrong turn earns ``FORMAT_SCORE / max_turns``."""
ASK_AGAIN = "Show your reasoning, then end with a tentative answer as '#### ANSWER'."
ASK_FINAL = "Last turn: reply with only the final answer as '#### ANSWER'."


class GSM8kMultiTurnEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_settings(env_config, NAME, ())
        extras = extras if extras is not None else {}
        if not isinstance(extras, Mapping):
            raise EnvError(
                f"{NAME}.extras: expected a mapping of the row's fields, got {extras!r:.80}"
            )
        self.ground_truth = check_reward_spec(NAME, extras.get("reward_spec"))
        info = check_extra_info(NAME, extras.get("extra_info"))
        self.max_turns = _max_turns(extras, info)
        self.format_score_per_turn = FORMAT_SCORE / self.max_turns

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        reward = compute_score(
            action_text(action),
            self.ground_truth,
            method="strict",
            format_score=self.format_score_per_turn,
            score=1.0,
        )
        solved = reward == 1.0
        left = self.max_turns - self.turns
        message = ASK_FINAL if left == 1 else ASK_AGAIN
        return end_turn(
            self,
            observations=[{"role": "user", "content": message}],
            reward=float(reward),
            done=solved,
            metadata={"solved": solved},
        )

    @classmethod
    def sample_task(
        cls, rng: random.Random, *, difficulty: int = 1
    ) -> tuple[list[Message], dict[str, Any]]:
        """A generated problem, prompted and graded as ``gsm8k``'s (``make_dataset``);
        ``max_turns`` is left to the generator."""
        problem, extras = sample_graded(rng, difficulty=difficulty)
        return gsm8k_prompt(problem.question), extras

    def get_metrics(self) -> dict[str, Any]:
        return {"steps": self.turns}

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        if not metrics:
            return {}
        return {"avg_steps": sum(float(m.get("steps", 0)) for m in metrics) / len(metrics)}


def _max_turns(extras: Mapping[str, Any], info: Mapping[str, Any]) -> int:
    """The first of ``extras.max_turns``, ``extra_info.max_turns`` that is set, else 5.

    An integral value is required (a numpy integer, ``3.0`` or ``"3"`` from a parquet
    row is one; ``True`` or ``2.5`` is a mistake, not a count). None and NaN (pandas'
    null) count as absent. No upper bound: the generator passes its own ``max_turns``,
    whatever the run sets.
    """
    for field, value in (
        ("extras.max_turns", extras.get("max_turns")),
        ("extras.extra_info.max_turns", info.get("max_turns")),
    ):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        count: int | None = None
        if isinstance(value, str) and value.strip().isdigit():
            count = int(value)
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            count = int(value)
        elif (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            and float(value).is_integer()
        ):
            count = int(float(value))
        if count is not None and count >= 1:
            return count
        raise EnvError(f"{NAME}.{field}: expected an int >= 1, got {value!r:.80}")
    return 5
