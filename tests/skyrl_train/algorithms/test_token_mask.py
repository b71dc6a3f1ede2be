"""The token-level IS mask (SkyRL's ``token_mask_is_threshold_low/high``, IcePop-style):
SkyRL's own test cases rewritten against ``off_policy_weights``, a hand-worked batch
through both losses, and the engine's -9999 placeholder under bands that exclude 1.

Ratios r = exp(old - rollout) with old = 0, so rollout = -log r.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from skyrl_train.algorithms import (
    MISSING_LOGPROB,
    OffPolicyCorrection,
    OffPolicyWeights,
    PolicyLossOutput,
    gspo_policy_loss,
    off_policy_weights,
    ppo_policy_loss,
)

P = None  # the engine's placeholder logprob
BAND: dict[str, Any] = {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}


def _rollout(ratios: list[list[float | None]]) -> torch.Tensor:
    return torch.tensor(
        [[MISSING_LOGPROB if r is P else -math.log(r) for r in row] for row in ratios]
    )


def _weights(
    ratios: list[list[float | None]], *, mask: list[list[int]] | None = None, **settings: Any
) -> OffPolicyWeights:
    rollout = _rollout(ratios)
    loss_mask = torch.ones_like(rollout) if mask is None else torch.tensor(mask)
    return off_policy_weights(
        torch.zeros_like(rollout), rollout, loss_mask, OffPolicyCorrection(**settings)
    )


def _kept(got: OffPolicyWeights) -> list[list[float]]:
    """1 where a loss-active token stays in the loss (weight > 0, no TIS here)."""
    return (got.weights > 0).float().tolist()


# ---- SkyRL's cases for its compute_token_mask, rewritten -------------------------------


def test_every_ratio_inside_the_band_masks_nothing() -> None:
    got = _weights([[math.exp(0.1), math.exp(-0.1), 1.0]], **BAND)
    assert _kept(got) == [[1.0, 1.0, 1.0]]
    assert got.stats.to_metrics()["off_policy/token_mask_frac"] == 0.0


@pytest.mark.parametrize("outside", [math.exp(2.0), math.exp(-2.0)], ids=["high", "low"])
def test_a_ratio_outside_the_band_drops_that_token_only(outside: float) -> None:
    got = _weights([[1.0, 1.0, outside]], **BAND)
    assert _kept(got) == [[1.0, 1.0, 0.0]]
    metrics = got.stats.to_metrics()
    assert metrics["off_policy/token_mask_frac"] == pytest.approx(1 / 3)
    # The token alone: its sequence stays.
    assert metrics["off_policy/masked_seq_frac"] == 0.0
    assert metrics["off_policy/masked_token_frac"] == pytest.approx(1 / 3)


def test_tokens_outside_the_loss_mask_are_not_counted() -> None:
    got = _weights([[1.0, 1.0, math.exp(5.0)]], mask=[[1, 1, 0]], **BAND)
    assert got.weights.tolist() == [[1.0, 1.0, 0.0]]  # 0: outside the loss, not masked
    assert got.stats.token_masked_tokens == 0 and got.stats.token_band_tokens == 2
    assert got.stats.to_metrics()["off_policy/token_mask_frac"] == 0.0


def test_each_row_drops_its_own_tokens() -> None:
    got = _weights([[1.0, math.exp(2.0)], [math.exp(-2.0), 1.0]], **BAND)
    assert _kept(got) == [[1.0, 0.0], [0.0, 1.0]]
    assert got.stats.to_metrics()["off_policy/token_mask_frac"] == pytest.approx(0.5)


def test_the_band_is_inclusive() -> None:
    got = _weights([[0.5, 2.0]], **BAND)
    assert _kept(got) == [[1.0, 1.0]]
    assert got.stats.token_masked_tokens == 0


def test_the_mask_alone_is_a_correction_and_changes_the_loss() -> None:
    # SkyRL: the token mask alone zeroes the third token of the loss mask (r = e^2).
    rollout = _rollout([[1.0, 1.0, math.exp(2.0)]])
    old = torch.zeros(1, 3)
    correction = OffPolicyCorrection(**BAND)
    assert correction.enabled
    out = ppo_policy_loss(
        old.clone(), old, torch.ones(1, 3), torch.ones(1, 3), eps_clip_low=0.2,
        eps_clip_high=0.2, rollout_logprobs=rollout, off_policy_correction=correction,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-2 / 3)  # was -1 uncorrected: 1 of 3 dropped
    assert out.off_policy is not None
    assert out.off_policy.to_metrics()["off_policy/token_mask_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        # One bound alone: the error names the missing one.
        ({"token_mask_is_threshold_low": 1e-4}, "token_mask_is_threshold_high"),
        ({"token_mask_is_threshold_high": 100.0}, "token_mask_is_threshold_low"),
        ({"token_mask_is_threshold_low": 2.0, "token_mask_is_threshold_high": 2.0},
         "token_mask_is_threshold_low"),
        ({"token_mask_is_threshold_low": 0.0, "token_mask_is_threshold_high": 2.0},
         "token_mask_is_threshold_low"),
        ({"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": math.inf},
         "token_mask_is_threshold_high"),
    ],
)  # fmt: skip
def test_one_bound_or_an_empty_band_is_refused(settings: dict[str, Any], field: str) -> None:
    # SkyRL turns the mask on only with both bounds and ignores one alone; a bound that
    # would silently do nothing is refused here instead.
    with pytest.raises(ValueError, match=f"^{field}:"):
        OffPolicyCorrection(**settings)


# ---- a hand-worked batch through both losses -----------------------------------------
#
# Logprobs equal the old ones (PPO and GSPO ratio 1), so each token's loss is
# -A x weight and the loss is -sum(A x weight) / 7, the 7 loss-active tokens:
#
#     row 0, A = 1: r = 1.0, 4.0, 0.5, P
#     row 1, A = 2: r = 1.2, 0.1, 1.5, - (loss-masked, r = 100)
#
# Band [0.4, 3]: row 0's 4.0 and row 1's 0.1 are dropped; 5 real tokens and the
# placeholder stay.

HAND: list[list[float | None]] = [[1.0, 4.0, 0.5, P], [1.2, 0.1, 1.5, 100.0]]
HAND_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
HAND_ADV = torch.tensor([[1.0] * 4, [2.0] * 4])
HAND_BAND: dict[str, Any] = {
    "token_mask_is_threshold_low": 0.4,
    "token_mask_is_threshold_high": 3.0,
}


def _hand_loss(loss_type: str, **settings: Any) -> PolicyLossOutput:
    rollout = _rollout(HAND)
    old = torch.zeros(2, 4)
    loss = {"regular": ppo_policy_loss, "gspo": gspo_policy_loss}[loss_type]
    return loss(
        old.clone(), old, HAND_ADV, HAND_MASK, eps_clip_low=0.2, eps_clip_high=0.2,
        rollout_logprobs=rollout, off_policy_correction=OffPolicyCorrection(**settings),
    )  # fmt: skip


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_hand_worked_token_tis_with_the_band(loss_type: str) -> None:
    out = _hand_loss(loss_type, tis_ratio_type="token", **HAND_BAND)
    # weights (clip 2, nothing kept is above it): row 0 1 + 0 + 0.5 + 1 (placeholder)
    # = 2.5; row 1 1.2 + 0 + 1.5 = 2.7
    assert out.loss.item() == pytest.approx(-(1 * 2.5 + 2 * 2.7) / 7, rel=1e-6)
    assert out.off_policy is not None
    metrics = out.off_policy.to_metrics()
    expected = {
        "num_tokens": 7.0,
        "token_mask_frac": 2 / 6,  # over the 6 real ratios the band judged
        "masked_token_frac": 2 / 7,
        "masked_seq_frac": 0.0,
        "placeholder_token_frac": 1 / 7,
        "ratio_mean": (1 + 4 + 0.5 + 1.2 + 0.1 + 1.5) / 6,
        "weight_mean": (2.5 + 2.7) / 5,
        "weight_clip_frac": 0.0,
        "min_ratio": 0.1,
        "max_ratio": 4.0,
    }
    assert dict(metrics) == pytest.approx({f"off_policy/{k}": v for k, v in expected.items()})
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.04)


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_dropped_tokens_leave_the_sequence_ratio_and_the_geometric_mean(loss_type: str) -> None:
    # SkyRL's order: the token mask first, then sequence TIS and the sequence mask over
    # the tokens left. Products: row 0 1 x 0.5 = 0.5, row 1 1.2 x 1.5 = 1.8; geometric
    # 0.707 and 1.342, both inside [0.7, 1.4]. Had the dropped tokens counted, the
    # products would be 2.0 and 0.18 and row 1's geometric 0.565 would drop it.
    out = _hand_loss(
        loss_type,
        tis_ratio_type="sequence",
        sequence_mask_metric="geometric",
        geo_mask_low=0.7,
        geo_mask_high=1.4,
        **HAND_BAND,
    )
    # row 0: 0.5 on its 3 kept tokens (the placeholder carries the row's weight);
    # row 1: 1.8 on its 2
    assert out.loss.item() == pytest.approx(-(1 * 0.5 * 3 + 2 * 1.8 * 2) / 7, rel=1e-6)
    assert out.off_policy is not None and out.off_policy.masked_sequences == 0


@pytest.mark.parametrize("loss_type", ["regular", "gspo"])
def test_the_outlier_mask_comes_first_and_shrinks_what_the_band_judges(loss_type: str) -> None:
    # Outlier high 3.5 drops row 0 (4.0) whole; the band then judges row 1's 3 tokens
    # and drops one (SkyRL's token_mask_ratio: 1/3, not 2/7).
    out = _hand_loss(loss_type, outlier_token_is_threshold_high=3.5, **HAND_BAND)
    assert out.loss.item() == pytest.approx(-(2 * 2) / 7, rel=1e-6)
    assert out.off_policy is not None
    metrics = out.off_policy.to_metrics()
    assert metrics["off_policy/token_mask_frac"] == pytest.approx(1 / 3)
    assert metrics["off_policy/masked_token_frac"] == pytest.approx(5 / 7)
    assert metrics["off_policy/masked_seq_frac"] == pytest.approx(1 / 2)


# ---- the placeholder under bands that exclude 1 --------------------------------------

# Row 0: one real ratio 2 and two placeholders; row 1: placeholders only. Every band
# below is [1.5, 3]: it excludes 1, the value a placeholder's ratio is taken as, so
# only a rule of its own keeps the placeholder (and row 1) in.
PLACEHOLDER_ROWS: list[list[float | None]] = [[2.0, P, P], [P, P, P]]
BANDS_WITHOUT_ONE: dict[str, dict[str, Any]] = {
    "outlier": {"outlier_token_is_threshold_low": 1.5, "outlier_token_is_threshold_high": 3.0},
    "token": {"token_mask_is_threshold_low": 1.5, "token_mask_is_threshold_high": 3.0},
    "product": {"sequence_mask_metric": "product", "product_mask_low": 1.5,
                "product_mask_high": 3.0},
    "geometric": {"sequence_mask_metric": "geometric", "geo_mask_low": 1.5,
                  "geo_mask_high": 3.0},
}  # fmt: skip


@pytest.mark.parametrize("tis", ["token", "sequence"])
@pytest.mark.parametrize("band", list(BANDS_WITHOUT_ONE))
def test_a_placeholder_never_masks_its_sequence_or_itself(band: str, tis: str) -> None:
    got = _weights(PLACEHOLDER_ROWS, tis_ratio_type=tis, **BANDS_WITHOUT_ONE[band])
    # Row 0 weighs 2 (its real ratio) on its real token, and its placeholders 1 under
    # token TIS or the row's 2 under sequence TIS; row 1, with no evidence, weighs 1.
    placeholder_weight = 1.0 if tis == "token" else 2.0
    assert got.weights.tolist() == [[2.0, placeholder_weight, placeholder_weight], [1.0] * 3]
    assert got.stats.placeholder_tokens == 5
    assert got.stats.masked_sequences == 0 and got.stats.masked_tokens == 0
    metrics = got.stats.to_metrics()
    assert metrics["off_policy/token_mask_frac"] == 0.0


def test_token_mask_frac_is_over_the_tokens_the_band_judges() -> None:
    # Row [1, 4, P, P] under [0.5, 2]: the band judges the 2 real ratios and drops one;
    # the placeholders it never judges stay out of the denominator (1/2, not 1/4).
    got = _weights([[1.0, 4.0, P, P]], **BAND)
    assert _kept(got) == [[1.0, 0.0, 1.0, 1.0]]
    assert got.stats.token_band_tokens == 2 and got.stats.token_masked_tokens == 1
    metrics = got.stats.to_metrics()
    assert metrics["off_policy/token_mask_frac"] == pytest.approx(1 / 2)
    assert metrics["off_policy/masked_token_frac"] == pytest.approx(1 / 4)
    assert metrics["off_policy/placeholder_token_frac"] == pytest.approx(2 / 4)


def test_a_real_ratio_outside_a_band_without_one_still_masks() -> None:
    # The rule is about placeholders only: a real ratio of 1 is outside [1.5, 3].
    for band, kept in (("outlier", [0.0, 0.0]), ("token", [0.0, 1.0])):
        got = _weights([[1.0, P]], **BANDS_WITHOUT_ONE[band])
        assert got.weights[0].tolist() == kept, band
    for band in ("product", "geometric"):
        assert _weights([[1.0, P]], **BANDS_WITHOUT_ONE[band]).stats.masked_sequences == 1


@pytest.mark.parametrize("band", ["product", "geometric"])
def test_a_row_whose_evidence_the_token_band_dropped_is_not_judged_by_the_sequence_mask(
    band: str,
) -> None:
    # Row [1.0, P]: the band [1.5, 3] drops the 1.0; only the placeholder is left, no
    # evidence, so a sequence window that excludes 1 must not drop the row.
    settings = dict(BANDS_WITHOUT_ONE["token"], **BANDS_WITHOUT_ONE[band])
    got = _weights([[1.0, P]], **settings)
    assert got.weights.tolist() == [[0.0, 1.0]]
    assert got.stats.masked_sequences == 0
