"""The Megatron-core backend (``trainer.strategy=megatron``): one trainer rank's policy
worker on megatron-core's GPTModel and its own schedules, routes replayed through
Megatron's ``RouterReplay``. ``workers/factory.py`` imports it only to build this
backend; importing it sets the warning filters below and loads the worker.

Modules: ``worker`` (``MegatronPolicyWorker``, ``workers/base.py``'s ``PolicyWorker``),
``model`` (TransformerConfig + GPTModel from ``MoEArchitecture`` and the
``trainer.policy.megatron_config`` node, and joining the parallel groups),
``cpu_compat`` (the CPU shim), ``schedule`` (one pass of microbatches through
Megatron's schedule), ``pipeline`` (results moved across pipeline stages), ``replay``
(the RouterReplay driver, keyed by model chunk and microbatch; the route checks are
``workers/routes.py``'s), ``capacity`` (forwards that drop no tokens),
``gradients`` (data-parallel averaging and the clipped global norm, by hand),
``tensor_parallel`` (a parameter's tensor-parallel group and its shards),
``convert`` with ``hf_tables`` (weights both ways in the engine's HF layout),
``layout`` (the padding the schedules need, the vocabulary shard) and ``placement``
(the layout a rank reports, where each parameter sits for resharding a rank's
checkpoint, and a rank file's state checked whole before a load).
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
