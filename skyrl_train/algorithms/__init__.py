"""GRPO pieces and R3 health metrics: pure torch functions, no trainer state."""

from skyrl_train.algorithms.advantages import (
    GRPOAdvantages,
    compute_grpo_advantages,
    contiguous_groups,
)
from skyrl_train.algorithms.metrics import StepMetrics, reduction_of
from skyrl_train.algorithms.mismatch import (
    MISSING_LOGPROB,
    LogprobMismatch,
    RouterAgreement,
    logprob_mismatch,
    router_agreement,
)
from skyrl_train.algorithms.policy_loss import PolicyLossOutput, kl_penalty, ppo_policy_loss

__all__ = [
    "MISSING_LOGPROB",
    "GRPOAdvantages",
    "LogprobMismatch",
    "PolicyLossOutput",
    "RouterAgreement",
    "StepMetrics",
    "compute_grpo_advantages",
    "contiguous_groups",
    "kl_penalty",
    "logprob_mismatch",
    "ppo_policy_loss",
    "reduction_of",
    "router_agreement",
]
