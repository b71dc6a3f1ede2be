"""Off-policy corrections (``algorithms.off_policy``) on one hand-worked batch, through
both policy losses: token and sequence TIS, the product, geometric and outlier masks,
a combination, and the engine's -9999 placeholder logprob.

The batch: 3 sequences x 4 tokens, logprobs equal to the old logprobs (PPO and GSPO
ratio 1, nothing clips), so each token's loss is -A x its weight and the loss is
-sum(A x weight) / 10, the 10 loss-active tokens. Importance ratios r = exp(old -
rollout), "-" a loss-masked token, "P" the placeholder:

    row 0, A = 1: r = 3, 0.5, 4, -   (rollout NaN)  product 6,   geometric 6^(1/3) = 1.817
    row 1, A = 2: r = 1.25, 0.8, 1, 1.1              product 1.1, geometric 1.1^(1/4) = 1.024
    row 2, A = 4: r = 0.25, - (r = 100), P, 1        product 0.25, geometric 0.25^(1/2) = 0.5

Uncorrected: -(1*3 + 2*4 + 4*3) / 10 = -2.3.
"""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_train.algorithms import (
    MISSING_LOGPROB,
    MetricSums,
    OffPolicyCorrection,
    OffPolicyStats,
    gspo_policy_loss,
    off_policy_weights,
    ppo_policy_loss,
)

NAN, P = math.nan, None
RATIOS = [[3.0, 0.5, 4.0, NAN], [1.25, 0.8, 1.0, 1.1], [0.25, 100.0, P, 1.0]]
LOSS_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]])
ADVANTAGES = torch.tensor([[1.0] * 4, [2.0] * 4, [4.0] * 4])
CLIP = {"eps_clip_low": 0.2, "eps_clip_high": 0.2}
LOSSES = {"regular": ppo_policy_loss, "gspo": gspo_policy_loss}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.full((3, 4), -1.0)
    rollout = torch.empty(3, 4)
    for i, row in enumerate(RATIOS):
        for j, r in enumerate(row):
            if r is None:
                rollout[i, j] = MISSING_LOGPROB
            elif math.isnan(r):
                rollout[i, j] = math.nan
            else:
                rollout[i, j] = -1.0 - math.log(r)
    return old.clone().requires_grad_(), old, rollout


def _loss(loss_type: str, correction: OffPolicyCorrection | None):
    logprobs, old, rollout = _batch()
    return logprobs, LOSSES[loss_type](
        logprobs,
        old,
        ADVANTAGES,
        LOSS_MASK,
        **CLIP,
        rollout_logprobs=rollout if correction is not None else None,
        off_policy_correction=correction,
    )


def _check_stats(stats: OffPolicyStats | None, **expected: float) -> None:
    assert stats is not None
    # Present in every case: 10 loss tokens, 3 rows, 1 placeholder, 9 real ratios.
    assert stats.num_tokens == 10 and stats.num_sequences == 3
    assert stats.placeholder_tokens == 1 and stats.ratio_tokens == 9
    assert stats.ratio_sum == pytest.approx(3 + 0.5 + 4 + 1.25 + 0.8 + 1 + 1.1 + 0.25 + 1)
    assert stats.ratio_min == pytest.approx(0.25) and stats.ratio_max == pytest.approx(4.0)
    metrics = stats.to_metrics()
    assert metrics["off_policy/placeholder_token_frac"] == pytest.approx(0.1)
    assert metrics["off_policy/ratio_mean"] == pytest.approx(12.9 / 9)
    assert metrics["off_policy/min_ratio"] == pytest.approx(0.25)
    assert metrics["off_policy/max_ratio"] == pytest.approx(4.0)
    for key, value in expected.items():
        assert metrics[f"off_policy/{key}"] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_no_correction_is_the_plain_loss(loss_type: str) -> None:
    _, out = _loss(loss_type, None)
    assert out.loss.item() == pytest.approx(-2.3)
    assert out.off_policy is None and "tis_weight_mean" not in out.metrics
    # All-null settings are no correction: rollout logprobs without one are refused.
    with pytest.raises(ValueError, match="^tis_imp_ratio_cap:"):
        _loss(loss_type, OffPolicyCorrection())


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_token_tis(loss_type: str) -> None:
    _, out = _loss(loss_type, OffPolicyCorrection(tis_ratio_type="token"))
    # clip 2: row 0's 3 and 4 become 2; the placeholder weighs 1.
    # weights: row 0 2 + 0.5 + 2 = 4.5; row 1 1.25 + 0.8 + 1 + 1.1 = 4.15; row 2 0.25 + 1 + 1
    assert out.loss.item() == pytest.approx(-(1 * 4.5 + 2 * 4.15 + 4 * 2.25) / 10, rel=1e-6)
    _check_stats(
        out.off_policy,
        masked_token_frac=0.0,
        masked_seq_frac=0.0,
        weight_mean=(4.5 + 4.15 + 2.25) / 10,
        weight_clip_frac=2 / 10,
    )
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.09)
    assert out.metrics["tis_clip_fraction"] == pytest.approx(0.2)


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_sequence_tis(loss_type: str) -> None:
    _, out = _loss(loss_type, OffPolicyCorrection(tis_ratio_type="sequence"))
    # One weight per row, min(product, 5): row 0 6 -> 5 (clipped), row 1 1.1, row 2
    # 0.25 (the placeholder adds nothing to the product but carries the row's weight).
    assert out.loss.item() == pytest.approx(-(1 * 5 * 3 + 2 * 1.1 * 4 + 4 * 0.25 * 3) / 10)
    _check_stats(
        out.off_policy,
        masked_token_frac=0.0,
        masked_seq_frac=0.0,
        weight_mean=(5 * 3 + 1.1 * 4 + 0.25 * 3) / 10,
        weight_clip_frac=3 / 10,
    )


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_product_mask(loss_type: str) -> None:
    # [0.2, 2]: row 0 (6) is dropped; row 2 (0.25) stays, which it would not if its
    # loss-masked r = 100 or its placeholder (read as e^20) entered the product.
    _, out = _loss(
        loss_type, OffPolicyCorrection(sequence_mask_metric="product", product_mask_low=0.2)
    )
    assert out.loss.item() == pytest.approx(-(2 * 4 + 4 * 3) / 10)
    _check_stats(
        out.off_policy,
        masked_token_frac=3 / 10,
        masked_seq_frac=1 / 3,
        weight_mean=1.0,
        weight_clip_frac=0.0,
    )
    # The default [0.5, 2] drops row 2 from below as well.
    _, out = _loss(loss_type, OffPolicyCorrection(sequence_mask_metric="product"))
    assert out.loss.item() == pytest.approx(-(2 * 4) / 10)
    _check_stats(out.off_policy, masked_token_frac=6 / 10, masked_seq_frac=2 / 3)


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_geometric_mask(loss_type: str) -> None:
    # [0.55, 1.03]: row 0 (1.817) out above, row 1 (1.024) in, row 2 out below: its mean
    # is over its 2 real ratios, 0.5; counting the placeholder would give 0.63, inside.
    correction = OffPolicyCorrection(
        sequence_mask_metric="geometric", geo_mask_low=0.55, geo_mask_high=1.03
    )
    _, out = _loss(loss_type, correction)
    assert out.loss.item() == pytest.approx(-(2 * 4) / 10)
    _check_stats(
        out.off_policy,
        masked_token_frac=6 / 10,
        masked_seq_frac=2 / 3,
        weight_mean=1.0,
        weight_clip_frac=0.0,
    )


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_outlier_mask(loss_type: str) -> None:
    # [0.2, 3.5]: row 0 has 4 > 3.5; row 2's loss-masked r = 100 and its placeholder
    # must not trip the bound.
    correction = OffPolicyCorrection(
        outlier_token_is_threshold_low=0.2, outlier_token_is_threshold_high=3.5
    )
    _, out = _loss(loss_type, correction)
    assert out.loss.item() == pytest.approx(-(2 * 4 + 4 * 3) / 10)
    _check_stats(out.off_policy, masked_token_frac=3 / 10, masked_seq_frac=1 / 3, weight_mean=1.0)
    # A low bound alone: row 2's 0.25 < 0.3 drops it.
    _, out = _loss(loss_type, OffPolicyCorrection(outlier_token_is_threshold_low=0.3))
    assert out.loss.item() == pytest.approx(-(1 * 3 + 2 * 4) / 10)
    _check_stats(out.off_policy, masked_token_frac=3 / 10, masked_seq_frac=1 / 3)


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_sequence_tis_with_geometric_and_outlier_masks(loss_type: str) -> None:
    # Geometric [0.4, 1.03] drops row 0 (1.817); the outlier low bound 0.3 drops row 2
    # (0.25; its geometric 0.5 passes); row 1 survives, its product 1.1 clipped to 1.05.
    correction = OffPolicyCorrection(
        tis_ratio_type="sequence",
        sequence_tis_ratio_clip_high=1.05,
        sequence_mask_metric="geometric",
        geo_mask_low=0.4,
        geo_mask_high=1.03,
        outlier_token_is_threshold_low=0.3,
    )
    logprobs, out = _loss(loss_type, correction)
    assert out.loss.item() == pytest.approx(-(2 * 1.05 * 4) / 10)
    _check_stats(
        out.off_policy,
        masked_token_frac=6 / 10,
        masked_seq_frac=2 / 3,
        weight_mean=1.05,
        weight_clip_frac=1.0,
    )
    out.loss.backward()
    # Dropped rows get no gradient; row 1's tokens -A x weight / 10 each (ratio 1).
    assert logprobs.grad[0].tolist() == [0.0] * 4
    assert logprobs.grad[2].tolist() == [0.0] * 4
    assert logprobs.grad[1].tolist() == pytest.approx([-2 * 1.05 / 10] * 4, rel=1e-6)


def test_masked_sequences_keep_their_tokens_in_the_denominator() -> None:
    # The masked-out rows' 6 tokens still count: -8 / 10, not -8 / 4 over the kept ones.
    _, out = _loss("regular", OffPolicyCorrection(sequence_mask_metric="product"))
    assert out.loss.item() == pytest.approx(-0.8)
    assert out.loss.item() != pytest.approx(-2.0)


# ---- the engine's placeholder logprob ------------------------------------------------


def test_placeholder_weighs_one_where_todays_tis_gave_it_the_cap() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.0 - math.log(1.5), -9999.0, -12000.0]])
    mask = torch.ones(1, 3)
    got = off_policy_weights(old, rollout, mask, OffPolicyCorrection(tis_ratio_type="token"))
    assert got.weights[0].tolist() == pytest.approx([1.5, 1.0, 1.0])
    assert got.stats.placeholder_tokens == 2 and got.stats.ratio_tokens == 1
    assert got.stats.to_metrics()["off_policy/placeholder_token_frac"] == pytest.approx(2 / 3)
    # Until now the placeholder was a value: log-ratio -2 + 9999 (and -0.5 + 12000),
    # clamped to 20, so the weight was min(e^20, cap) = the cap, 2, for a token whose
    # ratio nobody knows.
    today = min(math.exp(20.0), 2.0)
    assert today == 2.0
    assert got.weights[0, 1:].tolist() == [1.0, 1.0]

    # Through the loss (A = 1, ratio 1): -(1.5 + 1 + 1) / 3, where it was -(1.5 + 2 + 2) / 3.
    out = ppo_policy_loss(
        old.clone(), old, torch.ones(1, 3), mask, **CLIP, rollout_logprobs=rollout,
        tis_imp_ratio_cap=2.0,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-3.5 / 3)


def test_placeholder_never_masks_and_stays_out_of_the_product() -> None:
    old = torch.zeros(2, 3)
    # row 0: ratio 2 and two placeholders; row 1: placeholders only
    rollout = torch.tensor([[-math.log(2.0), -9999.0, -9999.0], [-9999.0] * 3])
    mask = torch.ones(2, 3)
    tight = OffPolicyCorrection(
        tis_ratio_type="sequence",
        sequence_tis_ratio_clip_high=5.0,
        sequence_mask_metric="product",
        product_mask_low=0.9,
        product_mask_high=2.5,
        outlier_token_is_threshold_low=0.9,
        outlier_token_is_threshold_high=2.5,
    )
    got = off_policy_weights(old, rollout, mask, tight)
    # Row 0's product is 2 (read as values, the placeholders would make it e^20: masked
    # by every bound); row 1's is 1, and it is kept.
    assert got.weights.tolist() == [[2.0] * 3, [1.0] * 3]
    assert got.stats.masked_sequences == 0 and got.stats.placeholder_tokens == 5
    geometric = OffPolicyCorrection(sequence_mask_metric="geometric")
    assert off_policy_weights(old[1:], rollout[1:], mask[1:], geometric).weights.tolist() == [
        [1.0] * 3
    ]


# ---- the older use_tis spelling, API checks ------------------------------------------


def test_tis_imp_ratio_cap_is_token_tis_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=generator) * 3
    logprobs = old + torch.randn(4, 6, generator=generator) * 0.3
    rollout = old + torch.randn(4, 6, generator=generator) * 0.5
    adv = torch.randn(4, 6, generator=generator)
    mask = torch.rand(4, 6, generator=generator) > 0.2
    for loss, extra in ((ppo_policy_loss, {"clip_ratio_c": 3.0}), (gspo_policy_loss, {})):
        legacy = loss(
            logprobs, old, adv, mask, **CLIP, **extra, rollout_logprobs=rollout,
            tis_imp_ratio_cap=1.3,
        )  # fmt: skip
        new = loss(
            logprobs, old, adv, mask, **CLIP, **extra, rollout_logprobs=rollout,
            off_policy_correction=OffPolicyCorrection(
                tis_ratio_type="token", token_tis_ratio_clip_high=1.3
            ),
        )  # fmt: skip
        assert torch.equal(legacy.loss, new.loss)
        assert legacy.metrics == new.metrics


def test_bad_settings_and_arguments_raise_naming_them() -> None:
    for kwargs, field in [
        ({"tis_ratio_type": "tokens"}, "tis_ratio_type"),
        ({"sequence_mask_metric": "mean"}, "sequence_mask_metric"),
        ({"token_tis_ratio_clip_high": 0.0}, "token_tis_ratio_clip_high"),
        ({"sequence_tis_ratio_clip_high": math.inf}, "sequence_tis_ratio_clip_high"),
        ({"product_mask_low": 3.0}, "product_mask_low"),
        ({"geo_mask_high": -1.0}, "geo_mask_high"),
        ({"outlier_token_is_threshold_low": math.nan}, "outlier_token_is_threshold_low"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            OffPolicyCorrection(**kwargs)
    logprobs, old, rollout = _batch()
    with pytest.raises(ValueError, match="^tis_imp_ratio_cap:"):
        ppo_policy_loss(
            logprobs, old, ADVANTAGES, LOSS_MASK, **CLIP, rollout_logprobs=rollout,
            tis_imp_ratio_cap=2.0, off_policy_correction=OffPolicyCorrection(tis_ratio_type="token"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="^tis_imp_ratio_cap:"):
        ppo_policy_loss(
            logprobs, old, ADVANTAGES, LOSS_MASK, **CLIP,
            off_policy_correction=OffPolicyCorrection(tis_ratio_type="token"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="^rollout_logprobs:"):
        off_policy_weights(old, rollout[:, :2], LOSS_MASK, OffPolicyCorrection())


def test_metrics_of_parts_sum_to_the_whole_batchs() -> None:
    _, old, rollout = _batch()
    token = OffPolicyCorrection(tis_ratio_type="token", outlier_token_is_threshold_high=3.5)
    top = off_policy_weights(old[:1], rollout[:1], LOSS_MASK[:1], token).stats.to_metrics()
    rest = off_policy_weights(old[1:], rollout[1:], LOSS_MASK[1:], token).stats.to_metrics()
    whole = off_policy_weights(old, rollout, LOSS_MASK, token).stats.to_metrics()
    merged = MetricSums.combine([top, rest])
    assert list(merged) == list(whole)
    for key in whole:
        assert merged[key] == pytest.approx(whole[key], rel=1e-6), key
    # Counts sum and extremes stay extreme, as recorded (not read off the key's name).
    assert merged.kind("off_policy/num_tokens") == "sum"
    assert merged.kind("off_policy/min_ratio") == "min"
    assert merged.kind("off_policy/max_ratio") == "max"
    assert (merged["off_policy/min_ratio"], merged["off_policy/max_ratio"]) == pytest.approx(
        (0.25, 4.0)
    )
    # Row 0 (outlier-masked) keeps no token: the weight mean is over rows 1-2's kept
    # tokens, which a mean of part means weighted by loss tokens would halve.
    assert top["off_policy/weight_mean"] == 0.0
    assert merged["off_policy/weight_mean"] == pytest.approx((4.15 + 2.25) / 7)
    # No real ratio at all: no min/max rather than +-inf.
    empty = off_policy_weights(
        torch.zeros(1, 2), torch.full((1, 2), -9999.0), torch.ones(1, 2), token
    ).stats.to_metrics()
    assert "off_policy/min_ratio" not in empty and "off_policy/max_ratio" not in empty
    assert all(math.isfinite(v) for v in empty.values())


def test_sequence_product_is_bounded_like_every_log_ratio() -> None:
    # 30 tokens at the per-token bound, log-ratio 20 each: the log-product 600 is clamped
    # to 20 before exp, so the weight is e^20 (under a clip that high), not inf.
    old = torch.zeros(1, 30)
    rollout = torch.full((1, 30), -25.0)
    huge_clip = OffPolicyCorrection(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=1e30)
    got = off_policy_weights(old, rollout, torch.ones(1, 30), huge_clip)
    assert got.weights[0].tolist() == pytest.approx([math.exp(20.0)] * 30, rel=1e-5)
    out = ppo_policy_loss(
        old.clone(), old, torch.ones(1, 30), torch.ones(1, 30), **CLIP,
        rollout_logprobs=rollout, off_policy_correction=huge_clip,
    )  # fmt: skip
    assert math.isfinite(out.loss.item())
