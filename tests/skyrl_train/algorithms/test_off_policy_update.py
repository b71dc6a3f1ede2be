"""The off-policy correction through ``PolicyTrainer``'s update: its metrics are token
means over the step's microbatches (not means of microbatch means), counted once per
batch, and ``use_tis`` and ``off_policy_correction.tis_ratio_type: token`` train alike.

A stand-in worker keeps ``MegatronPolicyWorker``'s ``train_step`` contract: it cuts
the mini-batch into microbatches of ``micro_batch_size`` rows and calls the loss on
each. Two rows, one per microbatch:

    row 0: 1 loss token,  ratio exp(old - rollout) = 3  -> weight min(3, 2) = 2 (clipped)
    row 1: 4 loss tokens, ratio 1, one of them the engine's -9999 placeholder -> weight 1

Token means over the 5 tokens: weight (2 + 4) / 5 = 1.2, clipped 1 / 5, placeholder
1 / 5; the means of the two microbatch means would be 1.5, 0.5 and 0.125.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from skyrl_train.config.compose import load_config
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.base import ForwardResult, TrainStepResult
from skyrl_train.workers.batch_layout import split_microbatches
from skyrl_train.workers.microbatches import MicrobatchPlan
from tests.skyrl_train.trainer._stand_in_worker import StandInWorker as PolicyWorkerStandIn
from tests.skyrl_train.trainer._stand_in_worker import check_stand_in

WIDTH = 4
OLD = torch.full((2, WIDTH), -1.0)


class StandInWorker(PolicyWorkerStandIn):
    """Logprobs equal the old ones (PPO ratio 1); records how many microbatches ran."""

    def __init__(self) -> None:
        super().__init__()
        self.table = OLD.clone().requires_grad_()
        self.microbatches = 0

    def forward(self, batch: TrainingBatch, **options: Any) -> Any:
        return ForwardResult(logprobs=OLD[batch.sequences[:, 0]] * batch.response_mask)

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: Any,
        micro_batch_size: int | MicrobatchPlan,
        **options: Any,
    ) -> TrainStepResult:
        self.table.grad = None
        micro = split_microbatches(batch, micro_batch_size)
        losses = []
        for mb in micro:
            loss = loss_fn(self.table[mb.sequences[:, 0]] * mb.response_mask, mb)
            (loss / len(micro)).backward()
            losses.append(float(loss.detach()))
            self.microbatches += 1
        assert self.table.grad is not None
        return TrainStepResult(
            loss=sum(losses) / len(losses),
            grad_norm=float(self.table.grad.norm()),
            num_microbatches=len(micro),
            replayed=False,
            lr=1e-3,
        )


def _batch() -> TrainingBatch:
    loss_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    rollout = OLD.clone()
    rollout[0, 0] = -1.0 - math.log(3.0)
    rollout[1, 2] = -9999.0
    sequences = torch.ones(2, 3 + WIDTH, dtype=torch.int64)
    sequences[:, 0] = torch.arange(2)
    return TrainingBatch(
        sequences=sequences,
        attention_mask=torch.ones_like(sequences),
        response_mask=loss_mask.clone(),
        loss_mask=loss_mask,
        rewards=torch.zeros(2),
        token_rewards=torch.zeros(2, WIDTH),
        rollout_logprobs=rollout,
        advantages=torch.ones(2, WIDTH) * loss_mask,
    )


def _train(tmp_path: Path, overrides: list[str]) -> tuple[dict[str, float], StandInWorker]:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            "trainer.train_batch_size=1",
            "trainer.policy_mini_batch_size=1",
            "generator.n_samples_per_prompt=2",
            "trainer.micro_train_batch_size_per_gpu=1",  # one row per microbatch
            "trainer.algorithm.use_entropy_loss=false",
            "trainer.ref.log_kl=false",
            *overrides,
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    worker = StandInWorker()
    trainer.worker = check_stand_in(worker)
    return trainer.train(_batch(), step=1), worker


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.algorithm.use_tis=true"],
        ["trainer.algorithm.off_policy_correction.tis_ratio_type=token"],
    ],
    ids=["use_tis", "tis_ratio_type"],
)
def test_metrics_are_token_means_across_microbatches(tmp_path: Path, overrides: list[str]) -> None:
    metrics, worker = _train(tmp_path, overrides)
    assert worker.microbatches == 2
    assert metrics["train/tis_weight_mean"] == pytest.approx(1.2)  # mean of means: 1.5
    assert metrics["off_policy/weight_mean"] == pytest.approx(1.2)
    assert metrics["off_policy/weight_clip_frac"] == pytest.approx(0.2)  # not 0.5
    assert metrics["off_policy/placeholder_token_frac"] == pytest.approx(0.2)  # not 0.125
    assert metrics["off_policy/num_tokens"] == 5.0
    assert metrics["off_policy/masked_token_frac"] == 0.0
    # 4 real ratios: 3, 1, 1, 1 (the placeholder has none)
    assert metrics["off_policy/ratio_mean"] == pytest.approx(6 / 4)
    assert metrics["off_policy/min_ratio"] == pytest.approx(1.0)
    assert metrics["off_policy/max_ratio"] == pytest.approx(3.0)
    # Each microbatch's loss divides by the mini-batch's 5 tokens: -(2 + 4) / 5 overall,
    # logged as the mean of the two microbatch losses each scaled by 2 microbatches.
    assert metrics["train/policy_loss"] == pytest.approx(-(2 + 4) / 5)


def test_a_mask_alone_logs_no_tis_weight_but_its_shares(tmp_path: Path) -> None:
    # Outlier bound 2.5: row 0 (ratio 3) is dropped, 1 of 5 tokens and 1 of 2 rows.
    metrics, _ = _train(
        tmp_path, ["trainer.algorithm.off_policy_correction.outlier_token_is_threshold_high=2.5"]
    )
    assert "train/tis_weight_mean" not in metrics
    assert metrics["off_policy/masked_token_frac"] == pytest.approx(0.2)
    assert metrics["off_policy/masked_seq_frac"] == pytest.approx(0.5)
    assert metrics["train/policy_loss"] == pytest.approx(-4 / 5)  # row 0 still counts in /5


def test_later_epochs_do_not_count_the_batch_again(tmp_path: Path) -> None:
    metrics, worker = _train(
        tmp_path, ["trainer.algorithm.use_tis=true", "trainer.update_epochs_per_batch=2"]
    )
    assert worker.microbatches == 4
    assert metrics["off_policy/num_tokens"] == 5.0
    assert metrics["train/tis_weight_mean"] == pytest.approx(1.2)


def test_no_correction_logs_none(tmp_path: Path) -> None:
    metrics, _ = _train(tmp_path, [])
    assert not [k for k in metrics if k.startswith("off_policy/") or k == "train/tis_weight_mean"]
    assert metrics["train/policy_loss"] == pytest.approx(-1.0)
