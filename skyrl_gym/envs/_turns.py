"""Turn bookkeeping shared by this package's multi-turn environments: a step past the
end is refused, the last turn ends the episode, a finished episode has no observation."""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.error import EnvError


def begin_turn(env: BaseTextEnv, name: str) -> int:
    """The 0-based index of the turn this step plays (``env.turns`` counts it)."""
    if getattr(env, "done", False) or env.turns >= env.max_turns:
        raise EnvError(
            f"{name}.step: expected an unfinished episode, got step {env.turns + 1} "
            f"after done (max_turns {env.max_turns})"
        )
    env.turns += 1
    return env.turns - 1


def end_turn(
    env: BaseTextEnv,
    *,
    observations: ConversationType,
    reward: float,
    done: bool,
    metadata: dict[str, Any],
) -> BaseTextEnvStepOutput:
    """The step's output; ``done`` once the last turn is played."""
    done = done or env.turns >= env.max_turns
    env.done = done  # type: ignore[attr-defined]
    metadata.setdefault("turn", env.turns - 1)
    return BaseTextEnvStepOutput(
        observations=[] if done else observations, reward=reward, done=done, metadata=metadata
    )
