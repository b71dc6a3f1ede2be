"""Linear learning-rate warmup (``optimizer_config.num_warmup_steps``) on the real
worker: the rate each optimizer step uses rises to ``lr`` and a resumed optimizer state
continues the ramp instead of restarting it."""

from __future__ import annotations

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.workers.megatron import MegatronPolicyWorker

CFG = TinyMoEConfig()
LR = 1e-2


def _worker(warmup: int) -> MegatronPolicyWorker:
    torch.set_num_threads(1)
    return MegatronPolicyWorker(
        CFG.architecture(),
        MegatronConfig(),
        optimizer=OptimizerConfig(lr=LR, num_warmup_steps=warmup),
        pad_token_id=PAD_ID,
        routing_replay=False,
    ).setup()


def _steps(worker: MegatronPolicyWorker, n: int) -> list[float]:
    batch = make_batch([[72, 105], [1, 2, 3]], [[50, 51], [60]], num_layers=4, top_k=2)
    lrs = []
    for _ in range(n):
        result = worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=2)
        assert worker.optimizer is not None
        assert [g["lr"] for g in worker.optimizer.param_groups] == [result.lr] * len(
            worker.optimizer.param_groups
        )
        lrs.append(result.lr)
    return lrs


def test_warmup_rises_linearly_and_resumes_with_the_optimizer_state() -> None:
    first = _worker(warmup=4)
    assert _steps(first, 2) == pytest.approx([LR / 4, LR / 2])
    assert first.optimizer is not None
    state = first.optimizer.state_dict()
    resumed = _worker(warmup=4)
    assert resumed.optimizer is not None
    resumed.optimizer.load_state_dict(state)
    assert _steps(resumed, 3) == pytest.approx([3 * LR / 4, LR, LR])


def test_no_warmup_keeps_the_rate() -> None:
    assert _steps(_worker(warmup=0), 2) == [LR, LR]
