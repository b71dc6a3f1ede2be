"""How far the trainer's forward is from the rollout's: logprobs and expert routes.

These are R3's health metrics. Without replay about 0.7-4.1% of token-layer routing
decisions flip between bf16 generation and the fp32 trainer on CPU; with replay the
agreement is 1.0 and the logprob gap is bf16-vs-fp32 arithmetic only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from skyrl_train.algorithms._common import (
    MISSING_LOGPROB,
    as_float_mask,
    check_same_shape,
    check_tensor,
    k3,
)
from skyrl_train.algorithms.metrics import MetricSums

LN2 = math.log(2.0)


@dataclass
class LogprobMismatch:
    """Over loss-active tokens whose rollout logprob is present (all 0.0 when none)."""

    mean_abs_diff: float
    max_abs_diff: float
    k3_kl: float
    """Mean of exp(r) - 1 - r, r = logp_trainer - logp_rollout: KL(rollout || trainer)
    estimated on the rollout's own samples."""
    frac_abs_diff_gt_ln2: float
    """Share of tokens whose probability differs by more than 2x either way."""
    num_tokens: int
    num_missing: int
    """Loss-active tokens skipped because the engine sent no usable logprob."""

    def to_metrics(self, prefix: str) -> MetricSums:
        """The means as sums over ``num_tokens`` (so ranks combine by their own token
        counts), the max as a max, the counts as sums."""
        metrics = MetricSums()
        n = float(self.num_tokens)
        metrics.mean(f"{prefix}/mean_abs_logp_diff", self.mean_abs_diff * n, n)
        metrics.maximum(f"{prefix}/max_abs_logp_diff", self.max_abs_diff)
        metrics.mean(f"{prefix}/k3_kl", self.k3_kl * n, n)
        metrics.mean(f"{prefix}/frac_abs_logp_diff_gt_ln2", self.frac_abs_diff_gt_ln2 * n, n)
        metrics.total(f"{prefix}/num_tokens", n)
        metrics.total(f"{prefix}/num_missing_logprobs", float(self.num_missing))
        return metrics


@torch.no_grad()
def logprob_mismatch(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    missing_logprob: float = MISSING_LOGPROB,
) -> LogprobMismatch:
    """Compare per-token logprobs ``[B, R]`` of the sampled tokens over ``loss_mask``.

    Rollout logprobs at or below ``missing_logprob`` are the engine's placeholder for
    a value it could not send; they are skipped, since exp(r) of a -9999 gap overflows.
    """
    trainer = check_tensor(trainer_logprobs, "trainer_logprobs", ndim=2)
    rollout = check_tensor(rollout_logprobs, "rollout_logprobs", ndim=2)
    check_same_shape(rollout, "rollout_logprobs", trainer.shape, "trainer_logprobs")
    mask = as_float_mask(loss_mask, "loss_mask", shape=trainer.shape, ref_name="trainer_logprobs")
    active = mask.bool()
    present = active & (rollout > missing_logprob)
    num_missing = int((active & ~present).sum())
    # float64: exp(r) stays finite for |r| up to ~700 (float32 overflows at ~88).
    r = (trainer.double() - rollout.double())[present]
    if r.numel() == 0:
        return LogprobMismatch(0.0, 0.0, 0.0, 0.0, num_tokens=0, num_missing=num_missing)
    if not torch.isfinite(r).all():
        raise ValueError("trainer_logprobs: expected finite logprobs on loss-active tokens")
    gap = r.abs()
    return LogprobMismatch(
        mean_abs_diff=gap.mean().item(),
        max_abs_diff=gap.max().item(),
        k3_kl=k3(r).mean().item(),
        frac_abs_diff_gt_ln2=(gap > LN2).double().mean().item(),
        num_tokens=int(r.numel()),
        num_missing=num_missing,
    )


@dataclass
class RouterAgreement:
    """Share of (token, layer) top-k selections equal as sets, over unpadded rows."""

    agreement: float
    """1.0 when no row was compared (no decision compared, none disagrees)."""
    per_layer: list[float]
    num_token_layers: int

    def to_metrics(self, prefix: str) -> MetricSums:
        """The agreement as agreeing token-layers over ``num_token_layers`` (1.0 while
        none was compared), and that count."""
        metrics = MetricSums()
        n = float(self.num_token_layers)
        metrics.mean(f"{prefix}/router_agreement", self.agreement * n, n, empty=1.0)
        metrics.total(f"{prefix}/num_token_layers", n)
        return metrics


@torch.no_grad()
def routes_differ(trainer_routes: torch.Tensor, rollout_routes: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` bool: True where two ``[..., L, K]`` expert selections differ as sets
    (the order within K is the router's, not a choice)."""
    trainer = torch.sort(trainer_routes.long(), dim=-1).values
    return (trainer != torch.sort(rollout_routes.long(), dim=-1).values).any(dim=-1)


@torch.no_grad()
def router_agreement(
    trainer_routes: torch.Tensor,
    rollout_routes: torch.Tensor,
    router_padding_mask: torch.Tensor | None = None,
) -> RouterAgreement:
    """Compare expert selections ``[B, S, L, K]`` row by row, ignoring the order within K.

    ``router_padding_mask`` [B, S] is True on rows to skip (padding, uncaptured rows);
    None compares every row. Integer dtypes may differ (uint8 on the wire, int64 here).
    """
    trainer = check_tensor(trainer_routes, "trainer_routes", ndim=4)
    rollout = check_tensor(rollout_routes, "rollout_routes", ndim=4)
    check_same_shape(rollout, "rollout_routes", trainer.shape, "trainer_routes")
    for name, value in (("trainer_routes", trainer), ("rollout_routes", rollout)):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {value.dtype}")
    batch, seq, layers, _ = trainer.shape
    if router_padding_mask is None:
        keep = torch.ones(batch, seq, dtype=torch.bool)
    else:
        keep = ~as_float_mask(
            router_padding_mask,
            "router_padding_mask",
            shape=trainer.shape[:2],
            ref_name="routes[:, :, 0, 0]",
        ).bool()
    same = ~routes_differ(trainer, rollout)  # [B, S, L]
    rows = int(keep.sum())
    if rows == 0:
        return RouterAgreement(agreement=1.0, per_layer=[1.0] * layers, num_token_layers=0)
    kept = same[keep]  # [rows, L]
    per_layer = kept.double().mean(dim=0)
    return RouterAgreement(
        agreement=kept.double().mean().item(),
        per_layer=[float(x) for x in per_layer],
        num_token_layers=rows * layers,
    )
