"""A NaN or inf loss, grad norm or weight stops the run before the weights are pushed:
PolicyTrainer.train on a stand-in worker, then GRPOLoop.run around it (no Ray)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _stand_in_worker import StandInWorker, check_stand_in

from skyrl_train.config.compose import load_config
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import NonFiniteError
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.trainer import loop as loop_module
from skyrl_train.trainer.finite import require_finite, require_finite_weights
from skyrl_train.trainer.loop import GRPOLoop
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.base import ForwardResult, TrainStepResult

N_SAMPLES = 2
PROMPTS = 2


class NaNWorker(StandInWorker):
    """A stand-in ``PolicyWorker``: ``poison`` picks what its optimizer step
    turns non-finite ("loss", "grad_norm", "weight" or None)."""

    def __init__(self, poison: str | None) -> None:
        super().__init__()
        self.poison = poison
        self.last = torch.nn.Linear(3, 2)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 3), self.last)

    def forward(self, batch: TrainingBatch, **options: Any) -> ForwardResult:
        return ForwardResult(logprobs=torch.zeros(batch.loss_mask.shape))

    def train_step(self, batch: TrainingBatch, *, loss_fn: Any, **options: Any) -> TrainStepResult:
        zeros = torch.zeros(batch.loss_mask.shape)
        # Like the real worker: the per-token entropy joins the call when asked for.
        extra = [zeros] if options.get("entropy") else []
        loss = float(loss_fn(zeros, batch, *extra))
        if self.poison == "weight":
            with torch.no_grad():
                self.last.bias[1] = math.nan
        return TrainStepResult(
            loss=math.nan if self.poison == "loss" else loss,
            grad_norm=math.inf if self.poison == "grad_norm" else 0.5,
            num_microbatches=1,
            replayed=False,
            lr=1e-3,
        )


def _cfg(tmp_path: Path) -> Any:
    return load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            "trainer.eval_interval=0",
            "trainer.ckpt_interval=1",
            "logging.progress_bar=false",
            # Fake engines serve no weights to check (test_served_weights.py does).
            "generator.inference_engine.verify_weights_interval=0",
        ]
    )


def _trainer(tmp_path: Path, poison: str | None) -> PolicyTrainer:
    trainer = PolicyTrainer(_cfg(tmp_path), checkpoint=str(tmp_path), pad_token_id=0)
    trainer.worker = check_stand_in(NaNWorker(poison))
    return trainer


def _batch(rows: int = PROMPTS * N_SAMPLES) -> TrainingBatch:
    return TrainingBatch(
        sequences=torch.ones(rows, 5, dtype=torch.int64),
        attention_mask=torch.ones(rows, 5, dtype=torch.int64),
        response_mask=torch.ones(rows, 2, dtype=torch.int64),
        loss_mask=torch.ones(rows, 2, dtype=torch.int64),
        rewards=torch.arange(rows, dtype=torch.float32),
        token_rewards=torch.zeros(rows, 2),
        advantages=torch.ones(rows, 2),
    )


def test_require_finite_names_the_quantity_and_step() -> None:
    require_finite(0.25, quantity="train/grad_norm", step=3, where="rank 0")
    with pytest.raises(NonFiniteError, match=r"^train/grad_norm at step 3: expected a finite"):
        require_finite(math.inf, quantity="train/grad_norm", step=3, where="rank 0")


def test_require_finite_weights_names_the_first_bad_parameter() -> None:
    params = [("a", torch.ones(4)), ("b", torch.tensor([1.0, -math.inf])), ("c", torch.ones(1))]
    with pytest.raises(NonFiniteError, match=r"got -inf in 'b' \(rank 1\)") as info:
        require_finite_weights(params, step=7, where="rank 1")
    assert (info.value.quantity, info.value.step, info.value.parameter) == ("weights", 7, "b")


@pytest.mark.parametrize(
    ("poison", "quantity", "parameter"),
    [
        ("loss", "train/policy_loss", None),
        ("grad_norm", "train/grad_norm", None),
        ("weight", "weights", "1.bias"),
    ],
)
def test_trainer_refuses_a_non_finite_step(
    tmp_path: Path, poison: str, quantity: str, parameter: str | None
) -> None:
    with pytest.raises(NonFiniteError) as info:
        _trainer(tmp_path, poison).train(_batch(), step=5)
    assert (info.value.quantity, info.value.step, info.value.parameter) == (
        quantity,
        5,
        parameter,
    )
    assert str(info.value).startswith(f"{quantity} at step 5: expected")


def test_trainer_passes_a_finite_step(tmp_path: Path) -> None:
    metrics = _trainer(tmp_path, None).train(_batch(), step=1)
    assert metrics["train/grad_norm"] == 0.5


# ------------------------------------------------------------------ the loop stops


class TrainerPolicy:
    """GRPOLoop's policy interface around one in-process PolicyTrainer."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer
        self.pushes = 0
        self.saves = 0

    async def train(self, batch: TrainingBatch, advantages: torch.Tensor, *, step: int) -> Any:
        return self.trainer.train(dataclasses.replace(batch, advantages=advantages), step=step)

    async def push_weights(
        self, urls: list[str], *, api_key: str | None = None, policy_version: int | None = None
    ) -> Any:
        self.pushes += 1
        return {}

    async def save_checkpoint(self, folder: str) -> None:
        self.saves += 1


class FixedGenerator:
    """Stands in for GymGenerator: the same finished rollouts every step."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        rows = len(inputs.prompts)
        return GeneratorOutput(
            prompt_token_ids=[[1, 2, 3]] * rows,
            response_ids=[[4, 5]] * rows,
            loss_masks=[[1, 1]] * rows,
            rewards=[float(i % 2) for i in range(rows)],
            token_rewards=[[0.0, float(i % 2)] for i in range(rows)],
            stop_reasons=["stop"] * rows,
            rollout_metrics={},
        )


def test_the_loop_stops_before_pushing_non_finite_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", FixedGenerator)
    policy = TrainerPolicy(_trainer(tmp_path, "weight"))
    loop = GRPOLoop(
        _cfg(tmp_path),
        tokenizer=None,
        server_urls=["http://127.0.0.1:9"],
        policy=policy,
        pad_token_id=0,
    )
    with pytest.raises(NonFiniteError, match=r"^weights at step 1: .* in '1.bias' \(rank 0\)"):
        asyncio.run(loop.run())
    assert policy.pushes == 0 and policy.saves == 0
    assert not (tmp_path / "metrics.jsonl").exists()  # step 1 was never logged
