"""Sampler kept sets through collation: ``rollout_sample_support`` -> ``sample_support``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.errors import CollationError
from skyrl_train.generators.base import GeneratorOutput


def _output() -> GeneratorOutput:
    # Trajectory 0: generated, generated, observation, generated; trajectory 1: one token.
    support = [
        np.array([[5, 7, -1], [6, -1, -1], [-1, -1, -1], [9, 8, 5]], dtype=np.int32),
        np.array([[3, 4]], dtype=np.int32),
    ]
    return GeneratorOutput(
        prompt_token_ids=[[1, 2], [1]],
        response_ids=[[7, 6, 42, 5], [4]],
        loss_masks=[[1, 1, 0, 1], [1]],
        rewards=[1.0, 0.0],
        token_rewards=[[0.0, 0.0, 0.0, 1.0], [0.0]],
        stop_reasons=["done", "done"],
        rollout_metrics={},
        rollout_logprobs=[[-0.5, 0.0, 0.0, -1.0], [-0.1]],
        rollout_sample_support=support,
    )


def test_kept_sets_are_padded_to_the_batch() -> None:
    batch = convert_to_training_batch(_output(), pad_token_id=0)
    assert batch.sample_support is not None
    assert batch.sample_support.shape == (2, 4, 3)
    assert batch.sample_support[0].tolist() == [[5, 7, -1], [6, -1, -1], [-1, -1, -1], [9, 8, 5]]
    assert batch.sample_support[1].tolist() == [[3, 4, -1]] + [[-1, -1, -1]] * 3
    assert batch.sample_support.dtype == torch.int64


def test_no_support_without_a_cut() -> None:
    out = _output()
    out.rollout_sample_support = None
    assert convert_to_training_batch(out, pad_token_id=0).sample_support is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s[0].__setitem__((1,), [5, -1, -1]),
            r"^rollout_sample_support\[0\] row 1: expected the kept set to hold the sampled "
            r"token 6, got \[5\]$",
        ),
        (
            lambda s: s.__setitem__(1, s[1][:0]),
            r"^rollout_sample_support\[1\]: expected 1 rows \(one per response token\), got 0$",
        ),
        (
            lambda s: s[0].__setitem__((3,), [9, -1, 5]),
            r"^rollout_sample_support\[0\] row 3: expected ids then trailing -1 padding",
        ),
        (
            lambda s: s[0].__setitem__((2,), [42, -1, -1]),
            r"^rollout_sample_support\[0\] row 2: expected no kept set on an observation",
        ),
        (
            lambda s: s.__setitem__(0, s[0].astype(np.float32)),
            r"^rollout_sample_support\[0\]: expected a 2-D int array",
        ),
        (
            lambda s: s[1].__setitem__((0, 1), -3),
            r"^rollout_sample_support\[1\]: expected ids >= 0 or -1 padding, got -3$",
        ),
        (lambda s: s.pop(), r"^rollout_sample_support: expected 2 entries"),
    ],
)
def test_bad_kept_sets_are_refused_by_trajectory_and_row(change, message) -> None:
    out = _output()
    change(out.rollout_sample_support)
    before = copy.deepcopy(out)
    with pytest.raises(CollationError, match=message):
        convert_to_training_batch(out, pad_token_id=0)
    # Nothing of the output was touched by the refusal.
    assert out.response_ids == before.response_ids and out.loss_masks == before.loss_masks
    for a, b in zip(out.rollout_sample_support, before.rollout_sample_support, strict=True):
        assert np.array_equal(a, b)
