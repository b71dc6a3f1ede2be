"""Off-policy corrections (SkyRL's ``trainer.algorithm.off_policy_correction``): per-token
loss weights from how far the trainer's old policy is from the policy that sampled.

The rollout was sampled by the inference engine (another numeric stack, and with
fully-async training an older policy), while PPO's ratio is taken against the
trainer's old policy. Per loss-active token the importance ratio is

    ratio_t = exp(clamp(old_logprobs_t - rollout_logprobs_t, -20, 20))

and the correction turns it into one weight per token: truncated importance sampling
(token or sequence level) scales the token's loss, the sequence and outlier masks drop
whole sequences whose ratios say the sample is too far off-policy to learn from, and
the token band (SkyRL's ``token_mask_is_threshold_low/high``, IcePop-style) drops only
the tokens whose own ratio is outside it.

Placeholder tokens: the engine sends ``MISSING_LOGPROB`` (-9999.0) when it could not
report a finite logprob. Such a token's ratio is unknown, not huge: it is no evidence
either way, so it never masks anything, under any band, even one that excludes 1 (a
rule of its own here, not a consequence of taking the ratio as 1): weight 1 under
token TIS, left out of every product and mean, never dropped by the token band, and
counted in ``placeholder_token_frac``. A row with no ratio to judge it by (all
placeholders, or every real token dropped by the token band) is kept by the sequence
masks. Taken at face value its log-ratio would be ~+9999, the weight would sit at the
TIS cap and the sequence would fail every mask.

Everything here is computed without gradient: the weights are constants of the step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from skyrl_train.algorithms._common import (
    LOG_RATIO_BOUND,
    MISSING_LOGPROB,
    as_float_mask,
    check_same_shape,
    check_tensor,
    masked_log_ratio,
)
from skyrl_train.algorithms.metrics import MetricSums

TisRatioType = Literal["token", "sequence"]
TIS_RATIO_TYPES: tuple[str, ...] = get_args(TisRatioType)
"""``off_policy_correction.tis_ratio_type`` values besides null (SkyRL's names)."""
SequenceMaskMetric = Literal["product", "geometric"]
SEQUENCE_MASK_METRICS: tuple[str, ...] = get_args(SequenceMaskMetric)
"""``off_policy_correction.sequence_mask_metric`` values besides null (SkyRL's names)."""


@dataclass(frozen=True)
class OffPolicyCorrection:
    """The settings ``off_policy_weights`` applies; field names and defaults are the
    config node's (``config.schema.OffPolicyCorrectionConfig``, SkyRL's keys), whose
    docstrings say what each one does. Built from a config with
    ``from_algorithm_config``, which also maps the older ``use_tis`` keys."""

    tis_ratio_type: str | None = None
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0
    sequence_mask_metric: str | None = None
    product_mask_low: float = 0.5
    product_mask_high: float = 2.0
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None

    def __post_init__(self) -> None:
        # Config values are range-checked at launch (schema ``setting``s); these checks
        # catch a direct caller, so a bad bound cannot silently mask everything.
        for name, value, choices in (
            ("tis_ratio_type", self.tis_ratio_type, TIS_RATIO_TYPES),
            ("sequence_mask_metric", self.sequence_mask_metric, SEQUENCE_MASK_METRICS),
        ):
            if value is not None and value not in choices:
                raise ValueError(f"{name}: expected None or one of {list(choices)}, got {value!r}")
        for name in ("token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number > 0, got {value}")
        for low_name, high_name in (
            ("product_mask_low", "product_mask_high"),
            ("geo_mask_low", "geo_mask_high"),
            ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
        ):
            low, high = getattr(self, low_name), getattr(self, high_name)
            for name, value in ((low_name, low), (high_name, high)):
                if value is not None and not (value >= 0 and not math.isnan(value)):
                    raise ValueError(f"{name}: expected a number >= 0, got {value}")
            if low is not None and high is not None and low > high:
                raise ValueError(f"{low_name}: expected <= {high_name} ({high}), got {low}")
        self._check_token_band()

    def _check_token_band(self) -> None:
        """The token band is on only with both bounds (SkyRL's rule); one alone would be
        silently ignored there, so it is refused here, as is an empty band."""
        low, high = self.token_mask_is_threshold_low, self.token_mask_is_threshold_high
        for name, bound, other_name, other in (
            ("token_mask_is_threshold_low", low, "token_mask_is_threshold_high", high),
            ("token_mask_is_threshold_high", high, "token_mask_is_threshold_low", low),
        ):
            if bound is not None and not (math.isfinite(bound) and bound > 0):
                raise ValueError(f"{name}: expected None or a finite number > 0, got {bound}")
            if bound is None and other is not None:
                raise ValueError(
                    f"{name}: expected a number beside {other_name} ({other}); both None "
                    "turns the token mask off, got None"
                )
        if low is not None and high is not None and not low < high:
            raise ValueError(
                f"token_mask_is_threshold_low: expected < token_mask_is_threshold_high "
                f"({high}), got {low}"
            )

    @property
    def enabled(self) -> bool:
        """Whether any weight or mask applies (all-null settings change nothing)."""
        return (
            self.tis_ratio_type is not None
            or self.sequence_mask_metric is not None
            or self.outlier_token_is_threshold_low is not None
            or self.outlier_token_is_threshold_high is not None
            or self.token_mask_is_threshold_low is not None
        )

    @classmethod
    def from_algorithm_config(cls, algorithm: Any) -> OffPolicyCorrection:
        """The settings a ``trainer.algorithm`` node asks for.

        ``use_tis: true`` is the older spelling of ``tis_ratio_type: token`` with
        ``token_tis_ratio_clip_high = tis_imp_ratio_cap``: it applies when
        ``tis_ratio_type`` is null. When both spellings are set they must agree, which
        the launch checks (``config.off_policy.check_off_policy_correction``); called
        without that check, the ``off_policy_correction`` keys win.
        """
        node = algorithm.off_policy_correction
        values = {f.name: getattr(node, f.name) for f in dataclasses.fields(cls)}
        if algorithm.use_tis and values["tis_ratio_type"] is None:
            values.update(
                tis_ratio_type="token", token_tis_ratio_clip_high=algorithm.tis_imp_ratio_cap
            )
        return cls(**values)


@dataclass
class OffPolicyStats:
    """Counts behind the correction's metrics, kept as sums (and a min/max) so that
    microbatches and ranks combine into the whole batch's means: each metric is its
    own numerator over its own denominator (``to_metrics``), summed before dividing."""

    num_tokens: float = 0.0
    """Loss-active tokens."""
    num_sequences: float = 0.0
    """Rows with at least one loss-active token."""
    masked_tokens: float = 0.0
    """Loss-active tokens a mask gave weight 0: a dropped sequence's, or one outside
    the token band."""
    masked_sequences: float = 0.0
    """Rows with loss-active tokens dropped whole (sequence or outlier mask)."""
    token_band_tokens: float = 0.0
    """Loss-active tokens with a real rollout logprob in rows the outlier mask kept:
    the ones the token band judges (placeholders have no ratio to judge)."""
    token_masked_tokens: float = 0.0
    """Of those, the ones whose ratio is outside the token band (0 with the band off)."""
    placeholder_tokens: float = 0.0
    """Loss-active tokens whose rollout logprob was the engine's placeholder."""
    ratio_tokens: float = 0.0
    """Loss-active tokens with a real rollout logprob: the ones a ratio is known for."""
    ratio_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    kept_tokens: float = 0.0
    """Loss-active tokens left in the loss (``num_tokens - masked_tokens``)."""
    weight_sum: float = 0.0
    """Sum of the weights of the kept tokens."""
    clipped_tokens: float = 0.0
    """Kept tokens whose TIS weight was cut at its clip."""

    def to_metrics(self, prefix: str = "off_policy") -> MetricSums:
        """Shares of tokens are over ``num_tokens``, of sequences over
        ``num_sequences``, the token band's over the tokens it judged; the weight mean
        and clip share are over the tokens left in the loss (masking is its own
        metric); the ratio over tokens with a real rollout logprob. Each is recorded
        as its numerator and that denominator (an empty one reads 0.0), min/max as
        extremes, left out when no ratio was seen."""
        metrics = MetricSums()
        metrics.total(f"{prefix}/num_tokens", self.num_tokens)
        for name, part, whole in (
            ("masked_token_frac", self.masked_tokens, self.num_tokens),
            ("masked_seq_frac", self.masked_sequences, self.num_sequences),
            ("token_mask_frac", self.token_masked_tokens, self.token_band_tokens),
            ("placeholder_token_frac", self.placeholder_tokens, self.num_tokens),
            ("ratio_mean", self.ratio_sum, self.ratio_tokens),
            ("weight_mean", self.weight_sum, self.kept_tokens),
            ("weight_clip_frac", self.clipped_tokens, self.kept_tokens),
        ):
            metrics.mean(f"{prefix}/{name}", part, whole)
        if self.ratio_tokens > 0:
            metrics.minimum(f"{prefix}/min_ratio", self.ratio_min)
            metrics.maximum(f"{prefix}/max_ratio", self.ratio_max)
        return metrics


@dataclass
class OffPolicyWeights:
    weights: torch.Tensor
    """``[B, R]`` detached per-token loss weights; 0 on masked sequences and on tokens
    outside the loss mask."""
    clipped: torch.Tensor
    """``[B, R]`` bool, True on kept tokens whose TIS weight was cut at its clip."""
    stats: OffPolicyStats


@torch.no_grad()
def off_policy_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    correction: OffPolicyCorrection,
) -> OffPolicyWeights:
    """Per-token loss weights ``[B, R]`` and their counts for one (micro)batch.

    In SkyRL's order, with r_t the ratio of each loss-active token with a real rollout
    logprob:

    1. ``outlier_token_is_threshold_low/high``: sequence i is dropped when any r_t is
       below low or above high (either may be None: no bound on that side);
    2. ``token_mask_is_threshold_low/high``: each token of a sequence still kept whose
       r_t is outside [low, high] is dropped on its own (IcePop);
    3. the sequence quantities are taken over the tokens left ("evidence": real and
       not dropped by step 2), L_i = clamp(sum_t log r_t, -20, 20):
       ``tis_ratio_type: token``: w_t = min(r_t, token_tis_ratio_clip_high);
       ``sequence``: every token of sequence i gets min(exp(L_i),
       sequence_tis_ratio_clip_high);
    4. ``sequence_mask_metric: product``: sequence i is dropped when exp(L_i) is outside
       [product_mask_low, product_mask_high]; ``geometric``: when exp(mean_t log r_t) is
       outside [geo_mask_low, geo_mask_high]; a row with no evidence is kept.

    Every band is inclusive. Dropped tokens get weight 0 (and stay in the loss's
    token count: ``policy_loss._clipped_surrogate``). Placeholder tokens (rollout
    logprob <= ``MISSING_LOGPROB``, or NaN) have no ratio: no band drops them or
    their row, and under TIS they weigh 1 (token) or their row's weight (sequence).
    """
    old = check_tensor(old_logprobs, "old_logprobs", ndim=2)
    rollout = check_tensor(rollout_logprobs, "rollout_logprobs", ndim=2)
    check_same_shape(rollout, "rollout_logprobs", old.shape, "old_logprobs")
    mask = as_float_mask(loss_mask, "loss_mask", shape=old.shape, ref_name="old_logprobs")
    if not isinstance(correction, OffPolicyCorrection):
        raise ValueError(
            f"correction: expected an OffPolicyCorrection, got {type(correction).__name__}"
        )
    c = correction
    active = mask > 0
    # ``>`` is False for NaN too: a NaN that got past the wire is as unknown as -9999.
    real = active & (rollout > MISSING_LOGPROB)
    placeholder = active & ~real
    # Exactly 0 off the real tokens (selected, not multiplied, so -9999 or NaN there
    # cannot leak), each term clamped to +-20 like every other log-ratio here.
    log_ratio = masked_log_ratio(old.detach(), rollout.detach(), real.to(mask.dtype))
    ratio = torch.exp(log_ratio)

    outlier = _outside(ratio, c.outlier_token_is_threshold_low, c.outlier_token_is_threshold_high)
    keep = ~(real & outlier).any(dim=1)
    # What the token band judges: real ratios only (a placeholder is never dropped, so
    # counting it would dilute token_mask_frac), in rows the outlier mask kept.
    band_tokens = real & keep[:, None]
    token_dropped = torch.zeros_like(real)
    if c.token_mask_is_threshold_low is not None:
        band = _outside(ratio, c.token_mask_is_threshold_low, c.token_mask_is_threshold_high)
        token_dropped = band_tokens & band
    evidence = real & ~token_dropped
    evidence_log = torch.where(evidence, log_ratio, torch.zeros_like(log_ratio))
    per_row = evidence.sum(dim=1)
    # Per-token terms are already bounded, but a long sequence's sum is not: clamp it
    # again before exp, so the product is at most e^20 whatever the length.
    sequence_ratio = torch.exp(evidence_log.sum(dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if c.sequence_mask_metric is not None:
        if c.sequence_mask_metric == "product":
            value, low, high = sequence_ratio, c.product_mask_low, c.product_mask_high
        else:
            # Mean over the evidence only: a placeholder is no evidence either way, so
            # it must not pull the mean toward 1.
            value = torch.exp(evidence_log.sum(dim=1) / per_row.clamp(min=1))
            low, high = c.geo_mask_low, c.geo_mask_high
        # A row with no evidence has product 1 by convention, not by measurement: a band
        # that excludes 1 must not drop it.
        keep &= ~_outside(value, low, high) | (per_row == 0)

    weight = torch.ones_like(ratio)
    clipped = torch.zeros_like(real)
    if c.tis_ratio_type == "token":
        weight = ratio.clamp(max=c.token_tis_ratio_clip_high)
        clipped = real & (ratio > c.token_tis_ratio_clip_high)
    elif c.tis_ratio_type == "sequence":
        cap = c.sequence_tis_ratio_clip_high
        weight = sequence_ratio.clamp(max=cap)[:, None].expand_as(ratio)
        clipped = active & (sequence_ratio > cap)[:, None]
    kept = active & keep[:, None] & ~token_dropped
    weight = torch.where(kept, weight, torch.zeros_like(weight))
    clipped = clipped & kept

    has_tokens = active.any(dim=1)
    # Reductions over selections (never boolean indexing, whose size the host must
    # learn), stacked so that all counts reach the host in one transfer: on GPU each
    # ``.item()`` would be its own sync. With no real ratio, min/max stay +-inf.
    values = {
        "num_tokens": active.sum(),
        "num_sequences": has_tokens.sum(),
        "masked_tokens": (active & ~kept).sum(),
        "masked_sequences": (has_tokens & ~keep).sum(),
        "token_band_tokens": band_tokens.sum(),
        "token_masked_tokens": token_dropped.sum(),
        "placeholder_tokens": placeholder.sum(),
        "ratio_tokens": real.sum(),
        "ratio_sum": torch.where(real, ratio, torch.zeros_like(ratio)).sum(),
        "ratio_min": torch.where(real, ratio, torch.full_like(ratio, math.inf)).amin(),
        "ratio_max": torch.where(real, ratio, torch.full_like(ratio, -math.inf)).amax(),
        "kept_tokens": kept.sum(),
        "weight_sum": weight.sum(),  # 0 off the kept tokens
        "clipped_tokens": clipped.sum(),
    }
    host = torch.stack([v.double() for v in values.values()]).tolist()
    stats = OffPolicyStats(**dict(zip(values, host, strict=True)))
    return OffPolicyWeights(weights=weight.detach(), clipped=clipped, stats=stats)


def _outside(ratio: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Where ``ratio`` is outside the inclusive band [low, high] (None: no bound)."""
    out = torch.zeros_like(ratio, dtype=torch.bool)
    if low is not None:
        out |= ratio < low
    if high is not None:
        out |= ratio > high
    return out
