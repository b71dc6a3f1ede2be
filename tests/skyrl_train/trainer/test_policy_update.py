"""PolicyTrainer's updates on a stand-in worker that keeps the PolicyWorker's
train_step contract: the logged ``train/policy_loss`` is the mini-batch token mean and
the gradient that of the token mean, however a mini-batch is cut into microbatches,
for both loss types; the old-logprob forward's entropy is logged over loss tokens."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _stand_in_worker import StandInWorker, check_stand_in

from skyrl_train.algorithms import gspo_policy_loss, kl_penalty, ppo_policy_loss, token_mean_entropy
from skyrl_train.config.compose import load_config
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.base import ForwardResult, TrainStepResult
from skyrl_train.workers.batch_layout import as_plan, split_microbatches
from skyrl_train.workers.microbatches import MicrobatchPlan

PROMPTS, N_SAMPLES, MINI_PROMPTS, WIDTH = 8, 2, 4, 5
ROWS = PROMPTS * N_SAMPLES


class TableWorker(StandInWorker):
    """Logprobs are a learnable table indexed by row id (``sequences[:, 0]``).

    ``train_step`` does what the real worker's does: the microbatches of
    ``micro_batch_size`` (a plan or a row count), each loss backpropagated divided by
    the microbatch count, and the mean of the microbatch losses returned. It records each optimizer
    step's gradient instead of stepping, so every mini-batch sees the same table.
    """

    def __init__(self, current: torch.Tensor, old: torch.Tensor) -> None:
        super().__init__()
        self.table = current.clone().requires_grad_()
        self.old = old
        self.grads: list[torch.Tensor] = []
        self.plans: list[MicrobatchPlan] = []

    def forward(self, batch: TrainingBatch, *, entropy: bool = False, **options: Any) -> Any:
        rows = batch.sequences[:, 0]
        return ForwardResult(
            logprobs=self.old[rows] * batch.response_mask,
            # entropy 1 on generated tokens, 5 on observations: only the 1s may count
            entropy=(5.0 - 4.0 * batch.loss_mask) * batch.response_mask if entropy else None,
        )

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
        self.plans.append(as_plan(batch, micro_batch_size))
        losses = []
        for mb in micro:
            logprobs = self.table[mb.sequences[:, 0]] * mb.response_mask
            loss = loss_fn(logprobs, mb)
            (loss / len(micro)).backward()
            losses.append(float(loss.detach()))
        assert self.table.grad is not None
        self.grads.append(self.table.grad.clone())
        return TrainStepResult(
            loss=sum(losses) / len(losses),
            grad_norm=float(self.table.grad.norm()),
            num_microbatches=len(micro),
            replayed=False,
            lr=1e-3,
        )


def _batch(generator: torch.Generator) -> TrainingBatch:
    # Rows generate 1..4 tokens, some with an observation (loss mask 0) in between, so
    # microbatches of one mini-batch hold different token counts.
    response = torch.zeros(ROWS, WIDTH, dtype=torch.int64)
    loss_mask = torch.zeros(ROWS, WIDTH, dtype=torch.int64)
    for r in range(ROWS):
        length = 1 + r % 4 + (r % 3 == 0)
        response[r, :length] = 1
        loss_mask[r, :length] = 1
        if length > 2:
            loss_mask[r, 1] = 0
    sequences = torch.ones(ROWS, 3 + WIDTH, dtype=torch.int64)
    sequences[:, 0] = torch.arange(ROWS)
    advantages = torch.randn(ROWS, 1, generator=generator) * loss_mask
    return TrainingBatch(
        sequences=sequences,
        attention_mask=torch.ones_like(sequences),
        response_mask=response,
        loss_mask=loss_mask,
        rewards=torch.zeros(ROWS),
        token_rewards=torch.zeros(ROWS, WIDTH),
        advantages=advantages,
    )


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
@pytest.mark.parametrize("num_micro", [1, 2, 8])
def test_logged_loss_is_the_mini_batch_token_mean(
    tmp_path: Path, num_micro: int, loss_type: str
) -> None:
    rows_per_mini = MINI_PROMPTS * N_SAMPLES
    clip = "0.01" if loss_type == "gspo" else "0.2"
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={MINI_PROMPTS}",
            f"trainer.micro_train_batch_size_per_gpu={rows_per_mini // num_micro}",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            f"trainer.algorithm.policy_loss_type={loss_type}",
            f"trainer.algorithm.eps_clip_low={clip}",
            f"trainer.algorithm.eps_clip_high={clip}",
            # The policy loss alone: the entropy bonus has its own test below.
            "trainer.algorithm.use_entropy_loss=false",
        ]
    )
    generator = torch.Generator().manual_seed(num_micro)
    old = -torch.rand(ROWS, WIDTH, generator=generator) * 3
    current = old + torch.randn(ROWS, WIDTH, generator=generator) * 0.3  # some tokens clip
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    worker = TableWorker(current, old)
    trainer.worker = check_stand_in(worker)
    batch = _batch(generator)

    metrics = trainer.train(batch, step=1)

    algo = cfg.trainer.algorithm
    direct_losses = []
    for k, start in enumerate(range(0, ROWS, rows_per_mini)):
        rows = slice(start, start + rows_per_mini)
        table = current.clone().requires_grad_()
        mask = batch.loss_mask[rows]
        loss = gspo_policy_loss if loss_type == "gspo" else ppo_policy_loss
        out = loss(
            table[rows] * batch.response_mask[rows],
            old[rows] * batch.response_mask[rows],
            batch.advantages[rows],  # type: ignore[index]
            mask,
            eps_clip_low=algo.eps_clip_low,
            eps_clip_high=algo.eps_clip_high,
        )
        out.loss.backward()
        direct_losses.append(out.loss.item())
        assert torch.allclose(worker.grads[k], table.grad, atol=1e-7)
    assert worker.grads[0].abs().sum() > 0
    assert metrics["train/optimizer_steps"] == 2.0
    assert metrics["train/policy_loss"] == pytest.approx(float(np.mean(direct_losses)), rel=1e-5)
    assert metrics["policy/entropy"] == 1.0
    assert metrics["policy/num_tokens"] == float(batch.loss_mask.sum())


def _whole_batch_ppo_loss(
    logprobs: torch.Tensor, old: torch.Tensor, batch: TrainingBatch, cfg: Any
) -> torch.Tensor:
    """The regular PPO loss of ``batch`` as one mini-batch, its old logprobs ``old`` on
    the response positions: what the trainer's loss is on a one-mini-batch step."""
    algo = cfg.trainer.algorithm
    return ppo_policy_loss(
        logprobs,
        old * batch.response_mask,
        batch.advantages,  # type: ignore[arg-type]
        batch.loss_mask,
        eps_clip_low=algo.eps_clip_low,
        eps_clip_high=algo.eps_clip_high,
    ).loss


class RegularizedWorker(TableWorker):
    """``TableWorker`` with a reference (``swapped_weights`` swaps the logprob table the
    forward reads) and a per-token entropy handed to the loss, differentiable through
    the table: entropy = -logprob, so its gradient is known."""

    @contextmanager
    def swapped_weights(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        own, self.old = self.old, weights["table"]
        try:
            yield
        finally:
            self.old = own

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: Any,
        micro_batch_size: int | MicrobatchPlan,
        **options: Any,
    ) -> TrainStepResult:
        assert options["entropy"] is True

        def with_entropy(logprobs: torch.Tensor, mb: TrainingBatch) -> torch.Tensor:
            return loss_fn(logprobs, mb, -logprobs)

        return super().train_step(batch, loss_fn=with_entropy, micro_batch_size=micro_batch_size)


def test_kl_and_entropy_terms_join_the_token_mean_loss(tmp_path: Path) -> None:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            f"trainer.micro_train_batch_size_per_gpu={ROWS // 4}",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            "trainer.algorithm.use_kl_loss=true",
            "trainer.algorithm.kl_loss_coef=0.5",
            "trainer.algorithm.use_entropy_loss=true",
            "trainer.algorithm.entropy_loss_coef=0.1",
        ]
    )
    generator = torch.Generator().manual_seed(7)
    old = -torch.rand(ROWS, WIDTH, generator=generator) * 3
    current = old + torch.randn(ROWS, WIDTH, generator=generator) * 0.3
    ref = old + torch.randn(ROWS, WIDTH, generator=generator) * 0.5
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    worker = RegularizedWorker(current, old)
    trainer.worker = check_stand_in(worker)
    trainer.reference = {"table": ref}
    batch = _batch(generator)

    metrics = trainer.train(batch, step=1)

    mask, response = batch.loss_mask, batch.response_mask
    assert metrics["policy/kl_to_ref"] == pytest.approx(
        float(kl_penalty(old * response, ref * response, mask)), rel=1e-6
    )
    table = current.clone().requires_grad_()
    logprobs = table * response
    policy = _whole_batch_ppo_loss(logprobs, old, batch, cfg)
    kl = kl_penalty(logprobs, ref * response, mask)
    entropy = token_mean_entropy(-logprobs, mask)
    (policy + 0.5 * kl - 0.1 * entropy).backward()
    assert torch.allclose(worker.grads[0], table.grad, atol=1e-6)
    # Each term moved the gradient: without them it would be the policy loss's alone.
    bare = current.clone().requires_grad_()
    _whole_batch_ppo_loss(bare * response, old, batch, cfg).backward()
    assert not torch.allclose(worker.grads[0], bare.grad, atol=1e-4)


@pytest.mark.parametrize(
    ("step", "ceiling", "coef"), [(1, None, 0.1), (3, None, 0.05), (5, None, 0.0), (3, 0.5, 0.0)]
)
def test_the_bonus_follows_its_schedule_over_the_run(
    tmp_path: Path, step: int, ceiling: float | None, coef: float
) -> None:
    """``entropy_loss_coef_end``: 0.1 at step 1 to 0 at the run's last step (5), the
    step's coefficient logged and used; a ceiling then acts on the scheduled value."""
    ceiling_key = f"trainer.algorithm.entropy_ceiling={'null' if ceiling is None else ceiling}"
    overrides = ["trainer.num_steps=5", "trainer.algorithm.entropy_loss_coef_end=0.0", ceiling_key]
    _train_with_bonus(tmp_path, overrides, step=step, coef=coef, seed=5)


def _train_with_bonus(
    tmp_path: Path, overrides: list[str], *, step: int, coef: float, seed: int
) -> dict[str, float]:
    """One step on the regularized stand-in with a 0.1 bonus and ``overrides``: the
    logged coefficient is ``coef`` and the gradient is the loss's with it."""
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            "trainer.algorithm.entropy_loss_coef=0.1",
            "trainer.ref.log_kl=false",
            *overrides,
        ]
    )
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(ROWS, WIDTH, generator=generator) * 3
    current = old + torch.randn(ROWS, WIDTH, generator=generator) * 0.3
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    worker = RegularizedWorker(current, old)
    trainer.worker = check_stand_in(worker)
    batch = _batch(generator)

    metrics = dict(trainer.train(batch, step=step))

    assert metrics["policy/entropy_coef"] == pytest.approx(coef)
    mask, response = batch.loss_mask, batch.response_mask
    table = current.clone().requires_grad_()
    logprobs = table * response
    policy = _whole_batch_ppo_loss(logprobs, old, batch, cfg)
    (policy - coef * token_mean_entropy(-logprobs, mask)).backward()
    assert torch.allclose(worker.grads[0], table.grad, atol=1e-6)
    return metrics


def test_entropy_loss_without_the_workers_entropy_fails_loudly(tmp_path: Path) -> None:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            "trainer.algorithm.use_entropy_loss=true",
            "trainer.ref.log_kl=false",
        ]
    )
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(ROWS, WIDTH, generator=generator)
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    trainer.worker = check_stand_in(TableWorker(old, old))
    with pytest.raises(ValueError, match="use_entropy_loss, got None"):
        trainer.train(_batch(generator), step=1)


@pytest.mark.parametrize(
    ("target", "ceiling", "coef"),
    [
        (None, None, 0.1),
        (0.5, None, 0.1),
        (4.0, None, 0.4),
        (50.0, None, 1.0),
        (None, 1.0, 0.0),
        (None, 0.5, 0.0),
        (None, 2.0, 0.1),
        (4.0, 8.0, 0.4),
    ],
)
def test_entropy_target_and_ceiling_set_the_bonus_of_a_step(
    tmp_path: Path, target: float | None, ceiling: float | None, coef: float
) -> None:
    """The stand-in's entropy is 1 nat on every token: a target above it multiplies the
    coefficient by target / 1 (at most ENTROPY_BOOST_CAP = 10), one below it or none
    leaves it alone; a ceiling at or below it switches the bonus off, one above it
    leaves it alone; the gradient is the loss's with that coefficient."""
    overrides = [
        f"trainer.algorithm.entropy_target={'null' if target is None else target}",
        f"trainer.algorithm.entropy_ceiling={'null' if ceiling is None else ceiling}",
    ]
    metrics = _train_with_bonus(tmp_path, overrides, step=1, coef=coef, seed=11)
    assert metrics["policy/entropy"] == 1.0
