"""Advantage estimators, policy losses, off-policy corrections, learning signals, R3
health metrics, sampler-replay scoring, the loss's token-mean rule and the optimizer
with its schedule (``optim``): pure torch functions, no trainer state, shared by every
trainer backend."""

from skyrl_train.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUPED_ESTIMATORS,
    GRPOAdvantages,
    compute_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
    compute_turn_grpo_advantages,
    contiguous_groups,
)
from skyrl_train.algorithms.metrics import MetricSums
from skyrl_train.algorithms.mismatch import (
    MISSING_LOGPROB,
    LogprobMismatch,
    RouterAgreement,
    logprob_mismatch,
    router_agreement,
)
from skyrl_train.algorithms.off_policy import (
    SEQUENCE_MASK_METRICS,
    TIS_RATIO_TYPES,
    OffPolicyCorrection,
    OffPolicyStats,
    OffPolicyWeights,
    off_policy_weights,
)
from skyrl_train.algorithms.policy_loss import (
    POLICY_LOSS_TYPES,
    PolicyLossOutput,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    token_mean_entropy,
)
from skyrl_train.algorithms.sampler_replay import (
    SamplerReplay,
    kept_set,
    sampler_log_probs,
    sampler_log_probs_and_entropy,
    sampler_logits,
)
from skyrl_train.algorithms.signals import (
    ENTROPY_BOOST_CAP,
    entropy_coefficient,
    mean_token_entropy,
    scheduled_entropy_coef,
    success_rate,
    token_entropy,
    zero_variance_group_fraction,
)
from skyrl_train.algorithms.token_mean import (
    data_parallel_mean_,
    microbatch_denominator,
    microbatch_loss_weight,
    num_microbatches,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ENTROPY_BOOST_CAP",
    "GROUPED_ESTIMATORS",
    "MISSING_LOGPROB",
    "POLICY_LOSS_TYPES",
    "SEQUENCE_MASK_METRICS",
    "TIS_RATIO_TYPES",
    "GRPOAdvantages",
    "LogprobMismatch",
    "MetricSums",
    "OffPolicyCorrection",
    "OffPolicyStats",
    "OffPolicyWeights",
    "PolicyLossOutput",
    "RouterAgreement",
    "SamplerReplay",
    "compute_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_rloo_advantages",
    "compute_turn_grpo_advantages",
    "contiguous_groups",
    "data_parallel_mean_",
    "gspo_policy_loss",
    "kept_set",
    "kl_penalty",
    "logprob_mismatch",
    "entropy_coefficient",
    "scheduled_entropy_coef",
    "mean_token_entropy",
    "microbatch_denominator",
    "microbatch_loss_weight",
    "num_microbatches",
    "off_policy_weights",
    "ppo_policy_loss",
    "router_agreement",
    "sampler_log_probs",
    "sampler_log_probs_and_entropy",
    "sampler_logits",
    "success_rate",
    "token_entropy",
    "token_mean_entropy",
    "zero_variance_group_fraction",
]
