"""The default run's guard against its late collapse (``skip_flat_steps``): a step whose
groups are all flat while some prompts pay more than others makes no optimizer step,
so the entropy bonus alone never moves a policy that has learned something, on the
real Megatron worker through PolicyTrainer. Without the guard the same step raises
the policy's entropy, which is how the default run lost letters it had learned once
every group was flat. ``zero_variance_filter`` leaves flat groups'
tokens out of the loss, bonus included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.algorithms import compute_advantages, contiguous_groups
from skyrl_train.algorithms.dynamic_sampling import loss_rows
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.megatron import MegatronPolicyWorker

CFG = TinyMoEConfig()
PROMPTS, SAMPLES = 4, 2


def _rows(rewards: list[float], **options: object) -> torch.Tensor | None:
    settings: dict[str, object] = dict(
        estimator="grpo", zero_variance_filter=False, skip_flat_steps=True
    )
    settings.update(options)
    return loss_rows(rewards, SAMPLES, **settings)  # type: ignore[arg-type]


def test_loss_rows_leave_out_a_step_whose_flat_groups_pay_differently() -> None:
    flat = [0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert torch.equal(_rows(flat), torch.zeros(8, dtype=torch.bool))
    assert torch.equal(_rows(flat, estimator="rloo"), torch.zeros(8, dtype=torch.bool))
    # The config's null default ("the estimator decides") is on under grpo and rloo.
    assert torch.equal(_rows(flat, skip_flat_steps=None), torch.zeros(8, dtype=torch.bool))
    # Every sample scored the same (nothing found yet): the bonus-only step explores.
    assert _rows([0.0] * 8) is None
    assert _rows([1.0] * 8) is None
    one_varies = [0.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.0, 0.0]
    assert _rows(one_varies) is None  # a step with signal trains every row, bonus included
    # The filter keeps exactly the varying group's rows.
    kept = _rows(one_varies, zero_variance_filter=True)
    assert kept is not None and kept.tolist() == [False, False, True, True] + [False] * 4
    # Off, or where a flat group still has an advantage (batch whitening), or with one
    # sample a prompt (every group trivially flat): every row trains.
    assert _rows(flat, skip_flat_steps=False) is None
    assert _rows(flat, estimator="reinforce++") is None
    assert (
        loss_rows(flat, 1, estimator="grpo", zero_variance_filter=True, skip_flat_steps=True)
        is None
    )


def test_loss_rows_refuse_a_batch_that_is_not_whole_groups() -> None:
    with pytest.raises(ValueError, match="rewards: expected a multiple of group_size 2"):
        _rows([0.0, 1.0, 0.0])


def _trainer(
    tmp_path: Path, *overrides: str, optimizer: OptimizerConfig | None = None
) -> PolicyTrainer:
    torch.set_num_threads(1)
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            "trainer.policy_mini_batch_size=2",
            "trainer.micro_train_batch_size_per_gpu=4",
            f"generator.n_samples_per_prompt={SAMPLES}",
            "trainer.ref.log_kl=false",
            "trainer.algorithm.advantage_estimator=grpo",  # the guard is GRPO's and RLOO's
            "trainer.algorithm.use_entropy_loss=true",
            "trainer.algorithm.entropy_loss_coef=0.05",
            *overrides,
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=PAD_ID)
    trainer.worker = MegatronPolicyWorker(
        CFG.architecture(),
        cfg.trainer.policy.megatron_config,
        optimizer=optimizer or OptimizerConfig(lr=1e-2),
        pad_token_id=PAD_ID,
    ).setup()
    return trainer


def _batch(trainer: PolicyTrainer, rewards: list[float]) -> TrainingBatch:
    rows = PROMPTS * SAMPLES
    prompts = [[72 + b // SAMPLES, 105, 33][: 2 + b % 2] for b in range(rows)]
    responses = [[50 + b, 51, 52][: 1 + b % 3] for b in range(rows)]
    batch = make_batch(prompts, responses, num_layers=CFG.num_layers, top_k=CFG.num_experts_per_tok)
    batch.rewards = torch.tensor(rewards)
    algo = trainer.cfg.trainer.algorithm
    batch.advantages = compute_advantages(
        "grpo", batch.rewards, batch.loss_mask, contiguous_groups(rows, SAMPLES)
    )
    # What the driver sets (GRPOLoop.learn) from the step's rewards.
    batch.loss_rows = loss_rows(
        rewards,
        SAMPLES,
        estimator=algo.advantage_estimator,
        zero_variance_filter=algo.zero_variance_filter,
        skip_flat_steps=algo.skip_flat_steps,
    )
    return batch


VARYING = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0]
FLAT = [1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.worker.model.named_parameters()}


def _entropy(trainer: PolicyTrainer, batch: TrainingBatch) -> float:
    out = trainer.worker.forward(batch, replay_routes=False, entropy=True)
    assert out.entropy is not None
    return float((out.entropy * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_an_all_flat_step_leaves_the_policy_where_it_was(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    # A step with signal first, so Adam carries momentum into the flat step: skipping
    # the loss alone would still move the weights.
    moved = trainer.train(_batch(trainer, VARYING), step=1)
    assert moved["train/optimizer_steps"] == 2.0
    flat = _batch(trainer, FLAT)
    before, entropy = _weights(trainer), _entropy(trainer, flat)
    metrics = trainer.train(flat, step=2)
    assert metrics["train/optimizer_steps"] == 0.0
    assert metrics["train/skipped_optimizer_steps"] == 2.0
    assert "policy/entropy" in metrics  # still measured on a skipped step
    after = _weights(trainer)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _entropy(trainer, flat) == entropy


def test_without_the_guard_a_flat_step_raises_the_entropy(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "trainer.algorithm.skip_flat_steps=false")
    flat = _batch(trainer, FLAT)
    assert flat.loss_rows is None
    entropy = _entropy(trainer, flat)
    metrics = trainer.train(flat, step=1)
    assert metrics["train/optimizer_steps"] == 2.0
    # Zero advantages everywhere: the bonus is the whole gradient, and it flattens.
    assert _entropy(trainer, flat) > entropy + 1e-3


def test_the_filter_trains_only_the_varying_groups_tokens(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "trainer.algorithm.zero_variance_filter=true")
    batch = _batch(trainer, [1.0, 0.0] + [0.0] * 6)  # only group 0 varies
    assert batch.loss_rows is not None and batch.loss_rows.tolist() == [True, True] + [False] * 6
    metrics = trainer.train(batch, step=1)
    # Mini-batch 1 (groups 0-1) trains, mini-batch 2 (groups 2-3, flat) makes no step.
    assert metrics["train/optimizer_steps"] == 1.0
    assert metrics["train/skipped_optimizer_steps"] == 1.0
    # Entropy and the other metrics still describe every row's tokens.
    assert metrics["policy/num_tokens"] == float(batch.loss_mask.sum())


def test_a_skipped_step_logs_the_rate_the_optimizer_would_use(tmp_path: Path) -> None:
    # Warm-up over 100 optimizer steps to a peak of 1e-5: the first step uses 1e-7. A
    # flat first step takes none and logged the peak, 1e-5 (issue 38).
    warmup = OptimizerConfig(lr=1e-5, num_warmup_steps=100)
    trainer = _trainer(tmp_path, optimizer=warmup)
    flat = trainer.train(_batch(trainer, FLAT), step=1)
    assert flat["train/optimizer_steps"] == 0.0
    assert flat["train/lr"] == pytest.approx(1e-7)
    # Two optimizer steps (1e-7, 2e-7): the step logs the last rate it used ...
    moved = trainer.train(_batch(trainer, VARYING), step=2)
    assert moved["train/optimizer_steps"] == 2.0
    assert moved["train/lr"] == pytest.approx(2e-7)
    # ... and the next flat step the one the third would use.
    assert trainer.train(_batch(trainer, FLAT), step=3)["train/lr"] == pytest.approx(3e-7)
