"""The reference policy on the real Megatron worker: a parameter snapshot swapped in for
a forward gives exactly the snapshot's logprobs (replayed routes included) and leaves
the policy's own weights in place afterwards, errors included; ``entropy=True`` hands the
loss a differentiable entropy that an entropy bonus can raise."""

from __future__ import annotations

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch, random_routes

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.algorithms import token_mean_entropy
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.workers.megatron import MegatronPolicyWorker

CFG = TinyMoEConfig()
L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok


@pytest.fixture(scope="module")
def worker() -> MegatronPolicyWorker:
    torch.set_num_threads(1)
    return MegatronPolicyWorker(
        CFG.architecture(),
        MegatronConfig(moe_enable_routing_replay=True),
        optimizer=OptimizerConfig(lr=1e-2),
        pad_token_id=PAD_ID,
    ).setup()


def _batch() -> object:
    prompts = [[72, 105, 33], [1, 2, 3, 4, 5, 6], [40, 41]]
    responses = [[50, 51, 52, 53], [60, 61], [70, 71, 72, 73, 74]]
    seq = 6 + 5
    routes = [random_routes(1, seq, L, E, K, seed=b)[0, : len(p) + len(r) - 1]
              for b, (p, r) in enumerate(zip(prompts, responses, strict=True))]  # fmt: skip
    return make_batch(prompts, responses, num_layers=L, top_k=K, routes=routes)


def test_swapped_weights_reproduce_the_snapshot_and_restore_the_policy(worker) -> None:
    batch = _batch()
    before = {r: worker.forward(batch, replay_routes=r).logprobs for r in (False, True)}
    reference = worker.parameter_snapshot()
    worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=2)
    after = {r: worker.forward(batch, replay_routes=r).logprobs for r in (False, True)}
    assert not torch.equal(after[True], before[True])  # the step moved the policy
    for replay in (False, True):
        with worker.swapped_weights(reference):
            swapped = worker.forward(batch, replay_routes=replay).logprobs
        assert torch.equal(swapped, before[replay])
        assert torch.equal(worker.forward(batch, replay_routes=replay).logprobs, after[replay])
    # The snapshot is a copy: training did not write into it.
    with worker.swapped_weights(reference):
        assert torch.equal(worker.forward(batch, replay_routes=True).logprobs, before[True])


def test_swapped_weights_restore_the_policy_after_an_error(worker) -> None:
    batch = _batch()
    own = worker.forward(batch).logprobs
    reference = {k: torch.zeros_like(v) for k, v in worker.parameter_snapshot().items()}
    with pytest.raises(RuntimeError, match="boom"), worker.swapped_weights(reference):
        raise RuntimeError("boom")
    assert torch.equal(worker.forward(batch).logprobs, own)


def test_swapped_weights_refuse_a_snapshot_of_another_model(worker) -> None:
    snapshot = worker.parameter_snapshot()
    name = next(iter(snapshot))
    missing = {k: v for k, v in snapshot.items() if k != name}
    with pytest.raises(ValueError, match=rf"missing \['{name}'\]"):
        with worker.swapped_weights(missing):
            pass
    wrong = dict(snapshot)
    wrong[name] = torch.zeros(3)
    with pytest.raises(ValueError, match=rf"weights\['{name}'\]: expected shape"):
        with worker.swapped_weights(wrong):
            pass
    batch = _batch()
    with worker.swapped_weights(snapshot):  # the model's own values: same logprobs
        swapped = worker.forward(batch).logprobs
    assert torch.equal(swapped, worker.forward(batch).logprobs)


def test_entropy_bonus_raises_the_policy_entropy(worker) -> None:
    batch = _batch()
    start = token_mean_entropy(worker.forward(batch, entropy=True).entropy, batch.loss_mask)
    calls: list[int] = []

    def bonus_only(logprobs, mb, entropy):
        assert entropy.requires_grad and entropy.shape == logprobs.shape
        # Zero off the response (padding), so a mask cannot pick up garbage there.
        assert (entropy.detach()[mb.response_mask == 0] == 0).all()
        calls.append(1)
        return -token_mean_entropy(entropy, mb.loss_mask)

    for _ in range(3):
        worker.train_step(
            batch, loss_fn=bonus_only, micro_batch_size=2, replay_routes=True, entropy=True
        )
    assert len(calls) == 6  # 2 microbatches x 3 steps
    end = token_mean_entropy(worker.forward(batch, entropy=True).entropy, batch.loss_mask)
    assert float(end) > float(start) + 0.01
