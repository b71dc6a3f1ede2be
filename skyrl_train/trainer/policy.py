"""The policy side of one GRPO step, run inside the trainer actor.

Per batch: one forward as the trainer will train (routes replayed when R3 is on) gives
the old logprobs, the router agreement as trained and the rollout-vs-trainer
logprob mismatch; with R3 on, a second forward without replay measures what R3
removes (the trainer's native routing against the rollout's). Then PPO-clip updates
over mini-batches, then weights go back to the inference servers.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.models.tiny_moe import build_hf_model
from skyrl_train.algorithms import logprob_mismatch, ppo_policy_loss
from skyrl_train.config.schema import PPOConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import ConfigValidationError
from skyrl_train.trainer.weight_sync import WeightSyncer
from skyrl_train.workers.megatron.layout import slice_batch
from skyrl_train.workers.megatron.worker import MegatronPolicyWorker, OptimizerSettings


def initial_engine_weights(cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """The fp32 starting weights in the engine's layout: a saved model or ``model.seed``."""
    if cfg.model.path:
        from inference.engine.hf_engine import HFMoEEngine

        return HFMoEEngine.from_pretrained(cfg.model.path, dtype=torch.float32).state_dict()
    model = build_hf_model(cfg.model.tiny_moe(), seed=cfg.model.seed)
    return {name: t.detach() for name, t in model.state_dict().items()}


class PolicyTrainer:
    """Owns the Megatron policy worker; every method is a Ray actor call."""

    def __init__(self, cfg: PPOConfig, *, pad_token_id: int, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        if cfg.trainer.algorithm.use_kl_loss:
            raise ConfigValidationError(
                "trainer.algorithm.use_kl_loss",
                "a reference model is not built by this trainer yet; set it to false",
            )
        opt = cfg.trainer.policy.optimizer_config
        self.cfg = cfg
        self.worker = MegatronPolicyWorker(
            cfg.model.tiny_moe(),
            megatron_settings_of(cfg.trainer.policy.megatron_config),
            optimizer=OptimizerSettings(
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                betas=tuple(opt.adam_betas),
                max_grad_norm=opt.max_grad_norm,
            ),
            seed=cfg.trainer.seed,
            pad_token_id=pad_token_id,
        ).setup()
        self.worker.load_weights(initial_engine_weights(cfg).items())
        self.syncer = WeightSyncer(
            mode=cfg.trainer.weight_sync.mode, max_threads=cfg.trainer.weight_sync.max_threads
        )

    # ---- one training step --------------------------------------------------------

    def train(self, batch: TrainingBatch, advantages: torch.Tensor) -> dict[str, float]:
        t = self.cfg.trainer
        has_routes = batch.routed_experts is not None
        replay = has_routes and t.policy.megatron_config.moe_enable_routing_replay
        as_trained = self.worker.forward(
            batch,
            micro_batch_size=t.micro_forward_batch_size_per_gpu,
            replay_routes=replay,
            capture_routes=has_routes,
        )
        metrics: dict[str, float] = {}
        if has_routes:
            native = as_trained
            if replay:
                native = self.worker.forward(
                    batch,
                    micro_batch_size=t.micro_forward_batch_size_per_gpu,
                    replay_routes=False,
                    capture_routes=True,
                )
            metrics["r3/router_agreement_trained"] = self._agreement(batch, as_trained.routes)
            metrics["r3/router_agreement_native"] = self._agreement(batch, native.routes)
            if batch.rollout_logprobs is not None:
                metrics.update(
                    logprob_mismatch(
                        native.logprobs, batch.rollout_logprobs, batch.loss_mask
                    ).to_metrics("mismatch_native")
                )
        if batch.rollout_logprobs is not None:
            metrics.update(
                logprob_mismatch(
                    as_trained.logprobs, batch.rollout_logprobs, batch.loss_mask
                ).to_metrics("mismatch_trained")
            )
        batch.old_logprobs = as_trained.logprobs
        batch.advantages = advantages
        metrics.update(self._update(batch, replay=replay))
        return metrics

    def _agreement(self, batch: TrainingBatch, routes: torch.Tensor | None) -> float:
        assert routes is not None
        return self.worker.rollout_agreement(batch, routes)

    def _update(self, batch: TrainingBatch, *, replay: bool) -> dict[str, float]:
        t = self.cfg.trainer
        mini = t.policy_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        micro = t.micro_train_batch_size_per_gpu
        losses, grad_norms, clip_fracs, tis_means = [], [], [], []
        for _ in range(t.update_epochs_per_batch):
            for start in range(0, batch.batch_size, mini):
                part = slice_batch(batch, start, min(start + mini, batch.batch_size))
                num_micro = -(-part.batch_size // micro)
                # Each microbatch divides by the mini-batch's token count (over the
                # microbatch count the worker averages by), so the step is a true
                # token mean however the mini-batch is split.
                tokens = max(float(part.loss_mask.sum()), 1.0) / num_micro

                loss_fn = self._loss_fn(tokens, clip_fracs, tis_means)
                result = self.worker.train_step(
                    part, loss_fn=loss_fn, micro_batch_size=micro, replay_routes=replay
                )
                losses.append(result.loss * num_micro)
                grad_norms.append(result.grad_norm)
        metrics = {
            "train/policy_loss": float(np.mean(losses)),
            "train/grad_norm": float(np.mean(grad_norms)),
            "train/clip_fraction": float(np.mean(clip_fracs)),
            "train/optimizer_steps": float(len(grad_norms)),
        }
        if tis_means:
            metrics["train/tis_weight_mean"] = float(np.mean(tis_means))
        return metrics

    def _loss_fn(self, tokens: float, clip_fracs: list[float], tis_means: list[float]) -> Any:
        algo = self.cfg.trainer.algorithm

        def loss_fn(logprobs: torch.Tensor, mb: TrainingBatch) -> torch.Tensor:
            assert mb.old_logprobs is not None and mb.advantages is not None
            use_tis = algo.use_tis and mb.rollout_logprobs is not None
            out = ppo_policy_loss(
                logprobs,
                mb.old_logprobs,
                mb.advantages,
                mb.loss_mask,
                eps_clip_low=algo.eps_clip_low,
                eps_clip_high=algo.eps_clip_high,
                clip_ratio_c=algo.clip_ratio_c,
                rollout_logprobs=mb.rollout_logprobs if use_tis else None,
                tis_imp_ratio_cap=algo.tis_imp_ratio_cap if use_tis else None,
                denominator=tokens,
            )
            clip_fracs.append(out.metrics["clip_fraction"])
            if "tis_weight_mean" in out.metrics:
                tis_means.append(out.metrics["tis_weight_mean"])
            return out.loss

        return loss_fn

    # ---- weights and checkpoints ----------------------------------------------------

    def push_weights(self, urls: list[str], *, api_key: str | None = None) -> dict[str, float]:
        from inference.client import RemoteGenerateClient

        async def push() -> dict[str, float]:
            clients = [RemoteGenerateClient(url, api_key=api_key) for url in urls]
            try:
                stats = await self.syncer.push(clients, self.worker.export_weights())
            finally:
                await asyncio.gather(*(c.close() for c in clients))
            return {
                "sync/tensors_sent": float(stats.tensors_sent),
                "sync/tensors_total": float(stats.tensors_total),
                "sync/mbytes_sent": stats.bytes_sent / 2**20,
            }

        return asyncio.run(push())

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.worker.export_weights()}

    def save_checkpoint(self, folder: str) -> None:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        assert self.worker.optimizer is not None
        torch.save(
            {
                "model": self.worker.model.state_dict(),
                "optimizer": self.worker.optimizer.state_dict(),
                "torch_rng": torch.random.get_rng_state(),
                "numpy_rng": np.random.get_state(),
                "python_rng": random.getstate(),
            },
            path / "policy.pt",
        )

    def load_checkpoint(self, folder: str) -> None:
        state = torch.load(Path(folder) / "policy.pt", weights_only=False)
        assert self.worker.optimizer is not None
        self.worker.model.load_state_dict(state["model"])
        self.worker.optimizer.load_state_dict(state["optimizer"])
        torch.random.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])


def megatron_settings_of(node: Any) -> dict[str, Any]:
    """The worker's settings mapping from a ``megatron_config`` node.

    ``expert_tensor_parallel_size`` is a TransformerConfig field, so it travels with
    the passthrough kwargs; None means "same as tensor parallel" and is left out.
    """
    import dataclasses

    values = dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)
    etp = values.pop("expert_tensor_parallel_size", None)
    kwargs = dict(values.get("transformer_config_kwargs") or {})
    if etp is not None:
        kwargs.setdefault("expert_tensor_parallel_size", etp)
    values["transformer_config_kwargs"] = kwargs
    return values
