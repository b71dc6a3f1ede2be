"""The old-logprob forward's entropy, from the logits as the worker lays them out:
only the policy's own response tokens count, not prompt or observation tokens."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_train.algorithms import mean_token_entropy
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.workers.megatron.layout import (
    make_contiguous,
    response_logprobs,
    response_logprobs_and_entropy,
)

VOCAB = 16


def _batch() -> TrainingBatch:
    # row 0: prompt of 3, response generated, generated, observation, generated
    # row 1: prompt of 2 (left-padded by 1), response generated, observation x2, padding
    sequences = torch.tensor([[5, 6, 7, 1, 2, 3, 4], [0, 8, 9, 1, 3, 3, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    loss_mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])
    return TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response_mask,
        loss_mask=loss_mask,
        rewards=torch.zeros(2),
        token_rewards=torch.zeros(2, 4),
    )


def test_entropy_counts_generated_tokens_not_prompt_or_observations() -> None:
    batch = _batch()
    layout = make_contiguous(batch)
    rows, seq = layout.tokens.shape
    # Uniform logits (entropy ln 16) everywhere, except at the positions that predict a
    # generated token: two-way 50/50 (entropy ln 2), with the target one of the two.
    logits = torch.zeros(rows, seq, VOCAB)
    for b in range(rows):
        for j in range(batch.num_actions):
            if batch.loss_mask[b, j]:
                pos = int(layout.prompt_lens[b]) + j - 1
                target = int(layout.tokens[b, pos + 1])
                logits[b, pos] = -1e4
                logits[b, pos, target] = 0.0
                logits[b, pos, (target + 1) % VOCAB] = 0.0
    logprobs, entropy = response_logprobs_and_entropy(logits, layout, batch.response_mask)
    assert torch.equal(logprobs, response_logprobs(logits, layout, batch.response_mask))
    assert mean_token_entropy(entropy, batch.loss_mask) == pytest.approx(math.log(2), rel=1e-6)
    # Observation tokens carry their own (higher) entropy, and padding is 0:
    assert entropy[0, 2].item() == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert entropy[1, 3].item() == 0.0
    # Averaging over response_mask instead would have counted the observations.
    assert mean_token_entropy(entropy, batch.response_mask) > math.log(2) + 0.5
    assert logprobs[batch.loss_mask.bool()].tolist() == pytest.approx([-math.log(2)] * 4, rel=1e-6)
