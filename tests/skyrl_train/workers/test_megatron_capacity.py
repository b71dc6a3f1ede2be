"""The served-weights probe drops no tokens (issue 49, item 10): with replay off and
``moe_expert_capacity_factor`` 1.0 the training forwards drop tokens over an expert's
capacity, which no engine does; the probe (``PolicyTrainer.score``) is scored as if no
capacity were set, so right weights pass the check. One rank, the real tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.megatron import capacity
from skyrl_train.workers.megatron.worker import MegatronPolicyWorker

CFG = TinyMoEConfig()
FACTOR = 1.0
MICRO = 4


def _worker(**kwargs: Any) -> MegatronPolicyWorker:
    config = MegatronConfig(transformer_config_kwargs=kwargs)
    return MegatronPolicyWorker(
        CFG.architecture(), config, pad_token_id=PAD_ID, routing_replay=False
    ).setup()


def _batch() -> TrainingBatch:
    prompts = [[72 + b, 105, 33, 40 + 3 * b][: 2 + b % 3] for b in range(MICRO)]
    responses = [[50 + 7 * b, 51, 52 + b, 60, 61 - b, 70][: 3 + b % 4] for b in range(MICRO)]
    batch = make_batch(prompts, responses, num_layers=CFG.num_layers, top_k=CFG.num_experts_per_tok)
    batch.routed_experts = None  # the probe without routes: the trainer routes itself
    return batch


def _capacity_factors(worker: MegatronPolicyWorker) -> set[float | None]:
    return {
        m.config.moe_expert_capacity_factor
        for m in worker.model.modules()
        if hasattr(getattr(m, "config", None), "moe_expert_capacity_factor")
    }


@pytest.fixture(scope="module")
def workers() -> tuple[MegatronPolicyWorker, MegatronPolicyWorker]:
    torch.set_num_threads(1)
    dropping = _worker(moe_expert_capacity_factor=FACTOR)
    free = _worker()
    free.model.load_state_dict(dropping.model.state_dict())  # the same weights
    return dropping, free


def test_the_probe_is_scored_without_token_dropping(
    tmp_path: Path, workers: tuple[MegatronPolicyWorker, MegatronPolicyWorker]
) -> None:
    dropping, free = workers
    batch = _batch()
    mask = batch.response_mask.bool()
    engine_like = free.forward(batch, micro_batch_size=MICRO, temperature=1.0).logprobs
    trained = dropping.forward(batch, micro_batch_size=MICRO, temperature=1.0).logprobs
    # The premise: at factor 1.0 this batch has tokens over capacity, so the training
    # forward scores it otherwise than an engine would.
    assert (trained - engine_like)[mask].abs().max() > 1e-3

    cfg = load_config(
        [f"trainer.run_dir={tmp_path}", f"trainer.micro_forward_batch_size_per_gpu={MICRO}"]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=PAD_ID)
    trainer.worker = dropping
    probe = trainer.score(batch)
    assert probe is not None
    torch.testing.assert_close(probe[mask], engine_like[mask], rtol=0, atol=1e-6)

    # The run's own forwards still drop tokens as configured, the training step's too.
    assert _capacity_factors(dropping) == {FACTOR}
    again = dropping.forward(batch, micro_batch_size=MICRO, temperature=1.0).logprobs
    torch.testing.assert_close(again, trained, rtol=0, atol=0)

    def loss(logprobs: torch.Tensor, micro: TrainingBatch) -> torch.Tensor:
        return -(logprobs * micro.response_mask).sum()

    step = dropping.train_step(batch, loss_fn=loss, micro_batch_size=MICRO)
    assert step.loss == pytest.approx(float(-(trained * batch.response_mask).sum()), abs=1e-4)
    assert step.loss != pytest.approx(float(-(engine_like * batch.response_mask).sum()), abs=1e-3)


def test_the_capacity_comes_back_when_the_forward_raises(
    workers: tuple[MegatronPolicyWorker, MegatronPolicyWorker],
) -> None:
    dropping, _ = workers
    with pytest.raises(RuntimeError, match="mid-forward"):
        with capacity.token_dropping(dropping.chunks, enabled=False):
            assert _capacity_factors(dropping) == {None}
            raise RuntimeError("mid-forward")
    assert _capacity_factors(dropping) == {FACTOR}
