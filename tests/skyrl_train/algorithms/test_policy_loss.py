"""PPO-clip and GSPO losses, dual clip, TIS and the KL penalty on hand-computed tokens."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_train.algorithms import gspo_policy_loss, kl_penalty, ppo_policy_loss

CLIP = {"eps_clip_low": 0.2, "eps_clip_high": 0.2}


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ratios 1.5, 0.5, 1.0, 1.1 against old logprobs of 0.
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.1]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    return logprobs, old, adv


def test_clipped_surrogate_token_mean_and_gradient() -> None:
    logprobs, old, adv = _case()
    out = ppo_policy_loss(logprobs, old, adv, torch.ones(1, 4), **CLIP)
    # per token: max(-1.5, -1.2) = -1.2 (clipped), max(-0.5, -0.8) = -0.5, 1.0, 1.1
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.0 + 1.1) / 4)
    assert out.metrics["clip_fraction"] == pytest.approx(0.25)
    assert out.metrics["dual_clip_fraction"] == 0.0
    assert out.metrics["num_tokens"] == 4.0
    assert out.metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 1.1) / 4)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 1.1)]
    assert out.metrics["approx_kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)
    out.loss.backward()
    # d/dlogp of -A * ratio is -A * ratio; the clipped token gets no gradient.
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.0 / 4, 1.1 / 4], rel=1e-5)


def test_loss_mask_excludes_tokens_and_denominator_overrides_count() -> None:
    logprobs, old, adv = _case()
    mask = torch.tensor([[1, 1, 1, 0]])
    out = ppo_policy_loss(logprobs, old, adv, mask, **CLIP)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.0) / 3)
    assert out.metrics["clip_fraction"] == pytest.approx(1 / 3)
    whole = ppo_policy_loss(logprobs, old, adv, mask.bool(), **CLIP, denominator=10.0)
    assert whole.loss.item() == pytest.approx((-1.2 - 0.5 + 1.0) / 10)


def test_asymmetric_clip_high() -> None:
    logprobs, old, adv = _case()
    out = ppo_policy_loss(logprobs, old, adv, torch.ones(1, 4), eps_clip_low=0.2, eps_clip_high=0.6)
    assert out.loss.item() == pytest.approx((-1.5 - 0.5 + 1.0 + 1.1) / 4)
    assert out.metrics["clip_fraction"] == 0.0


def test_dual_clip_caps_negative_advantage_tokens() -> None:
    logprobs = torch.log(torch.tensor([[5.0, 5.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    plain = ppo_policy_loss(logprobs, torch.zeros(1, 2), adv, torch.ones(1, 2), **CLIP)
    assert plain.loss.item() == pytest.approx((5.0 - 1.2) / 2)
    dual = ppo_policy_loss(
        logprobs, torch.zeros(1, 2), adv, torch.ones(1, 2), **CLIP, clip_ratio_c=3.0
    )
    assert dual.loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert dual.metrics["dual_clip_fraction"] == pytest.approx(0.5)


def test_tis_weights_tokens_by_capped_detached_ratio() -> None:
    logprobs = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[0.5, 1.0, 0.8]])).requires_grad_()
    adv = torch.ones(1, 3)
    out = ppo_policy_loss(
        logprobs, old, adv, torch.ones(1, 3), **CLIP,
        rollout_logprobs=rollout, tis_imp_ratio_cap=1.5,
    )  # fmt: skip
    weights = [1.5, 1.0, 1.25]  # exp(0 - log 0.5) = 2 capped at 1.5
    assert out.loss.item() == pytest.approx(-sum(weights) / 3)
    assert out.metrics["tis_weight_mean"] == pytest.approx(sum(weights) / 3)
    assert out.metrics["tis_clip_fraction"] == pytest.approx(1 / 3)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-w / 3 for w in weights])
    assert rollout.grad is None  # the weight is detached


def test_tis_with_missing_rollout_logprob_weighs_one_not_the_cap_or_nan() -> None:
    # The engine's -9999 placeholder is an unknown ratio, taken as 1 (off_policy.py);
    # read as a value its log-ratio (~+9999) would put the weight at the cap, 2.
    out = ppo_policy_loss(
        torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), **CLIP,
        rollout_logprobs=torch.full((1, 1), -9999.0), tis_imp_ratio_cap=2.0,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-1.0)


def test_all_masked_gives_zero_loss_and_zero_gradient() -> None:
    logprobs, old, adv = _case()
    out = ppo_policy_loss(logprobs, old, adv, torch.zeros(1, 4), **CLIP)
    assert out.loss.item() == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.metrics["num_tokens"] == 0.0
    out.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(1, 4))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logprobs": torch.zeros(4)}, "logprobs"),
        ({"old_logprobs": torch.zeros(1, 3)}, "old_logprobs"),
        ({"advantages": torch.zeros(2, 4)}, "advantages"),
        ({"loss_mask": torch.ones(1, 5)}, "loss_mask"),
        ({"loss_mask": [[1, 1, 1, 1]]}, "loss_mask"),
        ({"eps_clip_low": 1.0}, "eps_clip_low"),
        ({"eps_clip_high": -0.1}, "eps_clip_high"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"tis_imp_ratio_cap": 2.0}, "tis_imp_ratio_cap"),
        ({"rollout_logprobs": torch.zeros(1, 4)}, "tis_imp_ratio_cap"),
        ({"rollout_logprobs": torch.zeros(1, 2), "tis_imp_ratio_cap": 2.0}, "rollout_logprobs"),
        ({"rollout_logprobs": torch.zeros(1, 4), "tis_imp_ratio_cap": 0.0}, "tis_imp_ratio_cap"),
        ({"denominator": 0.0}, "denominator"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(kwargs: dict, field: str) -> None:
    args = {
        "logprobs": torch.zeros(1, 4),
        "old_logprobs": torch.zeros(1, 4),
        "advantages": torch.zeros(1, 4),
        "loss_mask": torch.ones(1, 4),
        **CLIP,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{field}:"):
        ppo_policy_loss(**args)


def test_kl_penalty_k3() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    kl = kl_penalty(logprobs, ref, torch.tensor([[1, 0]]))
    # r = ln 0.25 - ln 0.5 = -ln 2: exp(r) - 1 - r = 0.5 - 1 + ln 2
    assert kl.item() == pytest.approx(0.5 - 1 + math.log(2), rel=1e-5)
    kl.backward()
    assert logprobs.grad is not None and logprobs.grad[0, 1] == 0.0
    assert kl_penalty(logprobs, ref, torch.zeros(1, 2)).item() == 0.0
    with pytest.raises(ValueError, match="^ref_logprobs:"):
        kl_penalty(logprobs, torch.zeros(1, 3), torch.ones(1, 2))


# ---- overflow guard: the log-ratio is clamped to +-20 before exp -----------------------


@pytest.mark.parametrize("advantage", [1.0, -1.0, 0.0])
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_extreme_log_ratios_give_finite_loss_and_gradients(
    advantage: float, clip_ratio_c: float | None
) -> None:
    # exp(100) overflows fp32 (max ~ exp(88.7)): unguarded, the loss or grads go NaN/inf.
    old = torch.full((1, 3), -2.0)
    logprobs = (old + torch.tensor([[100.0, -100.0, 0.0]])).requires_grad_()
    adv = torch.full((1, 3), advantage)
    out = ppo_policy_loss(logprobs, old, adv, torch.ones(1, 3), **CLIP, clip_ratio_c=clip_ratio_c)
    assert math.isfinite(out.loss.item())
    assert all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_log_ratio_is_clamped_at_20() -> None:
    # A = -1 and log-ratio 25: the unclipped branch wins, with the ratio capped at e^20.
    logprobs = torch.tensor([[25.0]], requires_grad=True)
    out = ppo_policy_loss(logprobs, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), **CLIP)
    assert out.loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_nan_at_a_masked_position_does_not_leak_into_the_policy_loss() -> None:
    logprobs = torch.tensor([[-0.5, float("nan")]], requires_grad=True)
    old = torch.tensor([[-0.5, float("nan")]])
    out = ppo_policy_loss(logprobs, old, torch.ones(1, 2), torch.tensor([[1, 0]]), **CLIP)
    assert out.loss.item() == pytest.approx(-1.0)
    assert all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert logprobs.grad.tolist() == [[-1.0, 0.0]]


def test_kl_penalty_ignores_nan_at_masked_positions() -> None:
    logprobs = torch.tensor([[-0.7, float("nan"), -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, float("inf")]])
    kl = kl_penalty(logprobs, ref, torch.tensor([[1, 0, 0]]))
    r = -0.3
    assert kl.item() == pytest.approx(math.exp(r) - 1 - r, rel=1e-5)
    kl.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 1:].tolist() == [0.0, 0.0]


# ---- GSPO: one importance ratio per sequence --------------------------------------------

GSPO_CLIP = {"eps_clip_low": 0.01, "eps_clip_high": 0.02}


def _gspo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Old logprobs -1; new - old per token, as ratios:
    #   seq 0: 1.2, 0.9 and a masked token (ratio e^5, must not count), A = +1
    #   seq 1: 1.1, 0.95, 1.0, A = -2
    old = torch.full((2, 3), -1.0)
    ratios = torch.tensor([[1.2, 0.9, math.exp(5.0)], [1.1, 0.95, 1.0]])
    logprobs = (old + ratios.log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logprobs, old, adv, mask


def test_gspo_hand_worked_sequences() -> None:
    logprobs, old, adv, mask = _gspo_case()
    out = gspo_policy_loss(logprobs, old, adv, mask, **GSPO_CLIP)
    # s_0 = exp((ln 1.2 + ln 0.9) / 2) = sqrt(1.08) = 1.03923 > 1.02: with A = +1 the
    # clipped term wins, -1.02 per token and no gradient.
    s0 = math.sqrt(1.2 * 0.9)
    assert s0 > 1.02
    # s_1 = (1.1 * 0.95 * 1.0)^(1/3) = 1.01478, inside [0.99, 1.02]: unclipped, per
    # token -A * s_1 = 2 * s_1.
    s1 = (1.1 * 0.95 * 1.0) ** (1 / 3)
    assert 0.99 < s1 < 1.02
    expected = (2 * -1.02 + 3 * 2 * s1) / 5  # token mean over the 5 active tokens
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert out.metrics["ratio_mean"] == pytest.approx((2 * s0 + 3 * s1) / 5, rel=1e-6)
    assert out.metrics["num_tokens"] == 5.0
    assert out.metrics["dual_clip_fraction"] == 0.0
    out.loss.backward()
    # Every token of sequence 1 gets the sequence's ratio as its gradient scale,
    # -A * s_1 / 5, whatever its own ratio (PPO would give 2 * 1.1 / 5, 2 * 0.95 / 5, ...).
    assert logprobs.grad.tolist()[0] == [0.0, 0.0, 0.0]
    assert logprobs.grad.tolist()[1] == pytest.approx([2 * s1 / 5] * 3, rel=1e-6)


def test_gspo_equals_ppo_when_each_sequence_has_one_ratio() -> None:
    old = torch.zeros(2, 4)
    logprobs = torch.tensor([[0.1] * 4, [-0.3] * 4], requires_grad=True)
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4])
    mask = torch.ones(2, 4)
    gspo = gspo_policy_loss(logprobs, old, adv, mask, **CLIP)
    ppo = ppo_policy_loss(logprobs, old, adv, mask, **CLIP)
    assert gspo.loss.item() == pytest.approx(ppo.loss.item(), rel=1e-6)
    (g_gspo,) = torch.autograd.grad(gspo.loss, logprobs)
    (g_ppo,) = torch.autograd.grad(ppo.loss, logprobs)
    assert torch.allclose(g_gspo, g_ppo)


@pytest.mark.parametrize("advantage", [1.0, -1.0, 0.0])
def test_gspo_extreme_log_ratios_and_masked_nan_stay_finite(advantage: float) -> None:
    old = torch.full((2, 3), -2.0)
    logprobs = (old + torch.tensor([[100.0, 100.0, 0.0], [-100.0, 0.0, 0.0]])).detach()
    logprobs[1, 2] = math.nan  # masked
    logprobs.requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = gspo_policy_loss(logprobs, old, torch.full((2, 3), advantage), mask, **GSPO_CLIP)
    assert math.isfinite(out.loss.item())
    assert all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_gspo_with_tis_and_denominator() -> None:
    logprobs, old, adv, mask = _gspo_case()
    plain = gspo_policy_loss(logprobs, old, adv, mask, **GSPO_CLIP, denominator=10.0)
    assert plain.loss.item() == pytest.approx(
        gspo_policy_loss(logprobs, old, adv, mask, **GSPO_CLIP).loss.item() / 2, rel=1e-6
    )
    weighted = gspo_policy_loss(
        logprobs, old, adv, mask, **GSPO_CLIP,
        rollout_logprobs=old - math.log(2.0), tis_imp_ratio_cap=1.5,
    )  # fmt: skip
    assert weighted.metrics["tis_weight_mean"] == pytest.approx(1.5)
    assert weighted.loss.item() == pytest.approx(
        1.5 * gspo_policy_loss(logprobs, old, adv, mask, **GSPO_CLIP).loss.item(), rel=1e-6
    )
