"""Sampler-replay scoring on plain [tokens, vocab] logits (``algorithms/sampler_replay``):
a token's log-prob and the entropy under softmax(logits / T) over the rollout's kept
set, against values worked out by hand."""

from __future__ import annotations

import math

import torch

from skyrl_train.algorithms import (
    SamplerReplay,
    kept_set,
    sampler_log_probs,
    sampler_log_probs_and_entropy,
    sampler_logits,
)

# Row 0 over ids 0..4: exp(logit / 2) is 1, 2, 3, e^4, 4 for T = 2, and its kept set is
# {1, 2, 4}: probabilities 2/9, 3/9, 4/9. Row 1 lists no id: the whole vocabulary.
LOGITS = torch.tensor(
    [
        [0.0, 2 * math.log(2), 2 * math.log(3), 8.0, 2 * math.log(4)],
        [math.log(1), math.log(2), math.log(3), math.log(4), math.log(6)],
    ]
)
SUPPORT = torch.tensor([[2, 1, 4, -1], [-1, -1, -1, -1]])


def test_a_token_scores_its_share_of_the_kept_set_at_the_temperature() -> None:
    sampler = SamplerReplay(temperature=2.0, support=SUPPORT)
    got = sampler_log_probs(LOGITS, torch.tensor([2, 4]), sampler=sampler)
    # Row 1 at T = 2: exp(logit / 2) = sqrt(1, 2, 3, 4, 6).
    roots = [math.sqrt(w) for w in (1, 2, 3, 4, 6)]
    want = [math.log(3 / 9), math.log(roots[4] / sum(roots))]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_the_entropy_is_the_kept_sets() -> None:
    sampler = SamplerReplay(temperature=2.0, support=SUPPORT)
    logprobs, entropy = sampler_log_probs_and_entropy(LOGITS, torch.tensor([1, 0]), sampler=sampler)
    kept = [2 / 9, 3 / 9, 4 / 9]
    assert math.isclose(float(entropy[0]), -sum(p * math.log(p) for p in kept), abs_tol=1e-6)
    assert math.isclose(float(logprobs[0]), math.log(2 / 9), abs_tol=1e-6)
    # Without a sampler: the raw softmax, 1..6 over 16 on row 1.
    _, raw = sampler_log_probs_and_entropy(LOGITS, torch.tensor([1, 0]))
    whole = [w / 16 for w in (1, 2, 3, 4, 6)]
    assert math.isclose(float(raw[1]), -sum(p * math.log(p) for p in whole), abs_tol=1e-6)


def test_a_token_outside_the_kept_set_could_not_have_been_drawn() -> None:
    got = sampler_log_probs(LOGITS, torch.tensor([3, 3]), sampler=SamplerReplay(support=SUPPORT))
    assert got[0] == float("-inf") and math.isfinite(float(got[1]))


def test_two_vocabulary_windows_make_up_the_whole_kept_set() -> None:
    whole = kept_set(SUPPORT, vocab_size=5)
    assert whole.tolist() == [[False, True, True, False, True], [True] * 5]
    halves = [
        kept_set(SUPPORT, vocab_size=3, vocab_start=0),
        kept_set(SUPPORT, vocab_size=2, vocab_start=3),
    ]
    assert torch.equal(torch.cat(halves, dim=-1), whole)
    shard = sampler_logits(LOGITS[:, 3:], SamplerReplay(support=SUPPORT), vocab_start=3)
    assert torch.equal(shard, sampler_logits(LOGITS, SamplerReplay(support=SUPPORT))[:, 3:])


def test_leading_dims_are_rows() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    support = torch.randint(0, 7, (2, 3, 2), generator=torch.Generator().manual_seed(1))
    targets = support[..., 0]
    sampler = SamplerReplay(temperature=0.7, support=support)
    got = sampler_log_probs(logits, targets, sampler=sampler)
    flat = SamplerReplay(temperature=0.7, support=support.reshape(6, 2))
    want = sampler_log_probs(logits.reshape(6, 7), targets.reshape(6), sampler=flat)
    assert torch.equal(got.reshape(6), want)
