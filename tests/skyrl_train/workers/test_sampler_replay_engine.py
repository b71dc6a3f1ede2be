"""The trainer's old log-probs equal the engine's processed rollout log-probs: tokens are
scored under the distribution the rollout sampled from (temperature, top-k), with the
engine's kept sets replayed (``layout.SamplerReplay``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _megatron_batches import PAD_ID, make_batch

from inference.engine.base import EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.models.tiny_moe import TinyMoEConfig
from inference.models.tokenizer import build_byte_tokenizer
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.dataset.support import collate_sample_support
from skyrl_train.workers.megatron import MegatronPolicyWorker

CFG = TinyMoEConfig()
L, K = CFG.num_layers, CFG.num_experts_per_tok
TEXTS = ["hello world", "the quick brown fox", "MoE routing", "abc", "replay", "x"]


@pytest.fixture(scope="module")
def rig() -> tuple[HFMoEEngine, MegatronPolicyWorker]:
    torch.set_num_threads(1)
    # fp32 and batch invariant: the engine's logits are the trainer's up to kernel order.
    engine = HFMoEEngine.from_config(CFG, seed=0, dtype="float32")
    worker = MegatronPolicyWorker(
        CFG.architecture(), MegatronConfig(moe_enable_routing_replay=True), pad_token_id=PAD_ID
    ).setup()
    worker.load_weights(engine.state_dict().items())
    return engine, worker


def _gap(rig, *, temperature: float, top_k: int, trainer_temperature: float) -> float:
    engine, worker = rig
    tok = build_byte_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    cut = top_k > 0
    requests = [
        EngineRequest(
            p,
            SamplingParams(
                max_tokens=24,
                temperature=temperature,
                top_k=top_k,
                seed=i,
                logprobs_mode="processed_logprobs",
            ),
            return_routed_experts=True,
            sample_support_k=top_k if cut else 0,
        )
        for i, p in enumerate(prompts)
    ]
    outputs = engine.generate_sync(requests)
    batch = make_batch(
        prompts,
        [o.token_ids for o in outputs],
        num_layers=L,
        top_k=K,
        routes=[np.asarray(o.routed_experts) for o in outputs],
        rollout_logprobs=[o.logprobs for o in outputs],
    )
    if cut:
        batch.sample_support = collate_sample_support(
            [o.sample_support_ids for o in outputs],
            responses=[np.asarray(o.token_ids) for o in outputs],
            loss_masks=[np.ones(len(o.token_ids), dtype=np.int64) for o in outputs],
            response_width=batch.num_actions,
        )
    worker.temperature = trainer_temperature
    try:
        old = worker.forward(batch, replay_routes=True, micro_batch_size=3).logprobs
    finally:
        worker.temperature = 1.0
    mask = batch.response_mask.bool()
    return float((old - batch.rollout_logprobs).abs()[mask].max())


def test_old_logprobs_equal_processed_rollout_logprobs_at_t2_top_k5(rig) -> None:
    baseline = _gap(rig, temperature=1.0, top_k=-1, trainer_temperature=1.0)
    replayed = _gap(rig, temperature=2.0, top_k=5, trainer_temperature=2.0)
    assert baseline < 1e-4  # fp32 engine and trainer: kernel-order differences only
    assert replayed <= max(2 * baseline, 1e-4)


def test_scoring_under_the_raw_logits_misses_by_far(rig) -> None:
    """What the trainer did before: the T = 2, top-k 5 rollout scored without replay."""
    engine, worker = rig
    replayed = _gap(rig, temperature=2.0, top_k=5, trainer_temperature=2.0)
    raw = _gap(rig, temperature=2.0, top_k=-1, trainer_temperature=1.0)
    assert raw > 100 * max(replayed, 1e-6)
