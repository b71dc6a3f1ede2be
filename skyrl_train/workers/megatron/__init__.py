"""Megatron-core policy worker with Rollout Routing Replay (R3).

Modules: ``cpu_compat`` (the CPU shim), ``model`` (TransformerConfig + GPTModel from
``MoEArchitecture`` and the ``trainer.policy.megatron_config`` node, which every part
takes whole), ``convert`` (weights both ways in the engine's HF layout), ``layout``
(left-padded batch -> contiguous rows), ``replay`` (route checks and the RouterReplay
driver, keyed by model chunk and microbatch), ``pipeline`` (results moved across
pipeline stages), ``placement`` (where each parameter sits, for resharding a
checkpoint), ``worker`` (the public worker, on Megatron's schedules).
"""

import warnings

# megatron-core warns once per module that Apex / Transformer Engine are missing; on
# CPU that is the expected setup, and the six warnings buried every run's first lines.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*(not installed|Falling)")
# TransformerConfig's own default cuda_graph_scope trips its deprecation warning.
warnings.filterwarnings("ignore", message=r"full scope is deprecated")

from skyrl_train.workers.megatron.worker import (  # noqa: E402
    ForwardResult,
    MegatronPolicyWorker,
    TrainStepResult,
)

__all__ = [
    "ForwardResult",
    "MegatronPolicyWorker",
    "TrainStepResult",
]
