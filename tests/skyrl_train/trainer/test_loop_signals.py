"""GRPOLoop logs the learning signals (entropy, flat groups, clip fraction, success)
in metrics.jsonl and the per-step line, finite, for every advantage estimator: a run
of PolicyTrainer on a stand-in worker with fixed rollouts (no Ray, no servers)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _stand_in_worker import StandInWorker, check_stand_in

from skyrl_train.config.compose import load_config
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.trainer import loop as loop_module
from skyrl_train.trainer.loop import LINE_KEYS, GRPOLoop
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.utils.tracking import read_metrics
from skyrl_train.workers.base import ForwardResult, TrainStepResult

N_SAMPLES, PROMPTS = 2, 2
SIGNALS = (
    "policy/entropy",
    "advantage/zero_variance_group_frac",
    "policy/clip_fraction",
    "reward/success_rate",
    "eval/success_rate",
)


class ConstantWorker(StandInWorker):
    """Logprobs -1 everywhere, entropy 0.5 on every response position."""

    def __init__(self) -> None:
        super().__init__()
        self.advantages: list[torch.Tensor] = []

    def forward(self, batch: TrainingBatch, *, entropy: bool = False, **options: Any) -> Any:
        mask = batch.response_mask.float()
        return ForwardResult(logprobs=-mask, entropy=0.5 * mask if entropy else None)

    def train_step(self, batch: TrainingBatch, *, loss_fn: Any, **options: Any) -> Any:
        assert batch.advantages is not None
        self.advantages.append(batch.advantages.clone())
        logprobs = -batch.response_mask.float().requires_grad_()
        # Like the real worker: the per-token entropy joins the call when asked for.
        extra = [0.5 * batch.response_mask.float()] if options.get("entropy") else []
        loss = loss_fn(logprobs, batch, *extra)
        return TrainStepResult(
            loss=float(loss.detach()), grad_norm=0.1, num_microbatches=1, replayed=False, lr=1e-3
        )


class Policy:
    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer

    async def train(self, batch: TrainingBatch, advantages: torch.Tensor, *, step: int) -> Any:
        return self.trainer.train(dataclasses.replace(batch, advantages=advantages), step=step)

    async def push_weights(
        self, urls: list[str], *, api_key: str | None = None, policy_version: int | None = None
    ) -> Any:
        return {}


class SolvedGenerator:
    """Group 0 scores (1, 0) with one solved episode; group 1 scores (0.2, 0.2): flat.
    The response holds an observation token (loss mask 0) between generated ones."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        rows = len(inputs.prompts)
        rewards = [1.0, 0.0, 0.2, 0.2][:rows]  # eval (2 prompts, 1 sample): 1, 0
        return GeneratorOutput(
            prompt_token_ids=[[1, 2, 3]] * rows,
            response_ids=[[4, 5, 6]] * rows,
            loss_masks=[[1, 0, 1]] * rows,
            rewards=rewards,
            token_rewards=[[0.0, 0.0, r] for r in rewards],
            stop_reasons=["done"] * rows,
            rollout_metrics={},
            solved=[r == 1.0 for r in rewards],
        )


def _run(
    tmp_path: Path, estimator: str, *overrides: str
) -> tuple[list[dict[str, Any]], list[str], Any]:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            f"trainer.algorithm.advantage_estimator={estimator}",
            "trainer.num_steps=2",
            "trainer.eval_interval=2",
            "trainer.eval_batch_size=2",
            "trainer.ckpt_interval=0",
            "logging.progress_bar=false",
            # Fake engines serve no weights to check (test_served_weights.py does).
            "generator.inference_engine.verify_weights_interval=0",
            # A fake policy holds no model to export (test_main_base*.py export one).
            "trainer.hf_save_interval=-1",
            *overrides,
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=0)
    worker = ConstantWorker()
    trainer.worker = check_stand_in(worker)
    loop = GRPOLoop(
        cfg,
        tokenizer=None,
        server_urls=["http://127.0.0.1:9"],
        policy=Policy(trainer),
        pad_token_id=0,
    )
    # The per-step lines, as the loop logs them (INFO on its module logger).
    handler = _LineCollector()
    logger = loop_module.logger
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        asyncio.run(loop.run())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return read_metrics(tmp_path / "metrics.jsonl"), handler.lines, worker


class _LineCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("step "):
            self.lines.append(record.getMessage())


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++", "turn_grpo"])
def test_signals_are_logged_and_finite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, estimator: str
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", SolvedGenerator)
    rows, lines, worker = _run(tmp_path, estimator)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key, value in row.items():
            assert value is None or math.isfinite(value), key
        assert row["policy/entropy"] == 0.5  # every position 0.5, masked or not
        assert row["advantage/zero_variance_group_frac"] == 0.5  # group 1 is flat
        assert row["reward/success_rate"] == 0.25
        assert 0.0 <= row["policy/clip_fraction"] <= 1.0
    assert rows[-1]["eval/success_rate"] == 0.5
    labels = dict(LINE_KEYS)
    for key in SIGNALS:
        if key.startswith("eval/"):
            assert f"{labels[key]}=" in lines[-1]
        else:
            assert all(f" {labels[key]}=" in line for line in lines)
    # The flat group gets no advantage under GRPO and RLOO; REINFORCE++ whitens over
    # the batch and per-turn GRPO scores a flat group's turns over the batch, so they do.
    flat = worker.advantages[0][2:]
    assert (flat.abs().sum().item() == 0.0) == (estimator in ("grpo", "rloo"))
    assert worker.advantages[0][:, 1].abs().sum().item() == 0.0  # the observation token


def test_no_success_rate_without_solved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Unreported(SolvedGenerator):
        async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
            return dataclasses.replace(await super().generate(inputs, seed=seed), solved=None)

    monkeypatch.setattr(loop_module, "GymGenerator", Unreported)
    rows, lines, _ = _run(tmp_path, "grpo")
    assert all("reward/success_rate" not in row and "eval/success_rate" not in row for row in rows)
    assert all(" success=" not in line for line in lines)


class RoundGenerator(SolvedGenerator):
    """The first round of a step as ``SolvedGenerator`` (group 1 flat); extra dynamic
    sampling rounds, told apart by their request seed (a step's first round uses the
    step number with trainer.seed 0), score (0.9, 0.1) in every group."""

    rounds: list[int] = []

    def __init__(self, *args: object, **kwargs: Any) -> None:
        self.evaluation = kwargs.get("evaluation", False)

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        self.extra = not self.evaluation and (seed or 0) > 1000
        out = await super().generate(inputs, seed=seed)
        if len(inputs.prompts) == PROMPTS * N_SAMPLES:  # not the eval rollout
            RoundGenerator.rounds.append(int(self.extra))
        if not self.extra:
            return out
        rewards = [0.9, 0.1] * (len(inputs.prompts) // 2)
        return dataclasses.replace(
            out,
            rewards=rewards,
            token_rewards=[[0.0, 0.0, r] for r in rewards],
            solved=[False] * len(rewards),
        )


def test_filter_trains_on_resampled_groups_and_logs_the_first_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", RoundGenerator)
    monkeypatch.setattr(RoundGenerator, "rounds", [])
    rows, _, worker = _run(
        tmp_path,
        "grpo",
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
    )
    # One extra round per step was enough: 1 + 2 varying groups >= 2.
    assert RoundGenerator.rounds == [0, 1, 0, 1]
    for row in rows:
        assert row["dynamic_sampling/rounds"] == 2.0
        assert row["dynamic_sampling/varying_group_frac"] == 1.0
        # Reward, success and flat share are the policy's own first-round samples.
        assert row["advantage/zero_variance_group_frac"] == 0.5
        assert row["reward/success_rate"] == 0.25
        assert row["reward/mean"] == pytest.approx(0.35)
    # Trained on the first round's varying group, then the extra round's first group:
    # every generated token of the batch has a nonzero advantage.
    trained = worker.advantages[0]
    assert (trained[:, 0] != 0).all() and (trained[:, 2] != 0).all()


def test_one_generator_per_run_so_sampling_is_checked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GymGenerator checks its sampling parameters when built: the loop builds one for
    training and one for evaluation, however many steps and rounds it runs."""
    built: list[bool] = []

    class Counted(RoundGenerator):
        def __init__(self, *args: object, **kwargs: Any) -> None:
            built.append(bool(kwargs.get("evaluation", False)))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(loop_module, "GymGenerator", Counted)
    monkeypatch.setattr(RoundGenerator, "rounds", [])
    _run(
        tmp_path,
        "grpo",
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
    )
    assert RoundGenerator.rounds == [0, 1, 0, 1]  # four training rounds, seeds told apart
    assert built == [False, True]


class FlatGenerator(SolvedGenerator):
    """Every group flat (every reward 0.2), in every round."""

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        out = await super().generate(inputs, seed=seed)
        return dataclasses.replace(out, rewards=[0.2] * len(out.rewards))


def test_filter_stops_at_max_sample_batches_and_fills_with_flat_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", FlatGenerator)
    rows, _, worker = _run(
        tmp_path,
        "grpo",
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
    )
    # Nothing varies: every step gives up after 3 rounds and trains on flat groups.
    assert [row["dynamic_sampling/rounds"] for row in rows] == [3.0, 3.0]
    assert [row["dynamic_sampling/varying_group_frac"] for row in rows] == [0.0, 0.0]
    assert [row["advantage/zero_variance_group_frac"] for row in rows] == [1.0, 1.0]
    assert worker.advantages[0].shape[0] == PROMPTS * N_SAMPLES
    assert worker.advantages[0].abs().sum().item() == 0.0


def test_replace_copies_the_varying_group_over_the_flat_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", SolvedGenerator)
    rows, _, worker = _run(
        tmp_path,
        "grpo",
        "trainer.algorithm.dynamic_sampling.type=replace",
        "trainer.algorithm.dynamic_sampling.min_replace_ratio=0.5",
    )
    assert [row["dynamic_sampling/rounds"] for row in rows] == [1.0, 1.0]
    assert [row["dynamic_sampling/varying_group_frac"] for row in rows] == [1.0, 1.0]
    trained = worker.advantages[0]
    assert torch.equal(trained[2:], trained[:2]) and (trained[:, 0] != 0).all()
    # Above the ratio nothing is replaced: the flat group trains with zero advantage.
    rows, _, worker = _run(
        tmp_path / "high",
        "grpo",
        "trainer.algorithm.dynamic_sampling.type=replace",
        "trainer.algorithm.dynamic_sampling.min_replace_ratio=0.75",
    )
    assert rows[0]["dynamic_sampling/varying_group_frac"] == 0.5
    assert worker.advantages[0][2:].abs().sum().item() == 0.0


class LearnedFlatGenerator(RoundGenerator):
    """Step 1's first round is a learned flat step: group 0 scores (1, 1), group 1
    (0, 0), so every group is flat but the prompts pay differently; step 2's first round
    is ``SolvedGenerator``'s (group 0 varies). Extra rounds as ``RoundGenerator``: every
    group varies, unless ``stuck`` (then they are as flat as step 1's first)."""

    stuck = False

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        out = await super().generate(inputs, seed=seed)
        if self.evaluation or not (seed == 1 or (self.extra and self.stuck)):
            return out
        rewards = [1.0, 1.0, 0.0, 0.0]
        return dataclasses.replace(
            out,
            rewards=rewards,
            token_rewards=[[0.0, 0.0, r] for r in rewards],
            solved=[r == 1.0 for r in rewards],
        )


def test_filter_flat_steps_samples_more_only_on_a_step_the_guard_would_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", LearnedFlatGenerator)
    monkeypatch.setattr(RoundGenerator, "rounds", [])
    options = ("trainer.algorithm.dynamic_sampling.max_sample_batches=3",)
    rows, _, worker = _run(
        tmp_path, "grpo", "trainer.algorithm.dynamic_sampling.type=filter_flat_steps", *options
    )
    # Step 1 sampled one more round and found two varying groups; step 2 had a varying
    # group of its own, so it sampled no more (plain "filter" would have).
    assert RoundGenerator.rounds == [0, 1, 0]
    assert [row["dynamic_sampling/rounds"] for row in rows] == [2.0, 1.0]
    assert [row["dynamic_sampling/varying_group_frac"] for row in rows] == [1.0, 0.5]
    # Logged as the policy's own first round: every group flat on step 1.
    assert rows[0]["advantage/zero_variance_group_frac"] == 1.0
    # Step 1 trained (the guard had nothing to leave out) on the extra round's groups.
    assert rows[0]["train/skipped_optimizer_steps"] == 0.0
    assert (worker.advantages[0][:, 0] != 0).all()

    # Without it the same step is the guard's: no optimizer step, no extra round.
    monkeypatch.setattr(RoundGenerator, "rounds", [])
    rows, _, _ = _run(tmp_path / "off", "grpo", *options)
    assert RoundGenerator.rounds == [0, 0]
    assert [row["train/skipped_optimizer_steps"] for row in rows] == [1.0, 0.0]


def test_filter_flat_steps_keeps_the_guard_when_every_round_is_flat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", LearnedFlatGenerator)
    monkeypatch.setattr(RoundGenerator, "rounds", [])
    monkeypatch.setattr(LearnedFlatGenerator, "stuck", True)
    rows, _, _ = _run(
        tmp_path,
        "grpo",
        "trainer.algorithm.dynamic_sampling.type=filter_flat_steps",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
    )
    # Three rounds, all flat: the batch is still a learned flat step, so no update.
    assert RoundGenerator.rounds == [0, 1, 1, 0]
    assert rows[0]["dynamic_sampling/rounds"] == 3.0
    assert rows[0]["dynamic_sampling/varying_group_frac"] == 0.0
    assert rows[0]["train/skipped_optimizer_steps"] == 1.0


def test_turn_grpo_trains_a_learned_flat_step_right_replies_up_and_wrong_ones_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step the guard skips under GRPO (every group flat, prompts paying 1 and 0)
    is a signal under per-turn GRPO: each flat group's turns are scored against the
    batch, so the group that is always right is pushed up and the other down."""
    monkeypatch.setattr(loop_module, "GymGenerator", LearnedFlatGenerator)
    monkeypatch.setattr(RoundGenerator, "rounds", [])
    rows, _, worker = _run(tmp_path, "turn_grpo")
    assert RoundGenerator.rounds == [0, 0]  # no extra round: the step has its signal
    assert rows[0]["advantage/zero_variance_group_frac"] == 1.0
    assert rows[0]["train/skipped_optimizer_steps"] == 0.0
    step1 = worker.advantages[0]
    assert (step1[:2, [0, 2]] > 0).all() and (step1[2:, [0, 2]] < 0).all()
    assert step1[:, 1].abs().sum().item() == 0.0  # the observation token
