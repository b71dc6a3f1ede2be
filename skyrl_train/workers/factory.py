"""Builds one trainer rank's policy worker for a backend (``workers/base.py``'s
``PolicyWorker``).

Called inside the trainer actor (``PolicyTrainer.setup``), which imports this module
there and not at its own import: the backend's package (the Megatron worker's modules,
their process-wide warning filters, and megatron-core once a worker is built) loads
only in the rank processes, never in the driver
(``tests/skyrl_train/trainer/test_driver_imports.py``). Megatron is the one backend.
"""

from __future__ import annotations

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.schema import PPOConfig, trainer_temperature
from skyrl_train.workers.base import PolicyWorker

STRATEGIES = ("megatron",)
"""The backends ``build_worker`` knows."""


def build_worker(
    cfg: PPOConfig,
    *,
    architecture: MoEArchitecture,
    pad_token_id: int,
    rank: int = 0,
    world_size: int = 1,
    init_method: str = "env://",
    strategy: str = "megatron",
) -> PolicyWorker:
    """Join torch.distributed as ``rank`` of ``world_size`` (unless this process
    already has a group) and build the ``strategy`` backend's worker, set up: model,
    parallel groups and optimizer, before any weights are loaded."""
    if strategy not in STRATEGIES:
        # No config key picks a backend yet, so a bad name is a caller's mistake.
        raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    import torch

    from skyrl_train.workers.megatron.model import init_distributed
    from skyrl_train.workers.megatron.worker import MegatronPolicyWorker

    if world_size > 1 and not torch.distributed.is_initialized():
        init_distributed(rank=rank, world_size=world_size, init_method=init_method)
    return MegatronPolicyWorker(
        architecture,
        cfg.trainer.policy.megatron_config,
        optimizer=cfg.trainer.policy.optimizer_config,
        seed=cfg.trainer.seed,
        pad_token_id=pad_token_id,
        temperature=trainer_temperature(cfg),
    ).setup()
