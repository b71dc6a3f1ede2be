"""Sampler replay in the trainer's log-softmax (``layout.SamplerReplay``): tokens are
scored under softmax(logits / T) over the rollout's kept set, checked against an fp64
computation written out here."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.workers.megatron.layout import (
    SamplerReplay,
    make_contiguous,
    response_logprobs,
    response_logprobs_and_entropy,
)

V = 11


def _batch() -> TrainingBatch:
    # Row 0: prompt of 2 (left-padded by 1), response of 3; row 1: prompt 3, response 2.
    sequences = torch.tensor([[0, 5, 6, 1, 2, 3], [7, 8, 9, 4, 10, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    response = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response,
        loss_mask=response.clone(),
        rewards=torch.zeros(2),
        token_rewards=torch.zeros(2, 3),
    )


SUPPORT = torch.tensor(
    [
        [[1, 4, 7, -1], [2, 0, -1, -1], [3, 9, 10, 5]],
        [[4, 2, -1, -1], [10, -1, -1, -1], [-1, -1, -1, -1]],  # last: padding
    ]
)


def _reference(logits: torch.Tensor, batch: TrainingBatch, temperature: float, support):
    """fp64, position by position: log of exp(z_t / T) / sum over the kept set."""
    layout = make_contiguous(batch)
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
    for b in range(batch.batch_size):
        for j in range(batch.num_actions):
            if not batch.response_mask[b, j]:
                continue
            pos = int(layout.prompt_lens[b]) + j
            z = logits[b, pos - 1].double() / temperature
            target = int(layout.tokens[b, pos])
            kept = list(range(V)) if support is None else [int(i) for i in support[b, j] if i >= 0]
            out[b, j] = z[target] - torch.logsumexp(z[kept], dim=0)
    return out


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
@pytest.mark.parametrize("with_support", [False, True])
def test_logprobs_are_the_samplers_distribution(temperature: float, with_support: bool) -> None:
    batch = _batch()
    logits = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(0)) * 3
    support = SUPPORT if with_support else None
    sampler = SamplerReplay(temperature=temperature, support=support)
    got = response_logprobs(logits, make_contiguous(batch), batch.response_mask, sampler=sampler)
    want = _reference(logits, batch, temperature, support)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert got[1, 2] == 0.0  # padding
    if with_support:
        assert got[1, 1] == 0.0  # a kept set of one: probability 1
    if temperature != 1.0 or with_support:
        raw = response_logprobs(logits, make_contiguous(batch), batch.response_mask)
        assert not torch.allclose(raw, got, atol=1e-3)


def test_entropy_is_over_the_kept_set() -> None:
    batch = _batch()
    logits = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(1))
    sampler = SamplerReplay(temperature=1.5, support=SUPPORT)
    _, entropy = response_logprobs_and_entropy(
        logits, make_contiguous(batch), batch.response_mask, sampler=sampler
    )
    assert entropy[1, 1] == 0.0  # one kept token
    row = logits[0, 1].double() / 1.5  # predicts response token 0 of row 0 (prompt len 2)
    kept = [1, 4, 7]
    p = torch.softmax(row[kept], dim=0)
    assert math.isclose(float(entropy[0, 0]), float(-(p * p.log()).sum()), abs_tol=1e-5)
    assert torch.isfinite(entropy).all()


def test_gradient_flows_only_into_kept_logits() -> None:
    batch = _batch()
    logits = torch.randn(2, 6, V, requires_grad=True)
    sampler = SamplerReplay(temperature=2.0, support=SUPPORT)
    lp = response_logprobs(logits, make_contiguous(batch), batch.response_mask, sampler=sampler)
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()
    grad = logits.grad[0, 1]  # the position predicting row 0's first response token
    outside = [i for i in range(V) if i not in (1, 4, 7)]
    assert (grad[outside] == 0).all() and (grad[[1, 4, 7]] != 0).all()
