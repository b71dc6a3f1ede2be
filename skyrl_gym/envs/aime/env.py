"""Single-turn competition math scored against a dataset row's ground truth.

Reward: 1.0 when the reply's final answer (after ``Answer:``) normalizes to the ground
truth, otherwise -1.0 (SkyRL's values; see ``utils.compute_score``). The ground truth
is ``extras["reward_model"]["ground_truth"]`` as in SkyRL's AIME rows, or
``extras["reward_spec"]["ground_truth"]`` as in this project's; ``reward_model`` wins
when a row has both.

Setting (``environment.skyrl_gym.aime``): ``strict_box_verify`` (false, SkyRL's
default; true scores only a verbatim ``\\boxed{...}`` near the end of the reply).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import action_text
from skyrl_gym.envs._checks import bool_setting, check_settings
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.aime.utils import compute_score, normalize_final_answer
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.error import EnvError

NAME = "aime"
TRUTH_SOURCES = ("reward_model", "reward_spec")
"""Where a row may keep its answer, the preferred first."""


def read_ground_truth(extras: Any) -> str:
    """The row's answer as text; ``EnvError`` naming the field when it is missing,
    not text or an int, or normalizes to nothing (no reply could ever match it)."""
    if not isinstance(extras, Mapping):
        raise EnvError(f"{NAME}.extras: expected a mapping of the row's fields, got {extras!r:.80}")
    source = next((key for key in TRUTH_SOURCES if extras.get(key) is not None), None)
    if source is None:
        raise EnvError(
            f"{NAME}.extras.reward_model.ground_truth: expected the answer (or "
            f"reward_spec.ground_truth), got none (keys: {sorted(map(str, extras))})"
        )
    field = f"{NAME}.extras.{source}.ground_truth"
    spec = extras[source]
    if not isinstance(spec, Mapping) or spec.get("ground_truth") is None:
        raise EnvError(f"{field}: expected the answer, got {spec!r:.120}")
    truth = spec["ground_truth"]
    if isinstance(truth, int) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str) or normalize_final_answer(truth) == "":
        raise EnvError(f"{field}: expected a non-empty string or int, got {truth!r:.120}")
    return truth


class AIMEEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.ground_truth = read_ground_truth(extras if extras is not None else {})
        check_settings(env_config, NAME, ("strict_box_verify",))
        self.strict_box_verify = bool_setting(env_config, NAME, "strict_box_verify", False)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        score = compute_score(
            action_text(action), self.ground_truth, strict_box_verify=self.strict_box_verify
        )
        return end_turn(
            self,
            observations=[],
            reward=score["score"],
            done=True,
            metadata={"acc": score["acc"], "pred": score["pred"], "solved": score["acc"]},
        )
