"""The sampler reports the behaviour policy q it draws from (``processed_logprobs``).

The reference q here is written from the definition in ``inference/engine/sampling.py``
in float64 numpy, sharing no code with the engine: sort by z / T, keep the first k,
keep the shortest prefix whose renormalised mass reaches p, renormalise.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from inference.engine.base import EngineRequest, SamplingParams
from inference.engine.sampling import BatchSampler, processed_logprobs
from inference.errors import RequestValidationError

V = 50
PROCESSED = "processed_logprobs"


def reference(z: np.ndarray, temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """{token id: log q} over the kept set of one row of logits, in float64."""
    z = z.astype(np.float64)
    if temperature == 0:
        return {int(np.argmax(z)): 0.0}
    scaled = z / temperature
    order = sorted(range(len(z)), key=lambda i: (-scaled[i], i))
    if top_k > 0:
        order = order[:top_k]
    weights = np.exp(scaled[order] - scaled[order].max())
    probs = weights / weights.sum()
    kept = 1
    while kept < len(order) and probs[:kept].sum() < top_p:
        kept += 1
    logits = scaled[order[:kept]]
    logq = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    return dict(zip(order[:kept], logq.tolist(), strict=True))


def rows() -> np.ndarray:
    rng = np.random.default_rng(1234)
    spread = rng.normal(0.0, 2.0, V)
    peaked = rng.normal(0.0, 0.5, V)
    peaked[17] = 6.0  # most of the mass on one token: top-p 0.9 keeps few
    return np.stack([spread, peaked]).astype(np.float32)


def sampler(params: SamplingParams, batch: int, *, support_k: int, seed: int) -> BatchSampler:
    gens = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(batch)]
    return BatchSampler([params] * batch, generators=gens, support_k=support_k)


CUTS = list(itertools.product([0.7, 1.0, 2.0], [-1, 5], [1.0, 0.9]))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CUTS)
def test_reported_logprobs_are_log_q(temperature: float, top_k: int, top_p: float) -> None:
    z = rows()
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, logprobs_mode=PROCESSED
    )
    draws = 64
    logits = torch.from_numpy(np.repeat(z, draws, axis=0))  # each row 64 times
    support_k = 8
    out = sampler(params, len(logits), support_k=support_k, seed=0).sample(logits)
    # The public reference is the sampler's own arithmetic, to the bit.
    logq, _ = processed_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(logq.gather(1, out.tokens[:, None])[:, 0], out.logprobs)
    for r in range(len(logits)):
        ref = reference(z[r // draws], temperature, top_k, top_p)
        token = int(out.tokens[r])
        assert token in ref
        assert float(out.logprobs[r]) == pytest.approx(ref[token], abs=1e-3)
        listed = list(ref)[:support_k]  # the kept set, most likely first
        ids = out.support_ids[r].tolist()
        assert ids == listed + [-1] * (support_k - len(listed))
        lps = out.support_logprobs[r].numpy()
        np.testing.assert_allclose(lps[: len(listed)], [ref[i] for i in listed], atol=1e-3)
        assert np.isneginf(lps[len(listed) :]).all()
        assert int(out.support_size[r]) == len(ref)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CUTS)
def test_processed_logprobs_is_the_reference_in_vocab_order(
    temperature: float, top_k: int, top_p: float
) -> None:
    z = rows()
    logq, keep = processed_logprobs(
        torch.from_numpy(z), temperature=temperature, top_k=top_k, top_p=top_p
    )
    for r in range(len(z)):
        ref = reference(z[r], temperature, top_k, top_p)
        assert sorted(np.flatnonzero(keep[r].numpy()).tolist()) == sorted(ref)
        expected = np.full(V, -np.inf)
        expected[list(ref)] = list(ref.values())
        np.testing.assert_allclose(logq[r].numpy(), expected, atol=1e-3)


def test_the_cases_above_cut_the_set_in_different_places() -> None:
    """The grid is only a test if it reaches small, middle and whole kept sets."""
    sizes = {len(reference(z, *cut)) for z in rows() for cut in CUTS}
    assert 1 in sizes and 5 in sizes and V in sizes and len(sizes) >= 5


def test_greedy_reports_zero_and_a_one_token_set() -> None:
    z = rows()
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.9, logprobs_mode=PROCESSED)
    out = sampler(params, len(z), support_k=4, seed=0).sample(torch.from_numpy(z))
    assert out.tokens.tolist() == np.argmax(z, axis=1).tolist()
    assert out.logprobs.tolist() == [0.0, 0.0]
    assert out.support_ids[:, 1:].eq(-1).all() and out.support_size.tolist() == [1, 1]
    assert out.support_logprobs[:, 0].tolist() == [0.0, 0.0]
    logq, keep = processed_logprobs(torch.from_numpy(z), temperature=0.0)
    assert keep.sum(dim=1).tolist() == [1, 1] and logq.max(dim=1).values.tolist() == [0.0, 0.0]


def test_raw_mode_is_unchanged_and_draws_the_same_tokens() -> None:
    z = torch.from_numpy(rows())
    raw_lp = torch.log_softmax(z.double(), dim=-1)
    cut = {"temperature": 2.0, "top_k": 5, "top_p": 0.9}
    outs = {
        mode: sampler(SamplingParams(**cut, logprobs_mode=mode), 2, support_k=6, seed=3).sample(z)
        for mode in (None, "raw_logprobs", PROCESSED)
    }
    for mode in (None, "raw_logprobs"):
        out = outs[mode]
        assert out.tokens.tolist() == outs[PROCESSED].tokens.tolist()
        expected = raw_lp.gather(1, out.tokens[:, None])[:, 0]
        np.testing.assert_allclose(out.logprobs.numpy(), expected.numpy(), atol=1e-5)
        listed = out.support_ids.long().clamp(min=0)
        inside = out.support_ids >= 0
        expected_support = raw_lp.gather(1, listed).masked_fill(~inside, float("-inf"))
        np.testing.assert_allclose(out.support_logprobs.numpy(), expected_support, atol=1e-5)
    # Only the logprobs differ: the ids and set sizes do not depend on the mode.
    assert outs[None].support_ids.equal(outs[PROCESSED].support_ids)
    assert outs[None].support_size.equal(outs[PROCESSED].support_size)


CHI2_CRITICAL_1E3 = {2: 13.816, 3: 16.266, 4: 18.467}
"""Upper 1e-3 quantiles of the chi-square distribution by degrees of freedom."""


def test_draws_follow_exp_of_the_reported_logprobs() -> None:
    """20,000 seeded draws from one distribution against q by a chi-square test."""
    rng = np.random.default_rng(7)
    z = rng.normal(0.0, 1.5, V).astype(np.float32)
    temperature, top_k, top_p = 1.5, 5, 0.9
    ref = reference(z, temperature, top_k, top_p)
    assert 3 <= len(ref) <= 5  # a cut that bites, with every count large
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, logprobs_mode=PROCESSED
    )
    n = 20_000
    out = sampler(params, n, support_k=top_k, seed=1).sample(torch.from_numpy(z).expand(n, V))
    assert set(out.tokens.tolist()) <= set(ref)
    assert (out.support_size == len(ref)).all()
    # q as the sampler reports it: one logprob per kept token, whichever draw saw it.
    reported = {int(t): float(lp) for t, lp in zip(out.tokens, out.logprobs, strict=True)}
    assert sorted(reported) == sorted(ref)
    kept = list(ref)
    q = np.exp([reported[t] for t in kept])
    assert q.sum() == pytest.approx(1.0, abs=1e-5)
    counts = np.array([(out.tokens == t).sum().item() for t in kept])
    assert (n * q).min() > 100
    expected = n * q / q.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    # Significance 1e-3 for len(kept) - 1 degrees of freedom (the chi-square quantile
    # function; scipy is not a dependency).
    assert statistic < CHI2_CRITICAL_1E3[len(kept) - 1], (statistic, counts, expected)


def test_a_bad_logprobs_mode_is_refused_by_the_engine(fp32_engine) -> None:
    request = EngineRequest([1, 2], SamplingParams(logprobs_mode="processed"))
    with pytest.raises(RequestValidationError) as info:
        fp32_engine.generate_sync([request])
    assert info.value.path == "requests[0].sampling.logprobs_mode"
    assert "expected one of ['raw_logprobs', 'processed_logprobs'], got 'processed'" in str(
        info.value
    )


def test_engine_support_size_shows_a_cut_short_row(fp32_engine) -> None:
    params = SamplingParams(
        max_tokens=6, temperature=2.0, top_k=5, seed=2, ignore_eos=True, logprobs_mode=PROCESSED
    )
    out = fp32_engine.generate_sync([EngineRequest([3, 4, 5], params, sample_support_k=3)])[0]
    assert out.sample_support_size is not None and out.sample_support_size.dtype == np.int32
    assert out.sample_support_size.tolist() == [5] * 6  # more than the 3 listed ids
    assert (out.sample_support_ids >= 0).all()
