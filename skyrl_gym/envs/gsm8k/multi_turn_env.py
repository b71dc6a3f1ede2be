"""GSM8K over several turns, with a reward every turn (SkyRL's ``gsm8k_multi_turn``).

Each turn a reply scores 1.0 when its marked answer (``#### N``) is right, which ends
the episode; a marked but wrong answer scores the format share ``0.2 / max_turns``;
anything else 0. Until the last turn the observation asks for reasoning and a
tentative answer; before the last it asks for the final answer only.
``max_turns``: the row's ``extras["max_turns"]`` (the generator sets it to
``generator.max_turns``), else ``extra_info["max_turns"]``, else 5.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import action_text
from skyrl_gym.envs._checks import check_int, check_settings
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.answers import check_extra_info, check_reward_spec
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.gsm8k.utils import compute_score

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
        self.ground_truth = check_reward_spec(NAME, extras.get("reward_spec"))
        info = check_extra_info(NAME, extras.get("extra_info"))
        turns = extras.get("max_turns", info.get("max_turns", 5))
        self.max_turns = check_int(f"{NAME}.extras.max_turns", int(turns), low=1, high=64)
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

    def get_metrics(self) -> dict[str, Any]:
        return {"steps": self.turns}

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        if not metrics:
            return {}
        return {"avg_steps": sum(float(m.get("steps", 0)) for m in metrics) / len(metrics)}
