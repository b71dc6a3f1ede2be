"""top_p = 1.0 is no cut, exactly (issue 38): on a Qwen-sized vocabulary the float32
running mass reaches 1 before the tail, and the sampler used to drop the last ~20k
tokens while the trainer, asked for no kept sets (``support_request_width`` 0), scored
every token over the whole vocabulary. A top_p below 1 still cuts where it did."""

from __future__ import annotations

import pytest
import torch

from inference.engine.base import PROCESSED_LOGPROBS, SamplingParams
from inference.engine.sampling import BatchSampler, kept_set, processed_logprobs
from skyrl_train.config.schema import SamplingParamsConfig, support_request_width

VOCAB = 152_064
"""Qwen3's vocabulary."""


def _logits(rows: int, *, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    # Spread N(0, 3^2): the tail's mass (~3e-5) is larger than float32's rounding of a
    # running sum near 1, which is what made the old rule stop short.
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * scale


def _old_rule_kept(logits: torch.Tensor, top_p: float = 1.0) -> torch.Tensor:
    """The kept-set sizes of the rule before the fix, written out: a token is kept while
    the float32 mass before it is < top_p, with no exception for top_p = 1."""
    probs = torch.softmax(torch.sort(logits, dim=-1, descending=True, stable=True).values, -1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = mass_before < top_p
    keep[:, 0] = True
    return keep.sum(dim=-1)


def test_the_float32_running_mass_does_reach_one_before_the_tail() -> None:
    """The case is real on these logits: without the exception, tokens go."""
    assert (_old_rule_kept(_logits(4)) < VOCAB).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_one_keeps_every_token_of_a_large_vocabulary(temperature: float) -> None:
    logits = _logits(4)
    logq, keep = processed_logprobs(logits, temperature=temperature, top_p=1.0)
    assert keep.all()
    assert torch.isfinite(logq).all()
    # The trainer's score for no cut: log softmax of logits / T over every token.
    expected = torch.log_softmax(logits / temperature, dim=-1)
    # Equal up to the order of float32 sums (log-probabilities of -10 to -40 here).
    torch.testing.assert_close(logq, expected, rtol=0, atol=1e-4)
    assert support_request_width(SamplingParamsConfig(top_p=1.0), cap=512) == 0


def test_top_p_one_with_top_k_keeps_exactly_k() -> None:
    q = kept_set(
        _logits(3),
        temperature=torch.ones(3),
        top_k=torch.tensor([100_000, 150_000, VOCAB]),
        top_p=torch.ones(3),
        greedy=torch.zeros(3, dtype=torch.bool),
    )
    assert q.size.tolist() == [100_000, 150_000, VOCAB]


def test_the_sampler_lists_the_whole_vocabulary_as_its_kept_set_size() -> None:
    params = [SamplingParams(top_p=1.0, logprobs_mode=PROCESSED_LOGPROBS)] * 2
    sampler = BatchSampler(
        params, generators=[torch.Generator().manual_seed(i) for i in range(2)], support_k=4
    )
    sample = sampler.sample(_logits(2))
    assert sample.support_size is not None
    assert sample.support_size.tolist() == [VOCAB, VOCAB]


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_below_one_still_cuts_where_the_mass_reaches_it(top_p: float) -> None:
    logits = _logits(2, seed=1)
    _, keep = processed_logprobs(logits, temperature=1.0, top_p=top_p)
    kept = keep.sum(dim=-1)
    assert kept.tolist() == _old_rule_kept(logits, top_p).tolist()  # as before the fix
    probs = torch.softmax(logits.double(), dim=-1)
    for row in range(2):
        assert 1 <= int(kept[row]) < VOCAB
        ordered = torch.sort(probs[row], descending=True).values
        # The shortest prefix whose mass reaches top_p, up to float32's running sum
        # over ~1e5 terms (its error here stays below 1e-4).
        assert float(ordered[: int(kept[row]) - 1].sum()) < top_p + 1e-4
        assert float(ordered[: int(kept[row])].sum()) >= top_p - 1e-4
        # The kept tokens are the most likely ones.
        assert float(probs[row][keep[row]].min()) >= float(probs[row][~keep[row]].max())
