"""Megatron-core policy worker with Rollout Routing Replay (R3).

Modules: ``cpu_compat`` (the CPU shim), ``settings`` (``trainer.policy.megatron_config``),
``model`` (TransformerConfig + GPTModel from ``TinyMoEConfig``), ``convert`` (weights
both ways in the engine's HF layout), ``layout`` (left-padded batch -> contiguous rows),
``replay`` (route checks and the RouterReplay driver), ``worker`` (the public worker).
"""

from skyrl_train.workers.megatron.layout import shard_for_data_parallel_rank
from skyrl_train.workers.megatron.settings import MegatronSettings
from skyrl_train.workers.megatron.worker import (
    ForwardResult,
    MegatronPolicyWorker,
    OptimizerSettings,
    TrainStepResult,
)

__all__ = [
    "ForwardResult",
    "MegatronPolicyWorker",
    "MegatronSettings",
    "OptimizerSettings",
    "TrainStepResult",
    "shard_for_data_parallel_rank",
]
