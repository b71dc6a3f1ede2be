"""The seam between the generator and batch preprocessing."""

from __future__ import annotations

from collections.abc import Sequence
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
    """Why each trajectory ended: ``done`` (the environment), ``max_turns`` or ``budget``
    (``generator.max_response_tokens``). SkyRL's name; not the engine's per-request
    ``finish_reason`` (``stop``/``length``, OpenAI's name on the wire), which says why
    one turn's generation stopped: a trajectory has one stop reason and a finish
    reason per turn."""
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

    def take(self, indices: Sequence[int]) -> GeneratorOutput:
        """The trajectories at ``indices`` in that order (repeats allowed), every
        per-trajectory field with them (routes, logprobs, solved); ``rollout_metrics``
        describe the generation that ran and stay as they are."""
        size = len(self.rewards)
        bad = [i for i in indices if not 0 <= i < size]
        if bad:
            raise IndexError(f"indices: expected 0 <= i < {size}, got {bad[:5]}")

        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in indices]

        return GeneratorOutput(
            prompt_token_ids=[self.prompt_token_ids[i] for i in indices],
            response_ids=[self.response_ids[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            rewards=[self.rewards[i] for i in indices],
            token_rewards=[self.token_rewards[i] for i in indices],
            stop_reasons=[self.stop_reasons[i] for i in indices],
            rollout_metrics=dict(self.rollout_metrics),
            rollout_logprobs=pick(self.rollout_logprobs),
            routed_experts=pick(self.routed_experts),
            solved=pick(self.solved),
        )


def concat_outputs(parts: Sequence[GeneratorOutput]) -> GeneratorOutput:
    """Several generations' trajectories as one output, in order; ``rollout_metrics``
    are the first part's. Optional fields must be present in all parts or in none."""
    if not parts:
        raise ValueError("parts: expected at least one GeneratorOutput, got none")

    def join(name: str) -> list[Any] | None:
        values = [getattr(p, name) for p in parts]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"{name}: expected it in every part or in none, got a mix")
        return [item for v in values for item in v]

    def required(name: str) -> list[Any]:
        return [item for p in parts for item in getattr(p, name)]

    return GeneratorOutput(
        prompt_token_ids=required("prompt_token_ids"),
        response_ids=required("response_ids"),
        loss_masks=required("loss_masks"),
        rewards=required("rewards"),
        token_rewards=required("token_rewards"),
        stop_reasons=required("stop_reasons"),
        rollout_metrics=dict(parts[0].rollout_metrics),
        rollout_logprobs=join("rollout_logprobs"),
        routed_experts=join("routed_experts"),
        solved=join("solved"),
    )
