"""The FSDP2 policy worker (``trainer.strategy=fsdp``): transformers' own model classes,
``fully_shard`` per decoder layer over the data-parallel ranks, routing replay by hooks
on each MoE layer's gate.

Modules: ``model`` (the model from a checkpoint folder, and its sharding), ``state``
(shards in and out: weight load and export, the gradient norm), ``checkpoint`` (a
rank's checkpoint), ``replay`` (the gate hooks: replayed ids, captured routes),
``worker`` (the public worker). Nothing in this package imports megatron.
"""

from skyrl_train.workers.fsdp.worker import FSDPPolicyWorker

__all__ = ["FSDPPolicyWorker"]
