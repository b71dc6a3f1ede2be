"""Builds one trainer rank's policy worker for the run's backend, ``trainer.strategy``
(``workers/base.py``'s ``PolicyWorker``).

Called inside the trainer actor (``PolicyTrainer.setup``), which imports this module
there and not at its own import; each backend's package is imported here only when that
backend is built: the Megatron worker's modules (their process-wide warning filters, and
megatron-core once a worker is built) or the FSDP worker's, which import no Megatron
module. Neither loads in the driver (``tests/skyrl_train/trainer/test_driver_imports.py``).
"""

from __future__ import annotations

from pathlib import Path

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.lr_schedule import run_optimizer_config
from skyrl_train.config.routing_replay import megatron_worker_config
from skyrl_train.config.schema import STRATEGIES, PPOConfig, trainer_temperature
from skyrl_train.workers.base import PolicyWorker

__all__ = ["STRATEGIES", "build_worker"]


def build_worker(
    cfg: PPOConfig,
    *,
    architecture: MoEArchitecture,
    pad_token_id: int,
    checkpoint: str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    init_method: str = "env://",
    strategy: str | None = None,
) -> PolicyWorker:
    """Join torch.distributed as ``rank`` of ``world_size`` (unless this process
    already has a group) and build the ``trainer.strategy`` backend's worker, set up:
    model, parallel groups and optimizer, before any weights are loaded.

    ``checkpoint`` is the model folder the ranks load weights from (the FSDP worker
    builds transformers' model class from it); ``cfg`` has been validated, so its
    replay mode is ``trainer.policy.routing_replay`` alone. ``strategy`` (None: the
    config's ``trainer.strategy``) builds another backend on the same config, as the
    differential tests do."""
    strategy = cfg.trainer.strategy if strategy is None else strategy
    if strategy not in STRATEGIES:
        # validate_cfg refuses it first (the schema's choices); a config that skipped
        # validation gets the same words.
        raise ValueError(
            f"trainer.strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}"
        )
    import torch

    policy = cfg.trainer.policy
    joined = torch.distributed.is_initialized()
    if strategy == "fsdp":
        if checkpoint is None:
            raise ValueError(
                "checkpoint: expected the model folder the FSDP worker builds "
                "transformers' model class from, got None"
            )
        from skyrl_train.utils.distributed import init_distributed
        from skyrl_train.workers.fsdp.worker import FSDPPolicyWorker

        if world_size > 1 and not joined:
            init_distributed(rank=rank, world_size=world_size, init_method=init_method)

        return FSDPPolicyWorker(
            checkpoint,
            architecture,
            policy.fsdp_config,
            optimizer=run_optimizer_config(cfg),
            seed=cfg.trainer.seed,
            pad_token_id=pad_token_id,
            temperature=trainer_temperature(cfg),
            routing_replay=policy.routing_replay.enabled,
            remove_microbatch_padding=cfg.trainer.remove_microbatch_padding,
        ).setup()
    from skyrl_train.workers.megatron.groups import init_distributed as megatron_join
    from skyrl_train.workers.megatron.worker import MegatronPolicyWorker

    if world_size > 1 and not joined:
        megatron_join(rank=rank, world_size=world_size, init_method=init_method)
    return MegatronPolicyWorker(
        architecture,
        # The node's two deprecated keys (null by now) hold the run's mode too, so the
        # node agrees with the argument the worker replays by.
        megatron_worker_config(policy.megatron_config, policy.routing_replay),
        optimizer=run_optimizer_config(cfg),
        seed=cfg.trainer.seed,
        pad_token_id=pad_token_id,
        temperature=trainer_temperature(cfg),
        routing_replay=policy.routing_replay.enabled,
        remove_microbatch_padding=cfg.trainer.remove_microbatch_padding,
    ).setup()
