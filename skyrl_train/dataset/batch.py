"""The seam between batch preprocessing and the trainer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainingBatch:
    """A padded training batch of B trajectories.

    Layout (SkyRL's): each row of ``sequences`` is the prompt left-padded to P, then
    the response right-padded to R, so S = P + R and the response occupies the last
    R columns. Trainers that need contiguous tokens (Megatron ignores position_ids
    for RoPE) re-lay rows out themselves, routes with them.
    """

    sequences: torch.Tensor
    """[B, S] int64 token ids; padding holds the pad token id."""
    attention_mask: torch.Tensor
    """[B, S] int64, 1 on real tokens."""
    response_mask: torch.Tensor
    """[B, R] int64, 1 on real response tokens (generated or observation)."""
    loss_mask: torch.Tensor
    """[B, R] int64, 1 on tokens the policy generated."""
    rewards: torch.Tensor
    """[B] float32 trajectory rewards."""
    token_rewards: torch.Tensor
    """[B, R] float32."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, R] float32 sampled-token logprobs from the engine; None if not returned."""
    routed_experts: torch.Tensor | None = None
    """[B, S, L, K] in the widest sample dtype, aligned with ``sequences``; padding
    and uncaptured rows hold ``dataset.routes.route_filler`` (``arange(K)``). None when
    R3 is off."""
    router_padding_mask: torch.Tensor | None = None
    """[B, S] bool, True on padding and uncaptured rows (not the loss mask: prompt and
    observation tokens still replay). None when R3 is off."""
    advantages: torch.Tensor | None = None
    """[B, R] float32 per-token advantages; set by the trainer before the policy update."""
    old_logprobs: torch.Tensor | None = None
    """[B, R] float32 logprobs of the policy that is being updated, taken before the
    first optimizer step of this batch; set by the trainer."""
    ref_logprobs: torch.Tensor | None = None
    """[B, R] float32 logprobs of the reference policy (the run's initial weights); set
    by the trainer when a KL loss needs them."""

    @property
    def batch_size(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def num_actions(self) -> int:
        return int(self.response_mask.shape[1])
