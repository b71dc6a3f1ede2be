"""What a trainer reads from ``step``: the output checked once, where it enters.

SkyRL's generator indexes the dict and trusts it; a missing key or a NaN reward then
fails far away (in the advantage, or as a NaN loss steps later). Here a malformed
output raises ``EnvError`` naming the environment, the turn and the key.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from skyrl_gym.core import Message
from skyrl_gym.error import EnvError


@dataclass(frozen=True)
class StepResult:
    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    postprocessed_action: str | None = None


def read_step_output(out: Any, *, env: str, turn: int) -> StepResult:
    """``out`` (a ``BaseTextEnvStepOutput``) as a ``StepResult``; the reward must be a
    finite real number, ``done`` a bool, observations ``{role, content}`` messages."""
    where = f"{env}.step (turn {turn})"
    if not isinstance(out, Mapping):
        raise EnvError(
            f"{where}: expected a BaseTextEnvStepOutput dict "
            f"(observations, reward, done, metadata), got {type(out).__name__}"
        )
    missing = [key for key in ("observations", "reward", "done") if key not in out]
    if missing:
        raise EnvError(f"{where}: expected keys observations, reward, done; missing {missing}")
    reward = out["reward"]
    if (
        isinstance(reward, bool)
        or not isinstance(reward, numbers.Real)
        or not math.isfinite(float(reward))
    ):
        raise EnvError(f"{where}.reward: expected a finite number, got {reward!r:.80}")
    done = out["done"]
    if _is_numpy_bool(done):  # an environment that compares numpy values gets one
        done = bool(done)
    if not isinstance(done, (bool, int)) or (isinstance(done, int) and done not in (0, 1)):
        raise EnvError(f"{where}.done: expected a bool, got {done!r:.80}")
    observations = out["observations"] or []
    if not isinstance(observations, list):
        raise EnvError(
            f"{where}.observations: expected a list of messages, got {observations!r:.80}"
        )
    for i, message in enumerate(observations):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise EnvError(
                f"{where}.observations[{i}]: expected a {{'role', 'content'}} str message, "
                f"got {message!r:.80}"
            )
    metadata = out.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise EnvError(f"{where}.metadata: expected a mapping or None, got {metadata!r:.80}")
    action = out.get("postprocessed_action")
    if action is not None and not isinstance(action, str):
        raise EnvError(f"{where}.postprocessed_action: expected a str or None, got {action!r:.80}")
    return StepResult(
        observations=[{"role": m["role"], "content": m["content"]} for m in observations],
        reward=float(reward),
        done=bool(done),
        metadata=dict(metadata),
        postprocessed_action=action,
    )


def _is_numpy_bool(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) == "b" and getattr(value, "shape", None) == ()
