"""The seam between the generator and batch preprocessing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class GeneratorInput:
    """One batch of rollouts to run: a prompt (chat messages) and an environment each."""

    prompts: list[list[dict[str, str]]]
    env_names: list[str]
    env_extras: list[dict[str, Any]] = field(default_factory=list)
    """Per-prompt keyword arguments for the environment; empty means none."""


@dataclass
class GeneratorOutput:
    """Per-trajectory results, all lists of length B (number of trajectories).

    Token-level lists are aligned with ``response_ids``: index j is response token j.
    """

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_masks: list[list[int]]
    """1 on tokens the policy generated, 0 on environment observation tokens."""
    rewards: list[float]
    """Trajectory reward (sum of the environment's step rewards)."""
    token_rewards: list[list[float]]
    """Per response token; the trajectory reward sits on the last loss-active token."""
    stop_reasons: list[str]
    rollout_metrics: dict[str, float]
    rollout_logprobs: list[list[float]] | None = None
    """Sampled-token logprob per response token, 0.0 on observation tokens; None when
    the engine did not return logprobs."""
    routed_experts: list[np.ndarray] | None = None
    """Per trajectory an integer array ``[rows, layers, topk]``: row t is the routing
    of token t of prompt+response when it was fed as input, for t < rows. Tokens at
    or beyond ``rows`` were never routed (the last token, say). None when R3 is off."""
    solved: list[bool | None] | None = None
    """Per trajectory whether its episode was solved: True when a step's metadata said
    ``solved: True``, False when steps reported ``solved`` but never True, None when
    its environment never reported it. The whole field is None when none did."""
