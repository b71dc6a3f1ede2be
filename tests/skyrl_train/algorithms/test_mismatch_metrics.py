"""Rollout-vs-trainer logprob mismatch and router agreement on hand-made examples."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_train.algorithms import logprob_mismatch, router_agreement


def test_logprob_mismatch_hand_computed() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -3.0, -7.0]])
    rollout = torch.tensor([[-1.5, -2.0, -0.5, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the 6-nat gap on token 3 is masked out
    m = logprob_mismatch(trainer, rollout, mask)
    # r = trainer - rollout = 0.5, 0, -2.5
    assert m.num_tokens == 3 and m.num_missing == 0
    assert m.mean_abs_diff == pytest.approx(1.0)
    assert m.max_abs_diff == pytest.approx(2.5)
    assert m.frac_abs_diff_gt_ln2 == pytest.approx(1 / 3)
    k3 = [math.exp(r) - 1 - r for r in (0.5, 0.0, -2.5)]
    assert m.k3_kl == pytest.approx(sum(k3) / 3)
    metrics = m.to_metrics("mismatch")
    assert metrics["mismatch/max_abs_logp_diff"] == pytest.approx(2.5)
    assert metrics["mismatch/num_tokens"] == 3.0


def test_k3_sign_convention_is_trainer_minus_rollout() -> None:
    # r = +1 gives e - 2 = 0.718; r = -1 gives 1/e = 0.368. Swapping the sign would swap them.
    up = logprob_mismatch(torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    down = logprob_mismatch(torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    assert up.k3_kl == pytest.approx(math.e - 2)
    assert down.k3_kl == pytest.approx(1 / math.e)


def test_ln2_threshold_is_strict() -> None:
    ln2 = math.log(2.0)
    m = logprob_mismatch(
        torch.tensor([[0.0, 0.0]], dtype=torch.float64),
        torch.tensor([[-ln2, -ln2 - 1e-3]], dtype=torch.float64),
        torch.ones(1, 2),
    )
    assert m.frac_abs_diff_gt_ln2 == pytest.approx(0.5)


def test_missing_rollout_logprobs_are_skipped_and_counted() -> None:
    m = logprob_mismatch(
        torch.tensor([[-1.0, -1.0]]), torch.tensor([[-9999.0, -1.5]]), torch.ones(1, 2)
    )
    assert m.num_missing == 1 and m.num_tokens == 1
    assert m.max_abs_diff == pytest.approx(0.5)
    assert math.isfinite(m.k3_kl)


def test_all_masked_mismatch_is_zero_not_nan() -> None:
    m = logprob_mismatch(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert (m.mean_abs_diff, m.max_abs_diff, m.k3_kl, m.frac_abs_diff_gt_ln2) == (0, 0, 0, 0)
    assert m.num_tokens == 0


@pytest.mark.parametrize(
    ("trainer", "rollout", "mask", "field"),
    [
        (torch.zeros(3), torch.zeros(3), torch.ones(3), "trainer_logprobs"),
        (torch.zeros(1, 3), torch.zeros(1, 4), torch.ones(1, 3), "rollout_logprobs"),
        (torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(3, 1), "loss_mask"),
        (torch.tensor([[float("nan")]]), torch.zeros(1, 1), torch.ones(1, 1), "trainer_logprobs"),
    ],
)
def test_mismatch_bad_inputs(trainer, rollout, mask, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        logprob_mismatch(trainer, rollout, mask)


def _routes(rows: list[list[list[int]]]) -> torch.Tensor:
    return torch.tensor([rows])  # [1, S, L, K]


def test_router_agreement_compares_sets_per_token_layer() -> None:
    trainer = _routes([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
    rollout = _routes([[[1, 0], [2, 3]], [[4, 5], [6, 0]], [[0, 2], [3, 1]]]).to(torch.uint8)
    # token 0: both layers equal (order differs); token 1: layer 1 differs; token 2: equal.
    a = router_agreement(trainer, rollout)
    assert a.agreement == pytest.approx(5 / 6)
    assert a.per_layer == pytest.approx([1.0, 2 / 3])
    assert a.num_token_layers == 6
    padded = router_agreement(trainer, rollout, torch.tensor([[False, True, False]]))
    assert padded.agreement == 1.0 and padded.num_token_layers == 4
    assert a.to_metrics("r3")["r3/router_agreement"] == pytest.approx(5 / 6)


def test_router_agreement_counts_repeated_ids_as_different_sets() -> None:
    a = router_agreement(_routes([[[0, 1]]]), _routes([[[1, 1]]]))
    assert a.agreement == 0.0


def test_router_agreement_all_padded_is_defined() -> None:
    routes = torch.zeros(2, 3, 4, 2, dtype=torch.int64)
    a = router_agreement(routes, routes + 1, torch.ones(2, 3, dtype=torch.bool))
    assert a.agreement == 1.0 and a.num_token_layers == 0
    assert a.per_layer == [1.0] * 4


@pytest.mark.parametrize(
    ("trainer", "rollout", "mask", "field"),
    [
        (torch.zeros(3, 4, 2, dtype=torch.long), torch.zeros(3, 4, 2, dtype=torch.long), None, "trainer_routes"),
        (torch.zeros(1, 3, 4, 2, dtype=torch.long), torch.zeros(1, 3, 4, 3, dtype=torch.long), None, "rollout_routes"),
        (torch.zeros(1, 3, 4, 2), torch.zeros(1, 3, 4, 2, dtype=torch.long), None, "trainer_routes"),
        (torch.zeros(1, 3, 4, 2, dtype=torch.long), torch.zeros(1, 3, 4, 2, dtype=torch.bool), None, "rollout_routes"),
        (torch.zeros(1, 3, 4, 2, dtype=torch.long), torch.zeros(1, 3, 4, 2, dtype=torch.long), torch.zeros(1, 4, dtype=torch.bool), "router_padding_mask"),
    ],
)  # fmt: skip
def test_router_agreement_bad_inputs(trainer, rollout, mask, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        router_agreement(trainer, rollout, mask)
