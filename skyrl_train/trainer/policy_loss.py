"""The PPO / GSPO loss one update microbatch trains on, with its KL and entropy terms,
as ``PolicyTrainer``'s update hands it to a worker's ``train_step`` (``LossFn``):
each term a token sum over the global mini-batch's share (``algorithms/token_mean.py``),
its clip and off-policy counts kept for the step's metrics."""

from __future__ import annotations

from typing import Any

import torch

from skyrl_train.algorithms import (
    MetricSums,
    OffPolicyCorrection,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    token_mean_entropy,
)
from skyrl_train.config.schema import AlgorithmConfig
from skyrl_train.dataset.batch import TrainingBatch, training_loss_mask


def policy_loss_fn(
    algo: AlgorithmConfig,
    *,
    tokens: float,
    clip_counts: list[tuple[float, float]],
    off_policy: MetricSums | None,
    entropy_coef: float,
) -> Any:
    """The loss of ``trainer.algorithm`` (``algo``) over ``tokens``
    (``microbatch_denominator``); each microbatch's (clipped, loss) token counts are
    appended to ``clip_counts``. ``off_policy``: where each microbatch's correction
    counts go (None: dropped)."""
    # use_tis maps onto token TIS here (OffPolicyCorrection.from_algorithm_config).
    correction = OffPolicyCorrection.from_algorithm_config(algo)

    def loss_fn(
        logprobs: torch.Tensor, mb: TrainingBatch, entropy: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert mb.old_logprobs is not None and mb.advantages is not None
        mask = training_loss_mask(mb)
        # Without the engine's logprobs there is nothing to correct against; the
        # batch trains uncorrected, as use_tis always did.
        correct = correction.enabled and mb.rollout_logprobs is not None
        common: dict[str, Any] = dict(
            eps_clip_low=algo.eps_clip_low,
            eps_clip_high=algo.eps_clip_high,
            rollout_logprobs=mb.rollout_logprobs if correct else None,
            off_policy_correction=correction if correct else None,
            denominator=tokens,
        )
        if algo.policy_loss_type == "gspo":
            # GSPO's sequence ratio needs whole sequences: microbatches split rows,
            # never a row, so each row's mean log-ratio is complete here.
            out = gspo_policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, **common)
        else:
            out = ppo_policy_loss(
                logprobs,
                mb.old_logprobs,
                mb.advantages,
                mask,
                clip_ratio_c=algo.clip_ratio_c,
                **common,
            )
        count = out.metrics["num_tokens"]
        clip_counts.append((out.metrics["clip_fraction"] * count, count))
        if out.off_policy is not None and off_policy is not None:
            off_policy.merge(out.off_policy.to_metrics("off_policy"))
        loss = out.loss
        # Both terms divide by the same global token count as the policy loss, so
        # the coefficients weigh token means whatever the microbatch split.
        if algo.use_kl_loss:
            assert mb.ref_logprobs is not None
            kl = kl_penalty(logprobs, mb.ref_logprobs, mask, denominator=tokens)
            loss = loss + algo.kl_loss_coef * kl
        if algo.use_entropy_loss:
            if entropy is None:
                raise ValueError(
                    "entropy: expected the worker's per-token entropy with "
                    "trainer.algorithm.use_entropy_loss, got None"
                )
            bonus = token_mean_entropy(entropy, mask, denominator=tokens)
            loss = loss - entropy_coef * bonus
        return loss

    return loss_fn
